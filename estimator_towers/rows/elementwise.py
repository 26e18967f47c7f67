"""Elementwise: ops within each row, and rows combined with other values.

The rule. An elementwise op (with broadcasting) or one applied within each
row (a softmax, a layer: `op_tables`) keeps its operands' rows: rows with
rows of the same stacked layout, or with values that depend on no input of
the shard, are rows; flat with flat of the same rows per example is flat
(flat rows keep how many entries each example has; of different counts they
mix); statistics and batch-size values combined stay such. Rows combined
with a statistic of the batch (but a batch norm's: `sync_batch_norm`'s
choice), with a batch-size value, with rows of another layout, or with a
value as long as a static batch (its row i meets example i; but one whose
rows are all the same, `tf.ones([n, T, 1])`, or TensorFlow's gradient of a sum
over a static shape and its matrix products) mix the batch's rows. A layer
mixes where its weights depend on the batch. A cast or identity of
`tf.where`'s positions keeps them positions; any other op on them mixes (a
position is the shard's layout, not a value of its example). Entries lifted
onto axis 1 ([1, n, ...]) stay such with values that do not depend on the
shard and broadcast along axis 1, under an op applied within each row only
where axis 1 is not the last.
"""

from __future__ import annotations

import numpy as np

from estimator_towers.base import shapes
from estimator_towers.rows.kinds import (COLS, COLS_KIND, FLAT, LIFTED, LIFTED_SHAPE,
                                         MIXED_KIND, NORM_KIND, POSITIONS, ROWS, SHAPE,
                                         SHAPE_KIND, SIZE, SIZE_KIND, STAT, STAT_KIND, UNIQUE,
                                         UNIQUE_KIND, Kind, flat_kind, stat_of)
from estimator_towers.rows.op_tables import ARITHMETIC, ELEMENTWISE, LAYERS
from estimator_towers.rows.static_values import static_value

# Ops that keep their one operand's values (and so what they index or how they are laid
# out): positions stay positions, offsets and indices stay such.
KEEPS = frozenset(('Identity', 'Cast', 'StopGradient', 'Snapshot', 'CheckNumerics',
                   'EnsureShape', 'PreventGradient'))


def not_rows(op, kind: Kind):
  """A statistic's or batch size's kind through an op of rows; else why it mixes."""
  if kind.tag in (STAT, SIZE, SHAPE):
    return kind if kind.tag != SHAPE else SIZE_KIND
  return f'an op on values that are not one row per example ({kind.tag})'


def elementwise(reader, op, kinds: list):
  """The kind of an elementwise combination of `kinds` (a Kind or why it mixes)."""
  present = [k for k in kinds if k is not None]
  tags = {k.tag for k in present}
  if POSITIONS in tags:
    if len(present) == 1 and op.type in KEEPS:
      return present[0]
    return 'arithmetic on tf.where\'s positions (the shard\'s layout, not an example\'s values)'
  if LIFTED_SHAPE in tags:   # sizes of [1, n, ...]: n is a count of the batch's entries
    return SIZE_KIND if tags <= {LIFTED_SHAPE, SIZE, SHAPE} else (
        'entries lifted onto axis 1 combined with their shape')
  if LIFTED in tags:
    return _lifted(op, kinds, present)
  if COLS in tags:
    return COLS_KIND if tags == {COLS} else 'values with the batch on axis 1 combined with rows'
  if UNIQUE in tags:
    return UNIQUE_KIND if tags == {UNIQUE} else 'the batch\'s distinct values combined with rows'
  if tags <= {ROWS}:
    blocks = {k.blocks for k in present}
    if len(blocks) > 1:
      return 'rows of different stacked layouts combined'
    return _rows_with_constants(reader, op, kinds, present[0])
  if tags <= {FLAT}:
    return _flat(op, present)
  if tags <= {STAT}:
    return NORM_KIND if all(k.norm for k in present) else STAT_KIND
  if tags == {SHAPE}:   # still the batch size first
    if len(set(present)) == 1 and op.type in KEEPS:
      return present[0]
    return SHAPE_KIND if all(k.layout is None for k in present) else SIZE_KIND
  if tags <= {SIZE, SHAPE}:
    return SIZE_KIND
  if tags <= {STAT, SIZE, SHAPE}:
    return stat_of(present)
  rows = [k for k in present if k.tag in (ROWS, FLAT)]
  others = [k for k in present if k.tag not in (ROWS, FLAT)]
  if {k.tag for k in rows} == {ROWS, FLAT}:
    return 'rows combined with values of another row layout'
  if all(k.tag == STAT and k.norm for k in others):
    return rows[0]   # a batch norm: sync_batch_norm's
  if any(k.tag == STAT for k in others):
    return 'rows combined with a statistic of the batch'
  return 'rows combined with a value of the batch size'


def _flat(op, present):
  """Flat rows combined: the same rows per example kept, another layout mixes them."""
  blocks = {k.blocks for k in present}
  if len(blocks) > 1:
    return 'flat rows of different stacked layouts combined'
  pers = {k.per for k in present}
  if len(pers) == 1:
    return flat_kind(present[0].per, present[0].blocks)
  if None in pers and len(pers) == 2:   # the same entries: the known count is theirs
    return flat_kind([p for p in pers if p is not None][0], present[0].blocks)
  return 'flat rows of different rows per example combined'


def _lifted(op, kinds, present):
  """Lifted entries ([1, n, ...]) with values that do not depend on the shard."""
  if any(k != present[0] for k in present):
    return 'entries lifted onto axis 1 combined with other values of the batch'
  rank = op.outputs[0].shape.rank
  if rank is None or (op.type not in ARITHMETIC and rank < 3):
    return 'an op within each row of entries lifted onto axis 1, along their batch axis'
  for t, k in zip(op.inputs, kinds):
    at = None if t.shape.rank is None else 1 - (rank - t.shape.rank)
    if k is None and (at is None or (at >= 0 and shapes.dim(t, at) != 1)):
      return 'entries lifted onto axis 1 combined with values along their batch axis'
  return present[0]


def _same_rows(t, depth: int = 0) -> bool:
  """Whether every row of `t` is the same by construction: a [1, ...] value tiled or
  broadcast along axis 0 (`tf.tile(offset, [n, 1])`, the gradient TensorFlow builds of a
  sum over a static shape), a fill, ones or zeros like a value, a copy, cast or arithmetic
  of such values (with values that broadcast along axis 0), or a matrix product of one
  with a matrix (`_grad/MatMul` of such a gradient)."""
  op = t.op
  if depth >= 8:
    return False
  if op.type in ('Identity', 'Cast', 'StopGradient', 'Neg'):
    return _same_rows(op.inputs[0], depth + 1)
  if op.type in ('Fill', 'ZerosLike', 'OnesLike'):
    return True
  if op.type in ('Tile', 'BroadcastTo'):
    source = op.inputs[0].shape
    return source.rank is not None and (source.rank < t.shape.rank or shapes.dim(source) == 1)
  if op.type == 'MatMul' and not op.get_attr('transpose_a'):
    return _same_rows(op.inputs[0], depth + 1)
  if op.type in ARITHMETIC and t.shape.rank:
    return all(_broadcast_rows(x, t.shape.rank, depth + 1) for x in op.inputs)
  return False


def _broadcast_rows(x, rank: int, depth: int) -> bool:
  """Whether `x`, an operand of an elementwise op of `rank`, is the same for every row."""
  if x.shape.rank is None:
    return False
  if x.shape.rank < rank or shapes.dim(x) == 1:
    return True   # broadcast along axis 0
  value = static_value(x)
  return (value is not None and bool(np.all(value == value[:1]))) or _same_rows(x, depth)


def _rows_with_constants(reader, op, kinds, kind):
  """Rows and values independent of the shard; one as long as a static batch (its row i
  meets example i) mixes them, unless every row of it is the same (`tf.ones([n, T, 1])`)."""
  if reader.examples is not None and reader.examples > 1 and op.type != 'IdentityN':
    for t, k in zip(op.inputs, kinds):
      rank = t.shape.rank
      if (k is None and rank and shapes.dim(t) == reader.examples * kind.blocks
          and any(i.shape.rank == rank for i, j in zip(op.inputs, kinds) if j is not None)):
        value = static_value(t)
        if (value is not None and np.all(value == value[:1])) or _same_rows(t):
          continue   # the same row for every example
        return ('rows combined with a value as long as the batch (a static batch '
                'size made it a constant)')
  return kind


def _within_rows(reader, op, kinds):
  if op.type == 'IdentityN':
    return [k if k is not None else MIXED_KIND for k in kinds]
  return elementwise(reader, op, kinds)


def _layer(reader, op, kinds):
  if any(k is not None for k in kinds[1:]):
    return 'a layer whose weights depend on the batch'
  return kinds[0] if kinds[0].tag in (ROWS, FLAT) else not_rows(op, kinds[0])


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {**dict.fromkeys(ELEMENTWISE, _within_rows), **dict.fromkeys(LAYERS, _layer)}
