"""Sparse entries: a SparseTensor's indices, values and shape through the ops feature columns build.

The rule. A SparseTensor's entries are flat rows: each belongs to the
example its first index names (`indices[:, 0]`), in example order. Its
indices are marked as such (a flat kind of `layout` 'indices', whose `index`
k says how many rows per example their first column counts: 1, the example;
T after a sparse reshape of [n, T, ...] to [n * T, ...]); `tf.where`'s
positions in rows (feature columns make a dense tensor's ids sparse with
them) are such indices too. Their first column is each entry's row ('ids':
a position in the shard, not a value of its example); the other columns and
the values are values of each entry. The ops that keep each example's
entries to itself give entries or rows back: a sparse reshape that keeps the
batch axis first (its new first size a known multiple k of the examples),
filling empty rows, reordering, `sparse_retain` (a gather of the indices at
their own mask's positions), crossing each example's entries with its own
(`SparseCross*`), a sparse reduction over other axes, a dense tensor of them
(`SparseToDense`), a sparse matrix product with weights, and a segment
reduction, sparse or not, by the entries' rows: rows (of k rows per example,
flat rows). Without a count of segments and of entries not filled (every row
given one), such a reduction has rows only up to the last example with an
entry ('prefix'): padded with zeros to the batch's size
(`sequence_length_from_sparse_tensor`) or met by rows of the whole shard
(their sizes then agree) it is rows; a value of it alone mixes. `tf.unique`
of the entries' values is the batch's distinct values, its `idx` each
entry's place among them ('unique'): a gather of their embeddings by it is
the entries' again (any other op on indices, rows or places mixes: they are
positions in the shard, not values of its examples). Entries of two SparseTensors (ids and their weights,
each made sparse by its own `tf.where`) combined entry by entry are read as
aligned one to one, the promise a weighted column makes (TensorFlow refuses
different counts). A gather of rows by the entries' rows gives each entry
its example's row. A prefix under any other op mixes.
"""

from __future__ import annotations

import numpy as np

from estimator_towers.base import shapes
from estimator_towers.rows.elementwise import KEEPS as _KEEPS
from estimator_towers.rows.kinds import (FLAT, POSITIONS, ROWS, ROWS_KIND, SHAPE, SHAPE_KIND,
                                         SIZE, SIZE_KIND, STAT_KIND, UNIQUE, UNIQUE_KIND, Kind,
                                         flat_kind, rows_per_example)
from estimator_towers.rows.op_tables import ELEMENTWISE, SEGMENT_SUMS, SPARSE_SEGMENTS
from estimator_towers.rows.sizes import batch_multiple, times
from estimator_towers.rows.static_values import axes_of, static_value

# The marks (a kind's `layout`): a SparseTensor's indices, their first column, tf.unique's
# idx of entries, rows up to the last example with an entry.
INDICES, IDS, PLACES, PREFIX = 'indices', 'ids', 'unique', 'prefix'
# The marks whose values are positions in the shard (its rows), never gathered into a head.
POSITION_MARKS = frozenset((INDICES, IDS))
_FILLED = 'filled'   # `of` of indices and ids: every row has an entry (SparseFillEmptyRows)
_GATHERS = ('GatherV2', 'Gather', 'ResourceGather')
_SHAPES = ('Shape', 'ShapeN', 'Size')
_WHY_POSITIONS = ('an op on a SparseTensor\'s indices, its entries\' rows or tf.unique\'s places '
                  'other than the sparse ops that keep each example\'s entries (positions in the '
                  'shard, not values of its examples)')
_WHY_PREFIX = ('a value of a segment reduction by a SparseTensor\'s rows that has rows only up '
               'to the last example with an entry (a count the shards do not share)')


def indices(per, k=1, filled: bool = False) -> Kind:
  """A SparseTensor's indices: entries of `per`, their first column counting k rows per example."""
  return Kind(FLAT, per=per, index=k, layout=INDICES, of=_FILLED if filled else '')


def marked(kind: Kind | None) -> bool:
  return kind is not None and kind.layout in (INDICES, IDS, PLACES, PREFIX)


def _as_indices(kind: Kind | None) -> Kind | None:
  """`kind` as a SparseTensor's indices, or None: marked ones, or tf.where's positions in rows."""
  if kind is None:
    return None
  if kind.layout == INDICES:
    return kind
  if kind.tag == POSITIONS and kind.index == 'rows' and kind.blocks == 1:
    return indices(kind.per)
  return None


def _rows_of(k):
  """The kind of one value per row of entries whose first column counts k rows per example."""
  return ROWS_KIND if k == 1 else flat_kind(k)


def _shape_of_rows(k):
  return SHAPE_KIND if k == 1 else Kind(SHAPE, per=k, layout=FLAT)


def _leading(reader, t):
  """k where the first element of the shape vector `t` is k times the shard's examples."""
  while t.op.type in ('Identity', 'Cast') and reader.kind(t.op.inputs[0]) is not None:
    t = t.op.inputs[0]   # (not past a shard's input: a micro-batch's gate)
  op = t.op
  if op.type == 'Pack' and op.get_attr('axis') == 0 and op.inputs:
    return _product_of_leading(reader, op.inputs[0])
  kind = reader.kind(t)
  if kind is not None and kind.tag == SHAPE:
    return kind.per if kind.layout == FLAT else kind.blocks
  return None


def _product_of_leading(reader, t):
  """k of a size: `batch_multiple`'s, or the product of a dense shape's first m sizes."""
  found = batch_multiple(reader, t)
  if found is not None:
    return found
  while t.op.type in ('Identity', 'Cast'):
    t = t.op.inputs[0]
  if t.op.type == 'StridedSlice' and t.op.get_attr('shrink_axis_mask') == 1:   # shape(x)[0]
    shape, begin = t.op.inputs[0], static_value(t.op.inputs[1])
    while shape.op.type in ('Identity', 'Cast'):
      shape = shape.op.inputs[0]
    if shape.op.type == 'Shape' and begin is not None and int(np.reshape(begin, [-1])[0]) == 0:
      return rows_per_example(reader.kind(shape.op.inputs[0]), blocks=True)
    return None
  if t.op.type != 'Prod' or t.op.inputs[0].op.type not in ('Slice', 'StridedSlice'):
    return None
  shape, m = t.op.inputs[0].op.inputs[0], _leading_count(t.op.inputs[0].op)
  kind = reader.kind(shape)
  if kind is None or kind.tag != SHAPE or m is None:
    return None
  k = kind.blocks if kind.layout is None else rows_per_example(flat_kind(kind.per, kind.blocks),
                                                                blocks=True)
  for j in range(1, m):   # a size of the dense shape known only when the graph runs
    k = times(k, (1, (f'{shape.name}[{j}]',)))
  return k


def _leading_count(op):
  """m where `op` slices a vector's first m elements (`shape[:m]`, `tf.slice(shape, [0], [m])`)."""
  begin = static_value(op.inputs[1])
  if begin is None or begin.size != 1:
    return None
  if op.type == 'Slice':
    size = static_value(op.inputs[2])
    return int(size[0]) if int(begin[0]) == 0 and size is not None and size.size == 1 and (
        int(size[0]) >= 1) else None
  end, strides = static_value(op.inputs[2]), static_value(op.inputs[3])
  if op.get_attr('shrink_axis_mask') or op.get_attr('ellipsis_mask') or op.get_attr(
      'new_axis_mask') or op.get_attr('end_mask') or end is None or strides is None or (
          int(strides[0]) != 1):
    return None
  if not (op.get_attr('begin_mask') & 1 or int(begin[0]) == 0) or int(end[0]) < 1:
    return None
  return int(end[0])


def _sparse_reshape(reader, op, kinds):
  entries = _as_indices(kinds[0])
  if entries is None or kinds[1] is None or kinds[1].tag != SHAPE or kinds[2] is None or (
      kinds[2].tag not in (SHAPE, SIZE)):
    return 'a sparse reshape of the batch axis'
  k = _leading(reader, op.inputs[2])
  if k is None:
    return 'a sparse reshape to a first size the library cannot relate to the batch size'
  return [indices(entries.per, k), _shape_of_rows(k)]


def _fill_empty_rows(reader, op, kinds):
  entries = _as_indices(kinds[0])
  if entries is None or kinds[1] is None or kinds[1].tag != FLAT or kinds[2] is None or (
      kinds[2].tag != SHAPE) or kinds[3] is not None:
    return 'a sparse op on values that are not the batch\'s entries'
  filled = f'filled:{entries.per}'   # the same entries filled the same way: the same layout
  return [indices(filled, entries.index, filled=True), flat_kind(filled),
          _rows_of(entries.index), flat_kind(entries.per)]


def _reorder(reader, op, kinds):
  entries = _as_indices(kinds[0])
  if entries is None or kinds[1] is None or kinds[1].tag != FLAT or kinds[2] is None or (
      kinds[2].tag != SHAPE):
    return 'a sparse op on values that are not the batch\'s entries'
  return [entries, flat_kind(entries.per)]   # sorted within each example's rows


def _segments(op, data, ids, num_segments_kind, num_segments_multiple):
  """A segment reduction of entries by their rows: rows (flat rows of k), a prefix, or why."""
  if ids is None or ids.layout != IDS:
    return 'a segment reduction across the batch\'s rows'
  k = ids.index
  if num_segments_kind is not None:
    if num_segments_kind.tag not in (SIZE, SHAPE) or num_segments_multiple != k:
      return 'a segment reduction into a count of segments the library cannot relate to the batch'
    return _rows_of(k)
  if ids.of == _FILLED:
    return _rows_of(k)
  if k == 1:
    return Kind(ROWS, layout=PREFIX)
  return 'a segment reduction by a SparseTensor\'s rows that may leave its last rows out'


def _sparse_segments(reader, op, kinds):
  data, which, ids = kinds[:3]
  if not ((data is None and which is not None and which.tag == FLAT) or (
      data is not None and data.tag == UNIQUE and which is not None and which.layout == PLACES) or (
          data is not None and data.tag == FLAT and which is not None and which.tag == SIZE)):
    return 'a sparse segment reduction of values that are not the batch\'s entries'
  count = kinds[3] if len(kinds) > 3 else None
  if len(kinds) > 3 and count is None:
    return 'a segment reduction into a count of segments that does not depend on the batch'
  return _segments(op, data, ids, count,
                   batch_multiple(reader, op.inputs[3]) if len(kinds) > 3 else None)


def _segment_sum(reader, op, kinds):
  """SegmentSum and friends (`embedding_lookup_sparse` with weights, a sequence's length)."""
  data, ids = kinds[0], kinds[1]
  if data is None or data.tag != FLAT or data.blocks != 1 or (
      data.per != ids.per and not (_decided(data.per) and _decided(ids.per))):
    return 'a segment reduction of values that are not the batch\'s entries'
  if op.type.startswith('Unsorted') and len(kinds) > 2:
    return _segments(op, data, ids, kinds[2], batch_multiple(reader, op.inputs[2]))
  return _segments(op, data, ids, None, None)


def _sparse_reduction(reader, op, kinds):
  entries = _as_indices(kinds[0])
  if entries is None or kinds[1] is None or kinds[1].tag != FLAT or kinds[2] is None or (
      kinds[2].tag != SHAPE) or kinds[3] is not None:
    return 'a sparse reduction of values that are not the batch\'s entries'
  rank = shapes.dim(op.inputs[0], 1) if op.inputs[0].shape.rank == 2 else None
  axes = axes_of(op.inputs[3], rank)
  if axes is None:
    return 'a sparse reduction over axes unknown when the graph is built'
  if 0 in axes or not axes:
    return STAT_KIND if 'Sum' in op.type else (
        'a sparse max over the batch, which no sum of the shards\' statistics gives')
  return _rows_of(entries.index)


def _sparse_to_dense(reader, op, kinds):
  entries = _as_indices(kinds[0])
  if entries is None or kinds[1] is None or kinds[1].tag != SHAPE or (
      kinds[2] is not None and kinds[2].tag != FLAT) or kinds[3] is not None:
    return 'a sparse op on values that are not the batch\'s entries'
  k = _leading(reader, op.inputs[1])
  if k is None or k != entries.index:
    return 'a dense tensor of entries whose first size the library cannot relate to their rows'
  return _rows_of(k)


def _sparse_matmul(reader, op, kinds):
  entries = _as_indices(kinds[0])
  if entries is None or [k and k.tag for k in kinds[1:]] != [FLAT, SHAPE, None] or (
      op.get_attr('adjoint_a')):
    return 'a sparse matrix product across the batch axis'
  return _rows_of(entries.index)


def _cross(reader, op, kinds):
  """SparseCross*: each example's entries crossed with its own (and its dense rows)."""
  n, dense = op.get_attr('N'), len(op.get_attr('dense_types'))
  for i in range(n):
    entries = _as_indices(kinds[i])
    if entries is None or entries.index != 1 or kinds[n + i] is None or (
        kinds[n + i].tag != FLAT) or kinds[2 * n + i] is None or kinds[2 * n + i].tag != SHAPE:
      return 'a cross of values that are not the batch\'s entries'
  for k in kinds[3 * n:3 * n + dense]:
    if k is not None and (k.tag != ROWS or k.blocks != 1):
      return 'a cross of the batch\'s entries with values that are not rows'
  if any(k is not None for k in kinds[3 * n + dense:]):
    return 'a cross whose settings depend on the batch'
  crossed = f'sparse:{op.name}'
  return [indices(crossed), flat_kind(crossed), SHAPE_KIND]


def _unique(reader, op, kinds):
  x = kinds[0]
  if x.tag == FLAT or x.tag == ROWS and op.inputs[0].shape.rank == 1 and x.blocks == 1:
    per = x.per if x.tag == FLAT else 1
    return [UNIQUE_KIND, Kind(FLAT, per=per, layout=PLACES)] + [
        flat_kind(per)] * (len(op.outputs) - 2)
  return 'the distinct values of the batch\'s rows'


def on_entries(reader, op, kinds):
  """The kind of an op (not one of `RULES`) on marked kinds, or on entries of two
  SparseTensors combined; None: read `degraded(kinds)` as usual."""
  t = op.type
  present = [k for k in kinds if k is not None]
  if any(k.layout == PREFIX for k in present):
    return _on_prefix(reader, op, kinds, present)
  if t == 'StridedSlice' and kinds[0] is not None and all(k is None for k in kinds[1:]):
    return _column(op, kinds[0])
  if t in _KEEPS and len(present) == 1 and kinds[0] is not None and marked(kinds[0]):
    return kinds[0]
  if t in _GATHERS:
    return _gather(op, kinds)
  if t in SEGMENT_SUMS and kinds[1] is not None and kinds[1].layout == IDS:
    return _segment_sum(reader, op, kinds)
  if t in ELEMENTWISE and _two_sparse(present):
    return flat_kind(present[0].per)   # ids and their weights: aligned one to one
  if any(k.layout in (INDICES, IDS, PLACES) for k in present) and t not in _SHAPES:
    return _WHY_POSITIONS
  return None


def _column(op, kind):
  """`indices[:, j]`: the entries' rows for j = 0 ('ids'), a value of each entry otherwise."""
  entries = _as_indices(kind)
  if entries is None or op.inputs[0].shape.rank != 2:
    return None
  begin, strides = static_value(op.inputs[1]), static_value(op.inputs[3])
  whole = op.get_attr('begin_mask') & 1 and op.get_attr('end_mask') & 1 and (
      strides is not None and int(strides[0]) == 1)
  if not whole or begin is None or op.get_attr('ellipsis_mask') or op.get_attr(
      'new_axis_mask') or op.get_attr('shrink_axis_mask') != 2:
    return None
  if int(begin[1]) == 0:
    return Kind(FLAT, per=entries.per, index=entries.index, layout=IDS, of=entries.of)
  return flat_kind(entries.per)


def _gather(op, kinds):
  params, which = kinds[0], kinds[1]
  if op.type == 'GatherV2' and (kinds[2] is not None or static_value(op.inputs[2]) != 0):
    return _WHY_POSITIONS if marked(params) or marked(which) else None
  if params is not None and params.tag == FLAT and params.blocks == 1 and which is not None and (
      which.tag == POSITIONS) and (which.index == params.per or (
          _decided(params.per) and _decided(which.index))):
    # sparse_retain: the entries kept, in order (at their own mask, or at the mask of the
    # entries they are aligned with one to one: ids and their weights)
    return indices(which.per, params.index) if params.layout == INDICES else flat_kind(which.per)
  if which is not None and which.layout == PLACES and (params is None or params.tag == UNIQUE):
    return flat_kind(which.per)   # each entry's embedding, looked up once per distinct id
  if which is not None and which.layout == IDS and params is not None and (
      params.tag == ROWS and params.blocks == 1 and which.index == 1):
    return flat_kind(which.per)   # each entry's example's row
  return _WHY_POSITIONS if marked(params) or marked(which) else None


def _two_sparse(present) -> bool:
  """Entries of different SparseTensors combined (`per`s both counts the values decide)."""
  pers = {k.per for k in present if k.tag == FLAT}
  return len(pers) == 2 and all(k.tag == FLAT and k.blocks == 1 for k in present) and all(
      _decided(p) for p in pers)


def _decided(per) -> bool:
  """Whether `per` is a count of a SparseTensor's entries (or a mask's), which values decide."""
  return isinstance(per, str) and per.split(':')[0] in ('sparse', 'where', 'filled')


def _on_prefix(reader, op, kinds, present):
  t = op.type
  if t in ('Shape', 'Size'):
    return SIZE_KIND   # how many rows the reduction has: not the batch size
  if t == 'ConcatV2' and _padded(reader, op, kinds):
    return ROWS_KIND
  if t in ELEMENTWISE:
    others = [k for k in present if k.layout != PREFIX]
    if not others:
      return present[0]
    if all(k.tag == ROWS and k.blocks == 1 for k in others):
      return ROWS_KIND   # met by the shard's rows: the sizes agree when the graph runs
  return _WHY_PREFIX


def _padded(reader, op, kinds) -> bool:
  """concat([prefix, zeros(shape(x)[:1] - shape(prefix)[:1])], 0), x of the shard's rows."""
  if len(op.inputs) != 3 or static_value(op.inputs[2]) != 0 or kinds[0] is None or (
      kinds[0].layout != PREFIX):
    return False
  pad = op.inputs[1]
  while pad.op.type in ('Identity', 'Cast'):
    pad = pad.op.inputs[0]
  if pad.op.type != 'Fill' or pad.op.inputs[1].op.type != 'Const':
    return False
  n_pad = pad.op.inputs[0]
  if n_pad.op.type != 'Sub':
    return False
  whole, part = n_pad.op.inputs
  return _first_size_of(reader, whole, full=True) and _first_size_of(reader, part, full=False,
                                                                     prefix=op.inputs[0])


def _first_size_of(reader, t, full: bool, prefix=None) -> bool:
  """Whether `t` is `shape[:1]` of a shard's rows (full) or of `prefix`."""
  while t.op.type in ('Identity', 'Cast'):
    t = t.op.inputs[0]
  if t.op.type not in ('StridedSlice', 'Slice'):
    return False
  begin = static_value(t.op.inputs[1])
  if begin is None or int(np.reshape(begin, [-1])[0]) != 0:
    return False
  shape = t.op.inputs[0]
  while shape.op.type in ('Identity', 'Cast'):
    shape = shape.op.inputs[0]
  if not full:
    return shape.op.type == 'Shape' and shape.op.inputs[0].name == prefix.name
  kind = reader.kind(shape)
  return kind is not None and kind.tag == SHAPE and kind.layout is None and kind.blocks == 1


def degraded(kinds: list) -> list:
  """`kinds` with marked indices, rows and places as the plain flat values they are."""
  return [flat_kind(k.per, k.blocks) if marked(k) and k.layout != PREFIX else k for k in kinds]


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {**dict.fromkeys(SPARSE_SEGMENTS, _sparse_segments), 'SparseReshape': _sparse_reshape,
         'SparseFillEmptyRows': _fill_empty_rows, 'SparseReorder': _reorder,
         **dict.fromkeys(('SparseReduceSum', 'SparseReduceMax'), _sparse_reduction),
         'SparseToDense': _sparse_to_dense, 'SparseTensorDenseMatMul': _sparse_matmul,
         **dict.fromkeys(('SparseCross', 'SparseCrossV2', 'SparseCrossHashed'), _cross),
         **dict.fromkeys(('Unique', 'UniqueV2'), _unique)}
