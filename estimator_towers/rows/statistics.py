"""Statistics: reductions over the batch axis, matrix products, batch norms.

The rule. A reduction over the batch axis of rows or flat rows that adds up
over the shards (a sum, a mean, `L2Loss`) is a statistic; `tf.nn.moments`
over axis 0 and a fused batch norm's are a batch norm's, which normalising
rows keeps them rows (`sync_batch_norm`'s choice); a fused batch norm of
flat rows (a batch norm over every token: [n * T, 1, 1, d]) keeps them flat,
in their blocks. A reduction over the batch axis that no sum of the shards'
values gives (a max, a min, an arg-max or arg-min, a product, `reduce_all` /
`reduce_any`, a Euclidean norm; a logsumexp, made from a max) mixes the
rows: the loss that reads it trains through its head on the whole batch. A
reduction over other axes keeps the rows. A matrix product sums over the
batch (a statistic) where both operands' batch axes are summed, keeps it
where one operand is the batch's and the other's weights do not depend on it
(also [n, ..., a, b] rows times [b, c] weights, broadcast over the batch),
and mixes where both operands' batch axes stay (an in-batch similarity
matrix) or rows meet a statistic that is not a batch norm's. Ops across
workers give totals of statistics (`cross_worker`, sync batch norm) and mix
anything else. Entries lifted onto
axis 1 ([1, n, ...]) are summed over the batch by a reduction over axis 1,
kept by one over later axes and by a batched product with weights.
"""

from __future__ import annotations

import tensorflow as tf

from estimator_towers.rows.kinds import (COLS, COLS_KIND, FLAT, LIFTED, LIFTED_SHAPE, NORM_KIND,
                                         ROWS, ROWS_KIND, SHAPE, SIZE, SIZE_KIND, STAT, STAT_KIND,
                                         Kind, stat_of, unlifted)
from estimator_towers.rows.op_tables import FUSED_BATCH_NORMS, REDUCTIONS
from estimator_towers.rows.static_values import axes_of


def across_workers(op: tf.Operation, present: list):
  """A collective or a scatter: a total or a table of statistics, else why it mixes."""
  # across workers: a total or a table of statistics (cross_worker, sync batch norm)
  if present and all(k.tag in (STAT, SIZE, SHAPE) for k in present):
    return stat_of(present) if any(k.tag == STAT for k in present) else SIZE_KIND
  return f'an op across workers or a scatter of the batch\'s rows ({op.type})'


def _in_moments(op: tf.Operation) -> bool:
  """True for a reduction that `tf.nn.moments` (or sync batch norm) made: a batch norm's."""
  return any('moments' in part or part.startswith('SyncBatchNorm')
             for part in op.name.split('/')[:-1])


def _statistic(op: tf.Operation, kind: Kind):
  """A reduction of `kind` values over the batch axis."""
  if kind.tag in (ROWS, FLAT):
    return NORM_KIND if _in_moments(op) else STAT_KIND
  return kind if kind.tag != SHAPE else SIZE_KIND


# Reductions over the batch that no sum of the shards' values gives: a max, a min, an
# arg-max, a product, a logical and / or (and a norm, the root of a sum the loss algebra
# cannot see inside). Over the batch axis they mix its rows: the loss that reads them trains
# through its head on the whole batch.
_NOT_SUMS = {'Max': 'a max', 'Min': 'a min', 'ArgMax': 'an arg-max', 'ArgMin': 'an arg-min',
             'Prod': 'a product', 'All': 'a logical and', 'Any': 'a logical or',
             'EuclideanNorm': 'a Euclidean norm'}


def _reduction(reader, op, kinds):
  kind, axes_kind = kinds[0], kinds[1]
  if axes_kind is not None:
    return 'a reduction over axes that depend on the batch'
  if kind.tag in (STAT, SIZE, SHAPE, LIFTED_SHAPE):
    return kind if kind.tag == STAT else SIZE_KIND
  axes = axes_of(op.inputs[1], op.inputs[0].shape.rank)
  if axes is None:
    return 'a reduction over axes unknown when the graph is built'
  if kind.tag == LIFTED:   # [1, n, ...]: the batch on axis 1
    if 1 not in axes:
      return kind if all(a >= 2 for a in axes) else (
          'a reduction of the new axis before entries lifted onto axis 1')
    over_batch = True
  elif kind.tag == COLS:
    over_batch = 1 in axes or not axes
  else:
    over_batch = 0 in axes or kind.tag == FLAT and not axes
  if not over_batch and kind.tag == COLS and 0 in axes and not op.get_attr('keep_dims') and (
      op.type not in ('ArgMax', 'ArgMin')):
    return ROWS_KIND   # [T, n, ...] over T: the batch on axis 0 again
  if not over_batch:
    return kind
  if op.type in _NOT_SUMS and not _in_moments(op):
    return (f'{_NOT_SUMS[op.type]} over the batch, which no sum of the shards\' '
            f'statistics gives')
  if kind.tag == LIFTED:
    return _statistic(op, unlifted(kind))
  return STAT_KIND if kind.tag == COLS else _statistic(op, kind)


def _l2_loss(reader, op, kinds):
  return _statistic(op, unlifted(kinds[0]) if kinds[0].tag == LIFTED else kinds[0])


def _matmul(reader, op, kinds):
  a, b = kinds[0], kinds[1]
  batched = op.type != 'MatMul'
  ranks = [t.shape.rank for t in op.inputs[:2]]
  if batched and a is not None and a.tag == LIFTED and b is None and ranks[0] and (
      ranks[0] >= 3 and ranks[1] and ranks[1] <= 2 and not op.get_attr('adj_x')):
    return a   # the same weights for every entry
  if batched and any(r is not None and r >= 3 for r in ranks):
    if a is not None and b is not None and a.tag == b.tag == ROWS and a.blocks == b.blocks and (
        all(r >= 3 for r in ranks if r is not None)):
      return a   # one product per example
    if (a is not None and a.tag in (ROWS, FLAT) and b is None and ranks[0] and ranks[0] >= 3
        and ranks[1] and ranks[1] <= 2) or (
            b is not None and b.tag in (ROWS, FLAT) and a is None and ranks[1] and
            ranks[1] >= 3 and ranks[0] and ranks[0] <= 2):
      return a if a is not None else b   # the same weights for every example (broadcast)
    if ranks[0] and ranks[0] >= 3 and ranks[1] and ranks[1] >= 3:
      return 'a batched matrix product of the batch with other values'
  flips = (op.get_attr('adj_x'), op.get_attr('adj_y')) if batched else (
      op.get_attr('transpose_a'), op.get_attr('transpose_b'))
  # Where each operand's batch axis goes: 'free' (a result axis) or 'summed'.
  places = []
  for i, k in enumerate((a, b)):
    axis = _batch_axis(k)
    if axis is None or (ranks[i] is not None and ranks[i] != 2):
      places.append(None if k is None or k.tag in (STAT, SIZE) else 'unknown')
      continue
    if flips[i]:
      axis = 1 - axis
    free = axis == 0 if i == 0 else axis == 1
    places.append('free' if free else 'summed')
  if 'unknown' in places:
    return 'a matrix product of values with the batch on an unknown axis'
  if places == ['summed', 'summed']:
    return STAT_KIND   # a sum over the examples (x^T y, a count by a dot product)
  if places[0] is not None and places[1] is not None:
    return 'a matrix product of two operands that depend on the batch'
  other = b if places[0] is not None else a
  place = places[0] if places[0] is not None else places[1]
  if place is None:   # statistics and batch-size values only
    return stat_of([a, b]) if any(k is not None and k.tag == STAT for k in (a, b)) else SIZE_KIND
  if other is not None:   # the batch's rows against a statistic
    if other.tag == STAT and other.norm and place == 'free':
      return a if places[0] is not None else COLS_KIND
    return ('a matrix product of the batch\'s rows with a statistic of the batch'
            if other.tag == STAT else 'a matrix product of the batch\'s rows with a value '
            'of the batch size')
  if place == 'summed':
    return STAT_KIND
  if places[0] is not None:
    return Kind(a.tag, a.blocks, per=a.per) if a.tag != COLS else ROWS_KIND
  return COLS_KIND


def _batch_axis(kind: Kind | None) -> int | None:
  if kind is None:
    return None
  return {ROWS: 0, FLAT: 0, COLS: 1}.get(kind.tag)


def _batch_norm(reader, op, kinds):
  if kinds[0] is not None and kinds[0].tag == COLS and (
      op.get_attr('data_format') in (b'NCHW', 'NCHW')) and all(
          k is None or k.tag in (SIZE, SHAPE, ROWS, FLAT) for k in kinds[1:]):
    return [COLS_KIND] + [ROWS_KIND] * (len(op.outputs) - 1)   # statistics per example: layer norm
  if (kinds[0] is None or kinds[0].tag == STAT) and all(
      k is None or k.tag == STAT for k in kinds[1:]) and not any(kinds[1:3]):
    return NORM_KIND   # another tower's rows on the global statistics (sync batch norm)
  if any(k is not None for k in kinds[1:3]) or kinds[0] is None:
    return 'a batch norm whose scale or offset depends on the batch'
  if any(k is not None and k.tag != STAT for k in kinds[3:]):
    return 'a batch norm whose statistics are not the batch\'s statistics'
  if kinds[0].tag not in (ROWS, FLAT):
    return 'a batch norm of values that are not one row per example'
  # Rows or flat rows (a reshape of [n, T, d] to [n * T, 1, 1, d]): the statistics are
  # over every entry of the batch's examples, the normalised entries stay where they were.
  return [kinds[0]] + [NORM_KIND] * (len(op.outputs) - 1)


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {**dict.fromkeys(REDUCTIONS | {'ArgMax', 'ArgMin'}, _reduction), 'L2Loss': _l2_loss,
         **dict.fromkeys(('MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3'), _matmul),
         **dict.fromkeys(FUSED_BATCH_NORMS, _batch_norm)}
