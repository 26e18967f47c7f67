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
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.rows.elementwise import not_rows
from estimator_towers.rows.kinds import (FLAT, FLAT_KIND, MIXED, ROWS, ROWS_KIND, SHAPE, SHAPE_KIND,
                                         SIZE, SIZE_KIND, SPLITS, SPLITS_KIND, STAT, STAT_KIND,
                                         UNIQUE, UNIQUE_KIND, stat_of)
from estimator_towers.rows.op_tables import SPARSE_SEGMENTS
from estimator_towers.rows.static_values import axes_of, static_value


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
        return SHAPE_KIND if value.ndim else SIZE_KIND
      return SIZE_KIND if value is None or 0 in np.reshape(value, [-1]) else None
    return params
  if params.tag in (ROWS, FLAT) and axis > 0 and indices is None:
    return params
  if params.tag in (ROWS, FLAT) and axis == 0 and indices is not None and indices.tag in (ROWS, FLAT):
    return FLAT_KIND   # rows picked by the rows' own values (tf.boolean_mask)
  if params.tag in (STAT, SIZE) and indices is not None and indices.tag in (STAT, SIZE):
    return stat_of(kinds)
  return 'a gather across the batch axis'


def _gather_nd(reader, op, kinds):
  params, indices = kinds
  if params is None:
    return indices if indices.tag in (ROWS, FLAT, STAT) else 'a gather of the batch size\'s values'
  if indices is not None and indices.tag in (ROWS, FLAT) and params.tag in (ROWS, FLAT):
    return FLAT_KIND
  if params.tag in (STAT,) and indices is None:
    return params
  return 'a gather across the batch axis'


def where(op, kinds):
  """`tf.where`'s indices (one input): flat for rows."""
  return FLAT_KIND if kinds[0].tag in (ROWS, FLAT) else not_rows(op, kinds[0])


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
