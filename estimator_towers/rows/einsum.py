"""Einsum and batched linear algebra: where an equation puts the batch's examples.

The rule. An `Einsum` is read by its equation. Its operands that depend on
the shard (the batch operands) have a batch axis: axis 0 for rows and flat
rows, axis 1 for columns; an operand's batch letter is its subscript there.
The product is per-example (rows of the same stacked layout, or flat where
the batch operands are flat) where every batch operand has the same batch
letter, once in its subscripts (no diagonal across examples), no operand
that does not depend on the batch (weights) has it, and it is the output's
first letter: Keras' `EinsumDense` (`abc,cde->abde`), BERT's and Keras'
attention (`BTNH,BFNH->BNFT`, `aecd,abcd->acbe`). The batch letter as the
output's second letter gives columns (`bi->ib`, of one batch operand: the
frontier before them is its rows); left out of the output it is summed
over the examples, a statistic (`bi,bj->ij`, a Gram matrix).
Everything else mixes: two batch letters pair different examples
(`ab,cb->ac`, an in-batch similarity), the letter moved further, a batch
operand's rows with weights indexed by the batch axis, or with a statistic
that is not a batch norm's (as a matrix product: `statistics`), or an
ellipsis over an operand whose rank is unknown when the graph is built.

A batched linear algebra op (`tf.linalg`'s inverse, Cholesky, determinant,
solves, decompositions: `op_tables.BATCHED_MATRICES`) works on each matrix
of its [..., m, m] inputs alone: of rows (or flat rows) of rank 3 or more
its outputs are such rows, with weights of rank 2 or less broadcast over the
batch; of rank 2 the batch axis is a matrix axis, which mixes (a diagonal
or band of rows: `sizes`). The gradient of an einsum is einsums, but the
reader reads the forward graph only.
"""

from __future__ import annotations

import string

from estimator_towers.rows.kinds import (COLS, COLS_KIND, FLAT, FLAT_KIND, ROWS, ROWS_KIND, SHAPE,
                                         SIZE, SIZE_KIND, STAT, STAT_KIND, Kind, stat_of)
from estimator_towers.rows.op_tables import BATCHED_MATRICES

_BATCH_AXIS = {ROWS: 0, FLAT: 0, COLS: 1}


def subscripts(equation: str, ranks: list) -> tuple[list, str] | None:
  """`equation`'s subscripts per operand and the output's, each ellipsis spelled as letters.

  None where an operand with an ellipsis has an unknown rank (or the equation
  cannot be read). An equation without '->' (implicit output) gives None too:
  `tf.einsum` always writes the output.
  """
  equation = equation.replace(' ', '')
  if '->' not in equation:
    return None
  left, output = equation.split('->')
  operands = left.split(',')
  if len(operands) != len(ranks):
    return None
  free = [c for c in string.ascii_letters if c not in equation]
  lengths = []
  for sub, rank in zip(operands, ranks):
    if '...' in sub:
      if rank is None:
        return None
      lengths.append(rank - len(sub.replace('...', '')))
  width = max(lengths, default=0)
  if width < 0 or width > len(free) or any(n < 0 for n in lengths):
    return None
  letters = ''.join(free[:width])   # the ellipsis's axes, aligned from the right (broadcast)
  spelled, index = [], 0
  for sub in operands:
    if '...' in sub:
      sub = sub.replace('...', letters[width - lengths[index]:])
      index += 1
    spelled.append(sub)
  return spelled, output.replace('...', letters)


def _einsum(reader, op, kinds):
  equation = op.get_attr('equation')
  equation = equation.decode() if isinstance(equation, bytes) else equation
  read = subscripts(equation, [t.shape.rank for t in op.inputs])
  if read is None:
    return (f'an einsum whose equation the library cannot place on the batch axis '
            f'(equation {equation}: an ellipsis over an operand of unknown rank)')
  operands, output = read
  batch = [(s, k) for s, k in zip(operands, kinds) if k is not None and k.tag in _BATCH_AXIS]
  others = [(s, k) for s, k in zip(operands, kinds) if k is not None and k.tag not in _BATCH_AXIS]
  weights = [s for s, k in zip(operands, kinds) if k is None]
  if any(k.tag not in (STAT, SIZE, SHAPE) for _, k in others):
    return (f'an einsum of values that are not one row per example '
            f'({", ".join(sorted({k.tag for _, k in others}))})')
  if not batch:   # statistics and batch-size values only
    present = [k for _, k in others]
    return stat_of(present) if any(k.tag == STAT for k in present) else SIZE_KIND
  layout = _layout([k for _, k in batch])
  if isinstance(layout, str):
    return f'{layout} (equation {equation})'
  letters = {s[_BATCH_AXIS[k.tag]] for s, k in batch if len(s) > _BATCH_AXIS[k.tag]}
  if len(letters) != 1 or any(len(s) <= _BATCH_AXIS[k.tag] for s, k in batch):
    return f'an einsum that pairs different examples (equation {equation})'
  letter = letters.pop()
  if any(s.count(letter) != 1 for s, _ in batch):
    return f'an einsum along a diagonal across the batch\'s examples (equation {equation})'
  if any(letter in s for s in weights + [s for s, _ in others]):
    return (f'an einsum that pairs the batch axis with an axis of other values '
            f'(equation {equation})')
  place = output.find(letter)
  if others:
    stats = [k for _, k in others]
    if place == 0 and all(k.tag == STAT and k.norm for k in stats):
      return layout   # a batch norm's statistics: rows stay rows (`sync_batch_norm`'s choice)
    what = ('a statistic of the batch' if any(k.tag == STAT for k in stats)
            else 'a value of the batch size')
    return f'an einsum of the batch\'s rows with {what} (equation {equation})'
  if place < 0:
    return STAT_KIND   # summed over the examples (x^T y)
  if place == 0:
    return layout
  if place == 1 and layout in (ROWS_KIND, COLS_KIND) and len(batch) == 1:
    return COLS_KIND   # one batch operand (the reader's frontier walks back to its rows)
  return f'an einsum that moves the batch axis (equation {equation})'


def _layout(kinds: list, what: str = 'an einsum'):
  """The kind of a per-example product of batch operands of `kinds`, or why they cannot meet."""
  tags = {k.tag for k in kinds}
  if tags == {FLAT}:   # the same rows per example kept (`Kind.per`), unknown if any is
    if len({k.blocks for k in kinds}) > 1:
      return 'an einsum of flat rows of different stacked layouts'
    pers = {k.per for k in kinds}
    if len(pers) > 1 and None not in pers:
      return 'an einsum of flat rows of different rows per example'
    return kinds[0] if len(pers) == 1 else Kind(FLAT, kinds[0].blocks)
  if FLAT in tags:
    return f'{what} of rows with values of another row layout'
  blocks = {k.blocks for k in kinds if k.tag == ROWS}
  if len(blocks) > 1 or (COLS in tags and blocks - {1}):
    return f'{what} of rows of different stacked layouts'
  return Kind(ROWS, blocks.pop()) if blocks and blocks != {1} else ROWS_KIND


def _batched_matrices(reader, op, kinds):
  present = [k for k in kinds if k is not None]
  if all(k.tag in (STAT, SIZE, SHAPE) for k in present):
    return stat_of(present) if any(k.tag == STAT for k in present) else SIZE_KIND
  for t, k in zip(op.inputs, kinds):
    if k is None and (t.shape.rank is None or t.shape.rank > 2):
      return (f'a batched matrix op ({op.type}) of the batch\'s rows with other values '
              f'stacked on a batch axis')
  if any(k is not None and k.tag not in (ROWS, FLAT) for k in kinds):
    return (f'a batched matrix op ({op.type}) of values that are not one row per '
            f'example ({", ".join(sorted({k.tag for k in present}))})')
  ranks = [t.shape.rank for t, k in zip(op.inputs, kinds) if k is not None]
  if any(r is None or r < 3 for r in ranks):
    return (f'a matrix op ({op.type}) whose matrix axes include the batch axis (rank '
            f'{min((r for r in ranks if r is not None), default="unknown")}, not a [n, m, m] '
            f'batch of matrices)')
  return _layout(present, f'a batched matrix op ({op.type})')


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {'Einsum': _einsum, **dict.fromkeys(BATCHED_MATRICES, _batched_matrices)}
