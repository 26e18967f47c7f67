"""Static values: what the graph says when it is built, the readers' constants.

The rule. A reader decides from values known when the graph is built: an
axis, a reshape's shape, a slice's begin, a tile's multiples. `static_value`
is `tf.get_static_value` and a small constant folder over it (shapes of
static sizes, their slices, gathers and products, packs, concats,
arithmetic, ranges and reshapes); `axes_of` reads an axis argument
(negative axes counted from `rank`). Unknown is None, never
a guess: a reader given None for an axis treats the op as mixing the rows.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from estimator_towers.base import shapes

_FOLDED = {'Sub': np.subtract, 'AddV2': np.add, 'Add': np.add, 'Mul': np.multiply,
           'Neg': np.negative, 'FloorDiv': np.floor_divide, 'Identity': lambda a: a,
           'Reshape': np.reshape, 'Range': np.arange}


def static_value(t: tf.Tensor, depth: int = 0):
  """`t`'s value if known when the graph is built (a small constant folder)."""
  value = tf.get_static_value(t)
  if value is None and depth < 8:
    op = t.op
    if op.type == 'Rank' and op.inputs[0].shape.rank is not None:
      return np.asarray(op.inputs[0].shape.rank, np.int32)
    if op.type in _FOLDED:
      args = [static_value(i, depth + 1) for i in op.inputs]
      if all(a is not None for a in args):
        return np.asarray(_FOLDED[op.type](*args))
    if (op.type == 'StridedSlice' and op.inputs[0].op.type == 'Shape'
        and op.get_attr('shrink_axis_mask') == 1 and op.inputs[0].op.inputs[0].shape.rank):
      begin, dims = static_value(op.inputs[1], depth + 1), op.inputs[0].op.inputs[0].shape
      if begin is not None and -dims.rank <= int(begin[0]) < dims.rank and dims[int(begin[0])]:
        return np.asarray(dims[int(begin[0])], np.int32)
    if op.type in ('Prod', 'Sum') and op.inputs[0].shape.is_fully_defined() and (
        op.inputs[0].shape.num_elements() == 0):
      return np.asarray(1 if op.type == 'Prod' else 0, op.outputs[0].dtype.as_numpy_dtype)
    if op.type in ('Prod', 'Sum'):   # tensordot's sizes: the product of static dims
      args = [static_value(i, depth + 1) for i in op.inputs]
      if all(a is not None for a in args):
        reduce = np.prod if op.type == 'Prod' else np.sum
        return np.asarray(reduce(args[0], axis=tuple(np.reshape(args[1], [-1]).tolist()),
                                 keepdims=op.get_attr('keep_dims')))
    if op.type == 'GatherV2' and op.inputs[0].op.type == 'Shape':
      return _shape_gather(op, depth)
    if op.type == 'Pack':
      args = [static_value(i, depth + 1) for i in op.inputs]
      if all(a is not None for a in args):
        return np.stack(args, axis=op.get_attr('axis'))
    if op.type == 'ConcatV2':
      args = [static_value(i, depth + 1) for i in op.inputs]
      if all(a is not None and a.ndim for a in args[:-1]) and args[-1] is not None:
        return np.concatenate(args[:-1], axis=int(args[-1]))
    if op.type == 'Slice' and op.inputs[0].op.type == 'Shape':
      return _shape_slice(op, depth)
  return None if value is None else np.asarray(value)


def _shape_gather(op: tf.Operation, depth: int):
  """The value of GatherV2(Shape(x), indices, 0) where those sizes of x are static."""
  dims = op.inputs[0].op.inputs[0].shape
  indices, axis = static_value(op.inputs[1], depth + 1), static_value(op.inputs[2], depth + 1)
  if dims.rank is None or indices is None or axis is None or int(axis) != 0:
    return None
  picked = [shapes.dim(dims, int(i)) for i in np.reshape(indices, [-1])
            if -dims.rank <= int(i) < dims.rank]
  if len(picked) != indices.size or any(d is None for d in picked):
    return None
  return np.reshape(np.asarray(picked, op.outputs[0].dtype.as_numpy_dtype), indices.shape)


def _shape_slice(op: tf.Operation, depth: int):
  """The value of Slice(Shape(x), begin, size) where those sizes of x are static."""
  dims = op.inputs[0].op.inputs[0].shape
  begin, size = static_value(op.inputs[1], depth + 1), static_value(op.inputs[2], depth + 1)
  if dims.rank is None or begin is None or size is None or begin.size != 1 or size.size != 1:
    return None
  start = int(begin[0])
  end = dims.rank if int(size[0]) < 0 else start + int(size[0])
  picked = dims.as_list()[start:end]
  if start < 0 or any(d is None for d in picked):
    return None
  return np.asarray(picked, op.outputs[0].dtype.as_numpy_dtype)


def axes_of(axes_tensor: tf.Tensor, rank: int | None) -> list | None:
  """The axes `axes_tensor` names, non-negative (every axis for range(rank(x))); None if unknown."""
  value = static_value(axes_tensor)
  if value is None and axes_tensor.op.type == 'Range' and (
      axes_tensor.op.inputs[1].op.type == 'Rank' and static_value(axes_tensor.op.inputs[0]) == 0):
    return list(range(64))   # range(rank(x)): every axis
  if value is None:
    return None
  axes = [int(a) for a in np.reshape(value, [-1])]
  if any(a < 0 for a in axes):
    if rank is None:
      return None
    axes = [a + rank if a < 0 else a for a in axes]
  return axes


def product(dims) -> int | None:
  """The number of elements of `dims` (a shape's), None if one is unknown."""
  total = 1
  for d in shapes.dims(dims) if isinstance(dims, tf.TensorShape) else dims:
    if d is None:
      return None
    total *= int(d)
  return total
