"""Flat rows: entries of the batch's examples, in example order, not one row per example.

The rule. Every row of a flat tensor belongs to one example, in example
order: a SparseTensor's indices and values and a RaggedTensor's flat values
(as the shard's inputs flatten them: `input_kinds`), a reshape of [n, T, d]
to [n * T, d] (`stacked`), `tf.boolean_mask`'s rows, `tf.where`'s indices;
sums of it are still statistics. The sparse ops that keep the entries of
each example give flat rows or rows back (`sparse`, which also reads a
SparseTensor's indices, marked as such here). A RaggedTensor's row splits are their
own kind: their differences are rows (each example's length), the segment
ids made from them flat, a segment sum by those ids rows again. A gather of
a table by the rows' ids keeps the ids' rows; the batch's distinct values
(`tf.unique`: `sparse`) partitioned and stitched for a partitioned table stay
such. Gathers, partitions and stitches across the batch axis mix it.

Positions: `tf.where`'s indices are positions in the shard's rows (of a
mask of rows: the first column is the example) or in its flat rows (of a
flat mask: a position in the flattening of `per` entries per example). A
`gather_nd` by them keeps each entry with its example only where they are
positions in the same rows: rows by a mask of rows, flat rows of `per`
entries by a flat mask of the same `per`; any other values used as
positions pick other examples' rows and mix them. A `scatter_nd` of
entries back to those positions (`updates` one per index, in the same
order: gathered by those indices, or computed from such) into a tensor of
the batch size times `per` rows (`tf.shape(x)[0] * T`, the pad-removing
FFN's re-padding) is flat rows of `per` entries again (rows for positions
of rows); any other scatter of the batch's rows mixes them.

Each example's own rows (`indexing`): `range(n) * T`, n the shard's
examples, are offsets of index T (each example's first row in a flat tensor
of T rows per example; with a static batch, the constant [0, T, ...] of the
shard), positions (rows, each in [0, T): the input's promise, as BERT's
masked positions) plus them are indices of index T. A gather of rows or
flat rows by indices of their own rows per example is per-example: rows for
indices of [n, P], flat rows of P per example for [n * P]. Indices of
another T, a gather of the batch's rows by any other positions (they index
the whole batch, not each example's rows), and any other op on positions
plus offsets mix the rows; any other op reads offsets as batch-size values.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.base import shapes
from estimator_towers.rows.elementwise import KEEPS as _KEEPS, not_rows
from estimator_towers.rows.kinds import (FLAT, FLAT_KIND, INDICES, LIFTED_SHAPE, MIXED, OFFSETS,
                                         POSITIONS, ROWS, ROWS_KIND, SHAPE, SHAPE_KIND, SIZE,
                                         SIZE_KIND, SPLITS, SPLITS_KIND, STAT, STAT_KIND, UNIQUE,
                                         UNIQUE_KIND, Kind, flat_kind, rows_per_example, stat_of)
from estimator_towers.rows import sparse
from estimator_towers.rows.sizes import size_symbol, batch_multiple
from estimator_towers.rows.static_values import axes_of, product, static_value


def input_kinds(inputs: Sequence[tf.Tensor]) -> dict:
  """Rows; a SparseTensor's (indices, values, dense_shape), as flattened: flat, flat, shape."""
  kinds, i = {}, 0
  while i < len(inputs):
    window = inputs[i:i + 3]
    if len(window) == 3 and _sparse(*window):
      per = f'sparse:{window[0].name}'
      kinds.update({window[0].name: sparse.indices(per), window[1].name: flat_kind(per),
                    window[2].name: SHAPE_KIND})
      i += 3
      continue
    if len(window) >= 2 and _ragged(*window[:2]):
      kinds.update({window[0].name: Kind(FLAT, per=f'ragged:{window[0].name}'),
                    window[1].name: SPLITS_KIND})
      i += 2
      continue
    kinds[inputs[i].name] = ROWS_KIND
    i += 1
  return kinds


def _ragged(values: tf.Tensor, splits: tf.Tensor) -> bool:
  """A RaggedTensor of one ragged dimension, as flattened: (flat_values, row_splits)."""
  return (splits.dtype in (tf.int32, tf.int64) and splits.shape.rank == 1
          and 'Ragged' in splits.op.name and 'Ragged' in values.op.name)


def _sparse(indices: tf.Tensor, values: tf.Tensor, shape: tf.Tensor) -> bool:
  rank = shapes.dim(indices, 1) if indices.shape.rank == 2 else None
  return (indices.dtype == tf.int64 and indices.shape.rank == 2 and values.shape.rank == 1
          and (indices.op is values.op or (_named(indices, 'indices') and _named(values, 'values')))
          and shape.dtype == tf.int64 and shape.shape.rank == 1
          and (rank is None or shapes.dim(shape) is None or shapes.dim(shape) == rank))


def _named(t: tf.Tensor, component: str) -> bool:
  """Whether `t`'s op is named as a SparseTensor's `component` (TensorFlow's uniquified
  names too: `indices_1`, each SparseTensor's gate of a micro-batch)."""
  return re.search(rf'(^|/){component}(_\d+)?$', t.op.name) is not None


def splits(op, kinds):
  """A RaggedTensor's row_splits: its slices, their differences, its segment ids."""
  tags = {k.tag for k in kinds if k is not None}
  if op.type == 'StridedSlice' and kinds[0] is not None and tags == {SPLITS}:
    return SPLITS_KIND   # splits[1:], splits[:-1]
  if op.type in ('Sub',) and tags == {SPLITS}:
    return ROWS_KIND   # row lengths
  if op.type in ('Shape', 'Size') and tags == {SPLITS}:
    return SHAPE_KIND if op.type == 'Shape' else SIZE_KIND
  if op.type in ('Identity', 'Cast') and tags == {SPLITS}:
    return SPLITS_KIND
  return 'an op on a RaggedTensor\'s row splits'


def segment_sum(op, kinds):
  """A segment reduction (`SEGMENT_SUMS`): a ragged row's sum is rows, else why it mixes."""
  data, ids = kinds[0], kinds[1]
  if data is not None and data.tag in (ROWS, FLAT) and ids is not None and (
      ids.tag == FLAT and 'RaggedSplitsToSegmentIds' in op.inputs[1].op.name) and all(
          k is None or k.tag in (SIZE, SHAPE) for k in kinds[2:]):
    return ROWS_KIND   # each example's entries reduced (a ragged row's sum)
  return 'a segment reduction across the batch\'s rows'


def _partition(reader, op, kinds):   # embedding_lookup of a partitioned table, by id
  if kinds[0] is not None and kinds[0].tag == UNIQUE and kinds[1] is not None and (
      kinds[1].tag == UNIQUE):
    return UNIQUE_KIND
  return 'a partition of the batch\'s rows by value'


def _stitch(reader, op, kinds):
  if all(k is None or k.tag == UNIQUE for k in kinds):
    return UNIQUE_KIND
  return 'a stitch of the batch\'s rows by index'


def _gather(reader, op, kinds):
  params, indices = kinds[0], kinds[1]
  axis = 0
  if op.type == 'GatherV2':
    if kinds[2] is not None:
      return 'a gather along an axis computed from the batch'
    value = static_value(op.inputs[2])
    if value is None:
      return 'a gather along an axis unknown when the graph is built'
    axis = int(value)
    if axis < 0:
      rank = op.inputs[0].shape.rank
      axis = axis + rank if rank is not None else -1
  if op.type == 'ResourceGather':
    params = None if params is None or params.tag != MIXED else params
  if indices is not None and indices.tag == POSITIONS:
    shape = op.inputs[1].shape   # [k] or [k, 1]: one position each (not [k, 2]'s columns)
    one = shape.rank == 1 or shape.rank is not None and shape.rank > 1 and shapes.dim(shape, -1) == 1
    if params is not None and axis == 0 and one and _positions_of(params, indices):
      return Kind(FLAT, per=indices.per)   # tf.boolean_mask: entries at their own positions
    if params is not None and axis == 0 and params.tag == FLAT and params.per is None and (
        params.blocks == 1):
      return Kind(FLAT, per=indices.per)   # entries of a mask of no known count: its own
    return 'a gather at tf.where\'s positions in other rows than the ones gathered'
  if params is None:   # a table looked up by ids: the ids' rows
    if indices.tag in (ROWS, FLAT, UNIQUE):
      return indices
    return indices if indices.tag in (STAT,) else 'a gather of the batch size\'s values'
  if params.tag == LIFTED_SHAPE and indices is None and axis == 0:
    return _lifted_shape_gather(op)
  if params.tag in (STAT, SIZE, SHAPE) and indices is None:
    if params.tag == SHAPE:
      value = static_value(op.inputs[1])
      if value is not None and value.size == 0:
        return None
      if value is not None and np.reshape(value, [-1])[0] == 0:
        return params if value.ndim else SIZE_KIND
      return SIZE_KIND if value is None or 0 in np.reshape(value, [-1]) else None
    return params
  if params.tag in (ROWS, FLAT) and axis > 0 and indices is None:
    return params
  if op.type == 'GatherV2' and op.get_attr('batch_dims') > 0 and params.tag == ROWS and (
      indices is not None and indices == params):
    return params   # batch_dims: each example's positions pick among its own values
  if params.tag in (ROWS, FLAT) and axis == 0 and indices is not None and indices.tag in (ROWS, FLAT):
    return ('a gather of the batch\'s rows by positions that are not each example\'s own '
            '(positions into a flat [n * T, ...] tensor need offsets range(n) * T)')
  if params.tag in (STAT, SIZE) and indices is not None and indices.tag in (STAT, SIZE):
    return stat_of(kinds)
  return 'a gather across the batch axis'


def _lifted_shape_gather(op):
  """Sizes of [1, n, ...] picked by static indices: [1, n] again (tensordot), n, or static."""
  value = static_value(op.inputs[1])
  if value is None:
    return SIZE_KIND
  picked = [int(i) for i in np.reshape(value, [-1])]
  if value.ndim == 1 and picked[:2] == [0, 1] and 1 not in picked[2:]:
    return Kind(LIFTED_SHAPE)
  return SIZE_KIND if 1 in picked else None


def _positions_of(params, indices) -> bool:
  """Whether `indices` (kinds) are `tf.where`'s positions in rows like `params`'s."""
  if indices.tag != POSITIONS or indices.index is None:
    return False
  if indices.index == 'rows':
    return params.tag == ROWS and params.blocks == 1
  return params.tag == FLAT and params.per is not None and params.per == indices.index


def _gather_nd(reader, op, kinds):
  params, indices = kinds
  if indices is not None and indices.tag == POSITIONS and params is not None and (
      _positions_of(params, indices)):
    return Kind(FLAT, per=indices.per)   # each example's entries, in example order
  if indices is not None and indices.tag == POSITIONS or (
      params is not None and params.tag in (ROWS, FLAT) and indices is not None and (
          indices.tag in (ROWS, FLAT))):
    return ('a gather_nd at positions that are not tf.where\'s positions in the same rows '
            '(values used as positions pick other examples\' rows)')
  if params is None:
    return indices if indices.tag in (ROWS, FLAT, STAT) else 'a gather of the batch size\'s values'
  if params.tag in (STAT,) and indices is None:
    return params
  return 'a gather across the batch axis'


def where(op, kinds):
  """`tf.where`'s indices (one input): positions in the mask's rows or flat rows."""
  mask = kinds[0]
  if mask.tag == ROWS and mask.blocks == 1:
    return Kind(POSITIONS, per=f'where:{op.name}', index='rows')
  if mask.tag in (ROWS, FLAT):   # in blocks: positions in the blocks' order, of no known rows
    index = mask.per if mask.tag == FLAT and mask.blocks == 1 else None
    return Kind(POSITIONS, per=f'where:{op.name}', index=index)
  return not_rows(op, mask)


def scatter_nd(reader, op, kinds):
  """`tf.scatter_nd` of entries back to `tf.where`'s positions: flat rows or rows again."""
  indices, updates, shape = kinds
  why = 'a scatter of the batch\'s rows to positions that are not their own examples\''
  if indices is None or indices.tag != POSITIONS or indices.index is None or (
      updates is None) or updates.tag != FLAT or (
      updates.per != indices.per) or shape is None or op.inputs[2].op.type != 'Pack':
    return why
  elements = op.inputs[2].op.inputs
  if any(reader.kind(e) is not None for e in elements[1:]) or (
      op.inputs[0].shape.rank != 2 or shapes.dim(op.inputs[0], -1) != 1):
    return why
  per = 1 if indices.index == 'rows' else indices.index
  if not isinstance(per, int) or not _batch_size_times(reader, elements[0], per):
    return why
  return ROWS_KIND if indices.index == 'rows' else Kind(FLAT, per=per)


def _batch_size_times(reader, t, per: int) -> bool:
  """Whether `t` is the shard's batch size times `per` (`tf.shape(x)[0] * T`, T static)."""
  value = static_value(t)
  if value is not None:
    return reader.examples is not None and int(value) == reader.examples * per
  if per == 1 and _batch_size(reader, t):
    return True
  if t.op.type != 'Mul':
    return False
  a, b = t.op.inputs
  for size, factor in ((a, b), (b, a)):
    if _batch_size(reader, size) and static_value(factor) is not None and (
        int(static_value(factor)) == per):
      return True
  return False


def _batch_size(reader, t) -> bool:
  """Whether `t` is `tf.shape(x)[0]` of rows `x` (one row per example)."""
  op = t.op
  if op.type != 'StridedSlice' or op.inputs[0].op.type != 'Shape':
    return False
  rows = reader.kind(op.inputs[0].op.inputs[0])
  begin = static_value(op.inputs[1])
  return (rows is not None and rows.tag == ROWS and rows.blocks == 1 and begin is not None
          and int(np.reshape(begin, [-1])[0]) == 0 and op.get_attr('shrink_axis_mask') & 1
          and not op.get_attr('ellipsis_mask') & 1 and not op.get_attr('new_axis_mask') & 1)


_WHY_INDICES = ('an op on positions of the batch\'s rows (range(n) * T plus positions) '
                'other than a gather of each example\'s own rows by them')


def indexing(reader, op, kinds):
  """Offsets and indices of each example's own rows (the module doc), or None: not such an op.

  `range(n) * T` (n the shard's examples) is offsets of index T; rows (positions,
  each in [0, T): the input's promise) plus offsets are indices of index T; a
  gather of rows or flat rows of T rows per example by them, each example's own.
  """
  present = [k for k in kinds if k is not None]
  if not any(k.tag in (OFFSETS, INDICES) for k in present):
    return _offsets(reader, op, kinds)
  found = _of_indices(reader, op, kinds, present)
  if found == _WHY_INDICES and not any(k.tag == INDICES for k in present):
    return None   # offsets read as before: batch-size values
  return found


def degraded(kinds: list) -> list:
  """`kinds` with offsets as batch-size values (what they are, whatever they index)."""
  return [SIZE_KIND if k is not None and k.tag == OFFSETS else k for k in kinds]


def _of_indices(reader, op, kinds, present):
  if op.type in _KEEPS and len(op.inputs) == 1:
    return kinds[0]
  if op.type in ('Shape', 'Size'):
    kind = kinds[0]
    if op.type == 'Size':
      return SIZE_KIND
    return Kind(SHAPE, per=kind.per, layout=FLAT) if kind.layout == FLAT else SHAPE_KIND
  if op.type in ('Reshape', 'Squeeze', 'ExpandDims') and all(k is None for k in kinds[1:]):
    return _reindexed(op, kinds[0])
  if op.type in ('AddV2', 'Add') and len(present) == 2:
    return _own_indices(reader, op, kinds)
  if op.type in ('GatherV2', 'Gather') and kinds[1] is not None and kinds[1].tag == INDICES and (
      kinds[0] is not None and kinds[0].tag in (ROWS, FLAT)) and (
          op.type == 'Gather' or static_value(op.inputs[2]) == 0) and all(
              k is None for k in kinds[2:]):
    params, indices = kinds[0], kinds[1]
    each = rows_per_example(params)
    if each is None or indices.index != each:
      return ('a gather of flat rows by indices of another number of rows per example '
              f'({indices.index} against {each})')
    if indices.layout == FLAT:
      return flat_kind(indices.per)
    return ROWS_KIND
  return _WHY_INDICES


def _offsets(reader, op, kinds):
  """range(n) * T: offsets of index T (n the shard's examples); with a static batch,
  positions plus the constant [0, T, 2T, ...]: indices; None: neither."""
  if len(kinds) != 2 or (kinds[0] is None) == (kinds[1] is None):
    return None
  a, b = op.inputs if kinds[0] is not None else reversed(op.inputs)
  if op.type == 'Mul':
    while a.op.type in ('Cast', 'Identity'):
      a = a.op.inputs[0]
    if a.op.type == 'Range' and static_value(a.op.inputs[0]) == 0 and (
        static_value(a.op.inputs[2]) == 1) and batch_multiple(reader, a.op.inputs[1]) == 1:
      stride = size_symbol(b)
      return Kind(OFFSETS, index=stride) if stride is not None else None
    return None
  kind = reader.kind(a)
  if op.type in ('Add', 'AddV2') and kind.tag == ROWS and kind.blocks == 1 and (
      a.dtype.is_integer) and a.shape.rank is not None and a.shape.rank == b.shape.rank:
    stride = _static_offsets(reader, b)
    return Kind(INDICES, index=stride) if stride is not None else None
  return None


def _static_offsets(reader, t):
  """T where `t` is the constant range(n) * T of a static batch of n examples (each row)."""
  n = reader.examples
  value = static_value(t) if n is not None and n > 1 and t.shape.rank else None
  if value is None or len(value) != n or not value.dtype.kind in 'iu':
    return None
  column = np.reshape(value, [n, -1])
  stride = int(column[1, 0] - column[0, 0])
  if stride > 0 and np.all(column == (np.arange(n) * stride)[:, None]):
    return stride
  return None


def _reindexed(op, kind):
  """Offsets or indices reshaped: [n] -> [n, 1], [n, P] -> [n * P] (flat, P per example)."""
  in_shape, out = op.inputs[0].shape, op.outputs[0].shape
  inner_in = product(in_shape[1:]) if in_shape.rank else None
  inner_out = product(out[1:]) if out.rank else None
  if inner_in is None or inner_out is None or not inner_out:
    return _WHY_INDICES
  if inner_in == inner_out:
    return kind
  if kind.tag == INDICES and kind.layout is None and inner_in % inner_out == 0:
    return Kind(INDICES, index=kind.index, layout=FLAT, per=inner_in // inner_out)
  return _WHY_INDICES


def _own_indices(reader, op, kinds):
  """Positions (rows) plus offsets of index T: each example's own rows of a T-row flat tensor."""
  offsets = [k for k in kinds if k is not None and k.tag == OFFSETS]
  rows = [k for k in kinds if k is not None and k.tag == ROWS and k.blocks == 1]
  ranks = {t.shape.rank for t in op.inputs}
  if len(offsets) == 1 and len(rows) == 1 and all(t.dtype.is_integer for t in op.inputs) and (
      len(ranks) == 1 and None not in ranks):   # [n, P] + [n, 1]: the batch axes meet
    return Kind(INDICES, index=offsets[0].index)
  return _WHY_INDICES


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {'DynamicPartition': _partition,
         **dict.fromkeys(('DynamicStitch', 'ParallelDynamicStitch'), _stitch),
         **dict.fromkeys(('GatherV2', 'Gather', 'ResourceGather'), _gather),
         'GatherNd': _gather_nd}
