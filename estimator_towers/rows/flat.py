"""Flat rows: entries of the batch's examples, in example order, not one row per example.

The rule. Every row of a flat tensor belongs to one example, in example
order: a SparseTensor's indices and values and a RaggedTensor's flat values
(as the shard's inputs flatten them: `input_kinds`), a reshape of [n, T, d]
to [n * T, d] (`stacked`), `tf.boolean_mask`'s rows, `tf.where`'s indices;
sums of it are still statistics. The sparse ops that keep the entries of
each example (a reshape of the dense shape, filling empty rows, a sparse
reduction over other axes, a sparse matrix product, a sparse segment sum per
example) give flat rows or rows back. A RaggedTensor's row splits are their
own kind: their differences are rows (each example's length), the segment
ids made from them flat, a segment sum by those ids rows again. A gather of
a table by the rows' ids keeps the ids' rows; `tf.unique` of them is the
batch's distinct values (`embedding_lookup_sparse`'s), rows again only where
a sparse segment reduction sums them back per example. Gathers, partitions
and stitches across the batch axis mix it.

Each example's own rows (`indexing`): `range(n) * T`, n the shard's
examples, are offsets of stride T (each example's first row in a flat
tensor of T rows per example; with a static batch, the constant [0, T, ...]
of the shard), positions (rows, each in [0, T): the input's promise, as
BERT's masked positions) plus them are indices of stride T, and so are
`tf.where`'s indices of a vector of rows or flat rows (`tf.boolean_mask`).
A gather of rows or flat rows by indices of their own rows per example is
per-example: rows for indices of [n, P], flat rows of P per example for
[n * P]. Indices of another stride, a gather of the batch's rows by any
other positions (they index the whole batch, not each example's rows), and
any other op on positions plus offsets mix the rows; any other op reads
offsets as batch-size values and `tf.where`'s indices as flat rows.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.rows.elementwise import KEEPS as _KEEPS, not_rows
from estimator_towers.rows.kinds import (FLAT, FLAT_KIND, INDICES, MIXED, OFFSETS, RAGGED, ROWS,
                                         ROWS_KIND, SHAPE, SHAPE_KIND, SIZE, SIZE_KIND, SPLITS,
                                         SPLITS_KIND, STAT, STAT_KIND, UNIQUE, UNIQUE_KIND, Kind,
                                         flat_kind, rows_per_example, stat_of)
from estimator_towers.rows.op_tables import SPARSE_SEGMENTS
from estimator_towers.rows.sizes import size_symbol, batch_multiple
from estimator_towers.rows.static_values import axes_of, product, static_value


def input_kinds(inputs: Sequence[tf.Tensor]) -> dict:
  """Rows; a SparseTensor's (indices, values, dense_shape), as flattened: flat, flat, shape."""
  kinds, i = {}, 0
  while i < len(inputs):
    window = inputs[i:i + 3]
    if len(window) == 3 and _sparse(*window):
      kinds.update({window[0].name: FLAT_KIND, window[1].name: FLAT_KIND,
                    window[2].name: SHAPE_KIND})
      i += 3
      continue
    if len(window) >= 2 and _ragged(*window[:2]):
      kinds.update({window[0].name: FLAT_KIND, window[1].name: SPLITS_KIND})
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
  rank = indices.shape[1] if indices.shape.rank == 2 else None
  return (indices.dtype == tf.int64 and indices.shape.rank == 2 and values.shape.rank == 1
          and (indices.op is values.op or (indices.op.name.endswith('indices')
                                            and values.op.name.endswith('values')))
          and shape.dtype == tf.int64 and shape.shape.rank == 1
          and (rank is None or shape.shape[0] is None or shape.shape[0] == rank))


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


def _sparse_segments(reader, op, kinds):
  data, indices, segment_ids = kinds[:3]
  if (data is None or data.tag in (UNIQUE, FLAT)) and indices is not None and (
      indices.tag == FLAT) and segment_ids is not None and segment_ids.tag == FLAT and all(
          k is None or k.tag in (SIZE, SHAPE) for k in kinds[3:]):
    return ROWS_KIND   # one sum per example of its entries
  return 'a segment reduction across the batch\'s rows'


def _sparse_reshape(reader, op, kinds):
  if [k and k.tag for k in kinds] == [FLAT, SHAPE, SHAPE]:
    return [FLAT_KIND, SHAPE_KIND]
  return 'a sparse reshape of the batch axis'


def _fill_empty_rows(reader, op, kinds):
  if [k and k.tag for k in kinds[:3]] == [FLAT, FLAT, SHAPE] and kinds[3] is None:
    return [FLAT_KIND, FLAT_KIND, ROWS_KIND, FLAT_KIND]
  return 'a sparse op on values that are not the batch\'s entries'


def _sparse_reduction(reader, op, kinds):
  if [k and k.tag for k in kinds] != [FLAT, FLAT, SHAPE, None]:
    return 'a sparse reduction of values that are not the batch\'s entries'
  axes = axes_of(op.inputs[3], op.inputs[2].shape[0] if op.inputs[2].shape.rank else None)
  if axes is None:
    return 'a sparse reduction over axes unknown when the graph is built'
  return STAT_KIND if 0 in axes or not axes else ROWS_KIND


def _sparse_to_dense(reader, op, kinds):
  if [k and k.tag for k in kinds[:3]] in ([FLAT, SHAPE, FLAT], [FLAT, SHAPE, None]) and (
      kinds[3] is None):
    return ROWS_KIND
  return 'a sparse op on values that are not the batch\'s entries'


def _sparse_matmul(reader, op, kinds):
  if [k and k.tag for k in kinds] == [FLAT, FLAT, SHAPE, None] and not op.get_attr(
      'adjoint_a'):
    return ROWS_KIND
  return 'a sparse matrix product across the batch axis'


def _partition(reader, op, kinds):   # embedding_lookup of a partitioned table, by id
  if kinds[0] is not None and kinds[0].tag == UNIQUE and kinds[1] is not None and (
      kinds[1].tag == UNIQUE):
    return UNIQUE_KIND
  return 'a partition of the batch\'s rows by value'


def _stitch(reader, op, kinds):
  if all(k is None or k.tag == UNIQUE for k in kinds):
    return UNIQUE_KIND
  return 'a stitch of the batch\'s rows by index'


def _unique(reader, op, kinds):
  return [UNIQUE_KIND, FLAT_KIND] if kinds[0].tag == FLAT or kinds[0].tag == ROWS and (
      op.inputs[0].shape.rank == 1) else 'the distinct values of the batch\'s rows'


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
  if params is None:   # a table looked up by ids: the ids' rows
    if indices.tag in (ROWS, FLAT, UNIQUE):
      return indices
    return indices if indices.tag in (STAT,) else 'a gather of the batch size\'s values'
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


def _gather_nd(reader, op, kinds):
  params, indices = kinds
  if params is None:
    return indices if indices.tag in (ROWS, FLAT, STAT) else 'a gather of the batch size\'s values'
  if indices is not None and indices.tag in (ROWS, FLAT) and params.tag in (ROWS, FLAT):
    source = op.inputs[1]
    while source.op.type in ('Identity', 'Cast'):
      source = source.op.inputs[0]
    mask = reader.kind(source.op.inputs[0]) if source.op.type == 'Where' else None
    if mask is not None and mask == params == ROWS_KIND and _leading_dims_match(
        source.op.inputs[0], op.inputs[0]):
      return FLAT_KIND   # tf.where's coordinates of a mask of the params' own rows
    return ('a gather of the batch\'s rows at coordinates that are not tf.where\'s of a '
            'mask of them')
  if params.tag in (STAT,) and indices is None:
    return params
  return 'a gather across the batch axis'


def _leading_dims_match(mask, params) -> bool:
  """The mask's sizes after the batch axis are the params' next ones (known when built)."""
  if mask.shape.rank is None or params.shape.rank is None or mask.shape.rank > params.shape.rank:
    return False
  inner = mask.shape[1:].as_list()
  return None not in inner and inner == params.shape[1:mask.shape.rank].as_list()


def where(op, kinds):
  """`tf.where`'s indices (one input): of a vector, the positions of its own true rows; else flat."""
  kind = kinds[0]
  if kind.tag in (ROWS, FLAT) and kind.blocks != 1:
    return flat_kind(None, kind.blocks)   # positions in the blocks' order
  if kind.tag in (ROWS, FLAT) and op.inputs[0].shape.rank == 1:
    stride = rows_per_example(kind)
    if stride is None and kind.tag == FLAT:
      stride = RAGGED
    return Kind(INDICES, stride=stride, layout=FLAT) if stride is not None else FLAT_KIND
  return FLAT_KIND if kind.tag in (ROWS, FLAT) else not_rows(op, kind)


_WHY_INDICES = ('an op on positions of the batch\'s rows (range(n) * T, tf.where\'s indices) '
                'other than a gather of each example\'s own rows by them')


def indexing(reader, op, kinds):
  """Offsets and indices of each example's own rows (the module doc), or None: not such an op.

  `range(n) * T` (n the shard's examples) is offsets of stride T; rows (positions,
  each in [0, T): the input's promise) plus offsets are indices of stride T; a
  gather of rows or flat rows of T rows per example by them, each example's own.
  """
  present = [k for k in kinds if k is not None]
  if not any(k.tag in (OFFSETS, INDICES) for k in present):
    return _offsets(reader, op, kinds)
  found = _of_indices(reader, op, kinds, present)
  if found == _WHY_INDICES and all(_degrades(k) for k in present):
    return None   # read as before: batch-size values, tf.where's flat indices
  return found


def _degrades(kind) -> bool:
  """Offsets, and tf.where's indices (flat, no `per`), read elsewhere as batch-size values
  and flat rows (what they are, whatever they index)."""
  return kind.tag not in (OFFSETS, INDICES) or kind.tag == OFFSETS or (
      kind.layout == FLAT and kind.per is None)


def degraded(kinds: list) -> list:
  """`kinds` with offsets as batch-size values and tf.where's indices as flat rows."""
  return [SIZE_KIND if k is not None and k.tag == OFFSETS else
          FLAT_KIND if k is not None and k.tag == INDICES else k for k in kinds]


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
    ragged = each is None and params.tag == FLAT and params.blocks == 1
    if indices.stride != (RAGGED if ragged else each):
      return ('a gather of flat rows by indices of another number of rows per example '
              f'({indices.stride} against {each})')
    if indices.layout == FLAT:
      return flat_kind(indices.per)
    return ROWS_KIND
  return _WHY_INDICES


def _offsets(reader, op, kinds):
  """range(n) * T: offsets of stride T (n the shard's examples); with a static batch,
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
      return Kind(OFFSETS, stride=stride) if stride is not None else None
    return None
  kind = reader.kind(a)
  if op.type in ('Add', 'AddV2') and kind.tag == ROWS and kind.blocks == 1 and (
      a.dtype.is_integer) and a.shape.rank is not None and a.shape.rank == b.shape.rank:
    stride = _static_offsets(reader, b)
    return Kind(INDICES, stride=stride) if stride is not None else None
  return None


def _static_offsets(reader, t):
  """T where `t` is the constant range(n) * T of a static batch of n examples (each row)."""
  n = reader.examples
  value = static_value(t) if n is not None and n > 1 and t.shape.rank else None
  if value is None or value.shape[0] != n or not value.dtype.kind in 'iu':
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
    return Kind(INDICES, stride=kind.stride, layout=FLAT, per=inner_in // inner_out)
  return _WHY_INDICES


def _own_indices(reader, op, kinds):
  """Positions (rows) plus offsets of stride T: each example's own rows of a T-row flat tensor."""
  offsets = [k for k in kinds if k is not None and k.tag == OFFSETS]
  rows = [k for k in kinds if k is not None and k.tag == ROWS and k.blocks == 1]
  ranks = {t.shape.rank for t in op.inputs}
  if len(offsets) == 1 and len(rows) == 1 and all(t.dtype.is_integer for t in op.inputs) and (
      len(ranks) == 1 and None not in ranks):   # [n, P] + [n, 1]: the batch axes meet
    return Kind(INDICES, stride=offsets[0].stride)
  return _WHY_INDICES


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {**dict.fromkeys(SPARSE_SEGMENTS, _sparse_segments), 'SparseReshape': _sparse_reshape,
         'SparseFillEmptyRows': _fill_empty_rows,
         **dict.fromkeys(('SparseReduceSum', 'SparseReduceMax'), _sparse_reduction),
         'SparseToDense': _sparse_to_dense, 'SparseTensorDenseMatMul': _sparse_matmul,
         'DynamicPartition': _partition,
         **dict.fromkeys(('DynamicStitch', 'ParallelDynamicStitch'), _stitch),
         **dict.fromkeys(('Unique', 'UniqueV2'), _unique),
         **dict.fromkeys(('GatherV2', 'Gather', 'ResourceGather'), _gather),
         'GatherNd': _gather_nd}
