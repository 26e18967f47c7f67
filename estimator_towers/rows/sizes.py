"""Sizes: values of the shard's size, and values shaped by it.

The rule. A shape op reads the rows' shape, not their values: a shape of
rows (or of flat rows) is `shape`, the vector whose first element is the
batch size; its size, a `tf.range` of it, an identity matrix or a
diagonal of it are `batch size` values, the same on every shard only in
form (`tf.shape(x)[0]`, `tf.size`). An op whose `shape` input is a `shape`
(`tf.zeros([n, d])`, random noise of `tf.shape(x)`, `tf.fill`) makes rows
of constants; shaped by another value of the batch, it mixes. A statistic's
shape does not depend on the batch; the rank never does. A diagonal or band
of rows (`tf.linalg.diag` of [n, m] rows, the diagonal of [n, m, m] ones,
what `tf.linalg.logdet` and `tf.eye(batch_shape=...)` make) is rows, one
matrix per example; where the batch axis is a matrix axis it mixes.
"""

from __future__ import annotations

from estimator_towers.rows.kinds import (FLAT, ROWS, ROWS_KIND, SHAPE, SHAPE_KIND, SIZE, SIZE_KIND,
                                         STAT, UNIQUE, UNIQUE_KIND, Kind, stat_of)
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
  if kind.tag in (ROWS, FLAT, SIZE, SHAPE):
    return SHAPE_KIND
  return kind   # a statistic's shape does not depend on the batch (or is mixed)


def size_of(kind: Kind | None) -> Kind | None:
  """The kind of the size of a tensor of `kind`."""
  if kind is None:
    return None
  return SIZE_KIND if kind.tag in (ROWS, FLAT, SIZE, SHAPE) else kind   # a set's size: the set's


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
  if any(k.tag not in (ROWS, STAT) for k in rest):
    return 'an op shaped by the batch, of values that are not rows'
  if any(k.tag == STAT and not k.norm for k in rest):
    return 'rows made from a statistic of the batch'
  return ROWS_KIND


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
