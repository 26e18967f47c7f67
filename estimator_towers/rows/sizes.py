"""Sizes: values of the shard's size, and values shaped by it.

The rule. A shape op reads the rows' shape, not their values: a shape of
rows (or of flat rows) is `shape`, the vector whose first element is the
batch size; its size, a `tf.range` of it, an identity matrix or a
diagonal of it are `batch size` values (and so is the count of flat rows
or of entries lifted onto axis 1, whose shape [1, n, ...] is a `lifted
shape`), the same on every shard only in
form (`tf.shape(x)[0]`, `tf.size`). An op whose `shape` input is a `shape`
(`tf.zeros([n, d])`, random noise of `tf.shape(x)`, `tf.fill`) makes rows
of constants, flat rows of the same layout for the shape of flat rows
(`tf.random.normal(tf.shape(flat))`); shaped by another value of the batch,
it mixes. A statistic's shape does not depend on the batch; the rank never
does. `batch_multiple` says which sizes are a known multiple k of the
shard's examples (`tf.shape(x)[0] * T`, a static size of a static batch):
what a reshape's leading size makes of the rows (`stacked`).
A diagonal or band
of rows (`tf.linalg.diag` of [n, m] rows, the diagonal of [n, m, m] ones,
what `tf.linalg.logdet` and `tf.eye(batch_shape=...)` make) is rows, one
matrix per example; where the batch axis is a matrix axis it mixes.
"""

from __future__ import annotations

import numpy as np

from estimator_towers.base import shapes
from estimator_towers.rows.kinds import (COLS, COLS_SHAPE_KIND, FLAT, LIFTED, LIFTED_SHAPE, LIFTED_SHAPE_KIND, POSITIONS,
                                         ROWS, ROWS_KIND, SHAPE, SHAPE_KIND, SIZE, SIZE_KIND, STAT,
                                         UNIQUE, UNIQUE_KIND, Kind, flat_kind, rows_per_example,
                                         stat_of)
from estimator_towers.rows.op_tables import SHAPED, SHAPES
from estimator_towers.rows.static_values import static_value

# Ops of a matrix's diagonal or band: an identity matrix of the batch size, its diagonal.
_MATRICES = ('MatrixDiag', 'MatrixDiagV2', 'MatrixDiagV3', 'MatrixSetDiag',
             'MatrixSetDiagV2', 'MatrixSetDiagV3', 'MatrixBandPart', 'MatrixDiagPart',
             'MatrixDiagPartV2', 'MatrixDiagPartV3', 'Eye')


def shape_of(kind: Kind | None) -> Kind | None:
  """The kind of the shape of a tensor of `kind`."""
  if kind is None:
    return None
  if kind.tag in (FLAT, POSITIONS):   # [n * T, ...], [k, r]: shapes flat rows (of `per`)
    return Kind(SHAPE, kind.blocks, per=kind.per, layout=FLAT)
  if kind.tag == ROWS and kind.blocks > 1:
    return Kind(SHAPE, kind.blocks)   # [b * n, ...]
  if kind.tag in (ROWS, SIZE, SHAPE):
    return SHAPE_KIND
  if kind.tag in (LIFTED, LIFTED_SHAPE):
    return LIFTED_SHAPE_KIND if kind.tag == LIFTED else SIZE_KIND   # [1, n, ...]; [rank]
  if kind.tag == COLS and kind.blocks == 1:
    return COLS_SHAPE_KIND   # [T, n, ...]: the batch size second (`loops`)
  return kind   # a statistic's shape does not depend on the batch (or is mixed)


def size_of(kind: Kind | None) -> Kind | None:
  """The kind of the size of a tensor of `kind`."""
  if kind is None:
    return None
  if kind.tag in (ROWS, FLAT, SIZE, SHAPE, LIFTED, LIFTED_SHAPE, POSITIONS):
    return SIZE_KIND
  return kind   # a set's size: the set's


def _shapes(reader, op, kinds):
  return [shape_of(k) for k in kinds[:len(op.outputs)]]


def _size(reader, op, kinds):
  return size_of(kinds[0])


def _rank(reader, op, kinds):
  return None   # the rank does not depend on the batch


def _shaped(reader, op, kinds):
  index = SHAPED[op.type]
  shape = kinds[index]
  rest = [k for i, k in enumerate(kinds) if i != index and k is not None]
  if shape is None:
    if rest and all(k.tag in (ROWS,) for k in rest) and op.type == 'BroadcastTo':
      return 'a broadcast of rows to a shape that does not depend on the batch'
    return rest[0] if rest and rest[0].tag in (STAT, SIZE) else 'an op on the batch\'s rows'
  if shape.tag != SHAPE:
    return SIZE_KIND if shape.tag == SIZE and not rest else 'an op shaped by a value of the batch'
  if shape.layout == FLAT:
    return flat_kind(shape.per, shape.blocks) if not rest else (
        'an op shaped by flat rows, of other values')
  if any(k.tag not in (ROWS, STAT) for k in rest):
    return 'an op shaped by the batch, of values that are not rows'
  if any(k.tag == STAT and not k.norm for k in rest):
    return 'rows made from a statistic of the batch'
  return ROWS_KIND


def times(a, b):
  """The product of two sizes: ints, or `(coefficient, names)` with names of sizes known at run time."""
  if a is None or b is None:
    return None
  if isinstance(a, int) and isinstance(b, int):
    return a * b
  ca, na = (a, ()) if isinstance(a, int) else a
  cb, nb = (b, ()) if isinstance(b, int) else b
  return (ca * cb, tuple(sorted(na + nb)))


def size_symbol(t):
  """A size of no input of the shard: its static int, else its tensor's name (a run-time size)."""
  value = static_value(t)
  if value is not None:
    return int(value) if np.ndim(value) == 0 and int(value) > 0 else None
  while t.op.type in ('Identity', 'Cast'):
    t = t.op.inputs[0]
  return (1, (t.name,)) if t.shape.rank == 0 else None


def batch_multiple(reader, t, depth: int = 0):
  """k where `t` is k times the shard's examples (an int or a run-time product), else None.

  `tf.shape(x)[0]` of rows is 1 (of flat rows of `per` T: T; a SparseTensor's
  `dense_shape[0]`, as `tf.shape(sparse)` casts it: 1), times sizes that
  do not depend on the shard, a product of a shape's first sizes; with a static
  batch, a static multiple of it.
  """
  kind, op = reader.kind(t), t.op
  if depth > 8 or t.shape.rank not in (0, None):
    return None
  if kind is None:
    value = static_value(t)
    if value is None or reader.examples is None or np.ndim(value) or int(value) <= 0:
      return None
    return int(value) // reader.examples if int(value) % reader.examples == 0 else None
  if op.type in ('Identity', 'Cast'):
    return batch_multiple(reader, op.inputs[0], depth + 1)
  if op.type == 'Mul':
    a, b = op.inputs
    if reader.kind(a) is None:
      a, b = b, a
    return times(batch_multiple(reader, a, depth + 1), size_symbol(b)) if (
        reader.kind(b) is None) else None
  if op.type == 'StridedSlice' and op.get_attr('shrink_axis_mask') == 1 and (
      op.inputs[0].op.type == 'Shape') and reader.kind(op.inputs[0]) == COLS_SHAPE_KIND:
    begin = static_value(op.inputs[1])   # tf.shape(time_major)[1]
    return 1 if begin is not None and begin.size == 1 and int(begin[0]) == 1 else None
  if op.type == 'StridedSlice' and op.get_attr('shrink_axis_mask') == 1 and (
      not op.get_attr('ellipsis_mask')):
    begin = static_value(op.inputs[1])
    if begin is None or not begin.size or int(np.reshape(begin, [-1])[0]) != 0:
      return None
    if op.inputs[0].op.type == 'Shape':
      return rows_per_example(reader.kind(op.inputs[0].op.inputs[0]), blocks=True)
    return _first_of_shape(reader, op.inputs[0])
  if op.type == 'Prod' and static_value(op.inputs[1]) is not None and (
      op.inputs[0].op.type in ('Slice', 'StridedSlice', 'GatherV2')) and (
          op.inputs[0].op.inputs[0].op.type == 'Shape'):
    return _shape_product(reader, op.inputs[0].op)
  if op.type == 'Prod' and op.inputs[0].op.type == 'Slice' and _first_size(reader, op.inputs[0]):
    return 1   # the product of a rows' shape's first size alone (a SparseTensor's dense shape)
  return None


def _first_of_shape(reader, t):
  """k of the first element of `t`, a shape vector not made by a Shape op (a
  SparseTensor's dense shape, as `tf.shape(sparse)` casts it), else None."""
  while t.op.type in ('Identity', 'Cast') and reader.kind(t.op.inputs[0]) is not None:
    t = t.op.inputs[0]
  kind = reader.kind(t)
  if kind is None or kind.tag != SHAPE or t.op.type in SHAPES or t.shape.rank != 1:
    return None
  if kind.layout == FLAT:
    return rows_per_example(flat_kind(kind.per, kind.blocks), blocks=True)
  return kind.blocks


def _first_size(reader, t) -> bool:
  """Whether `t` is `shape[0:1]` of a rows' shape vector (`tf.slice(shape, [0], [1])`)."""
  shape = reader.kind(t.op.inputs[0])
  begin, size = static_value(t.op.inputs[1]), static_value(t.op.inputs[2])
  return (shape is not None and shape.tag == SHAPE and shape.per is None
          and getattr(shape, 'layout', None) is None and begin is not None and size is not None
          and begin.size == 1 and size.size == 1 and int(begin[0]) == 0 and int(size[0]) == 1)


def _shape_product(reader, op):
  """k of the product of sizes of `shape(x)` picked by `op` (a slice or gather of it; the
  leading sizes `tf.boolean_mask` merges, the free sizes of `tf.tensordot`)."""
  x = op.inputs[0].op.inputs[0]
  if x.shape.rank is None:
    return None
  axes = None
  if op.type == 'GatherV2':
    picked = static_value(op.inputs[1])
    if picked is not None and static_value(op.inputs[2]) == 0 and picked.ndim == 1:
      axes = [int(a) % x.shape.rank for a in picked]
  else:
    begin, end = static_value(op.inputs[1]), static_value(op.inputs[2])
    if begin is not None and end is not None and begin.size == 1 and end.size == 1:
      start, stop = int(begin[0]), int(end[0])
      if op.type == 'Slice':
        stop = x.shape.rank if stop < 0 else start + stop
      elif op.get_attr('shrink_axis_mask') or op.get_attr('ellipsis_mask') or (
          op.get_attr('new_axis_mask')) or static_value(op.inputs[3]) is None or (
              int(static_value(op.inputs[3])[0]) != 1):
        return None
      else:
        start = 0 if op.get_attr('begin_mask') & 1 else start
        stop = x.shape.rank if op.get_attr('end_mask') & 1 else stop
      start, stop = (a + x.shape.rank if a < 0 else a for a in (start, stop))
      axes = list(range(start, stop)) if 0 <= start < stop <= x.shape.rank else None
  if axes is None or axes.count(0) != 1:
    return None
  k = rows_per_example(reader.kind(x), blocks=True)
  for a in axes:   # a size known only at run time: named by the shape and axis it is of
    if a:
      k = times(k, shapes.dim(x, a) if shapes.dim(x, a) is not None else (1, (f'{op.inputs[0].name}[{a}]',)))
  return k


def _batch_size_value(reader, op, kinds):
  present = [k for k in kinds if k is not None]
  if op.type.startswith('Matrix') and present and all(k.tag in (ROWS, FLAT) for k in present):
    return _per_matrix(op, kinds)
  if all(k.tag == UNIQUE for k in present):
    return UNIQUE_KIND   # positions in the batch's distinct values
  if all(k.tag in (SIZE, SHAPE) for k in present):
    return SIZE_KIND
  if all(k.tag in (SIZE, SHAPE, STAT) for k in present):
    return stat_of(present)
  return f'a {op.type} of the batch\'s rows'


def _per_matrix(op, kinds):
  """A diagonal or band of rows: per example where the batch axis is not a matrix axis."""
  data = kinds[:2] if op.type.startswith('MatrixSetDiag') else kinds[:1]
  if None in data or len(set(data)) > 1 or any(k is not None for k in kinds[len(data):]):
    return f'a {op.type} of the batch\'s rows with other values or by a value of the batch'
  rank = op.inputs[0].shape.rank
  k = static_value(op.inputs[1]) if op.type in ('MatrixDiagV2', 'MatrixDiagV3') else None
  single = op.type == 'MatrixDiag' or (k is not None and (k.size == 1 or k.min() == k.max()))
  if rank is not None and (rank >= 3 or rank == 2 and single):
    return data[0]   # [n, m] diagonals to [n, m, m] matrices, or [n, m, m] matrices' parts
  return f'a {op.type} whose matrix axes include the batch axis (rank {rank})'


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {**dict.fromkeys(SHAPES, _shapes), 'Size': _size, 'Rank': _rank,
         **dict.fromkeys(SHAPED, _shaped),
         **dict.fromkeys(('Range',) + _MATRICES, _batch_size_value)}
