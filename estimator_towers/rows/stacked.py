"""Stacked layouts: where an op puts the batch axis and the copies stacked on it.

The rule. Rows are one row per example on axis 0, or `blocks` copies of the
shard's examples stacked there: two views of each example concatenated on
axis 0 (SimCLR's `concat(split(x, 2, -1), 0)`) are rows in 2 blocks, and a
split of them back into 2 is rows again. A reshape, transpose, tile,
expand_dims, squeeze, concat, stack, unstack, split, slice or pad that
leaves axis 0 alone (or changes only the axes after it) keeps the rows; a
transpose of [n, d] puts the batch on axis 1 (columns) and back. A reshape
keeps each example's values together, in example order (within each block
of rows stacked in blocks): to a leading size of k times the examples
(`sizes.batch_multiple`: `tf.shape(x)[0] * T`, a static size of a static
batch, -1 with the sizes after it known) it makes flat rows of k rows per
example (`flat`; in the rows' b blocks, k / b per example in each), rows
for k = 1 (k = b), from rows or from flat rows whose rows per example are
known; flat rows of no known `per` reshaped to the batch's size mix (their
examples' rows differ in number). A split of flat rows in blocks keeps
their blocks apart as rows'.
Whatever moves values between the batch's rows (a slice, reverse, top-k,
cumulative sum or pad across axis 0, a stack before it, a concat on
it of rows with other values) mixes them, and so does an axis the graph
does not say when it is built.

Entries lifted onto axis 1: `expand_dims(x, 0)` of rows or flat rows puts
one axis of 1 before them ([1, n, ...], the pad-removing FFN's), and
`squeeze(axis=0)` takes it away again; a tensordot's reshape to [n, d] and
back to [1, n, k] (its shape read from the lifted tensor's) keeps each
entry's row, as does a transpose that leaves axes 0 and 1 alone. Any other
op on them moves their batch axis (1), and mixes.
"""

from __future__ import annotations

import numpy as np

from estimator_towers.base import shapes
from estimator_towers.rows.elementwise import elementwise
from estimator_towers.rows.kinds import (COLS, COLS_KIND, FLAT, FLAT_KIND, LIFTED, LIFTED_SHAPE,
                                         LIFTED_SHAPE_KIND, POSITIONS, ROWS, ROWS_KIND, SHAPE,
                                         SHAPE_KIND, SIZE, SIZE_KIND, STAT, Kind, flat_kind, lifted,
                                         rows_per_example, same_for_each, stat_of, unlifted)
from estimator_towers.rows.sizes import batch_multiple, times
from estimator_towers.rows.static_values import axes_of, product, static_value


def _reshape(reader, op, kinds):
  x, shape = kinds
  if x is None:
    return ('a reshape of a constant to the batch\'s size' if shape is not None
            else None)
  if x.tag in (STAT, SIZE, SHAPE, LIFTED_SHAPE):
    return x if x.tag == STAT else SIZE_KIND
  if x.tag == POSITIONS:   # [n, 1] -> [n] (tf.boolean_mask's): the same positions
    inner = product(op.inputs[0].shape[1:]) if op.inputs[0].shape.rank else None
    out_inner = product(op.outputs[0].shape[1:]) if op.outputs[0].shape.rank else None
    return x if inner is not None and inner == out_inner else (
        'a reshape of tf.where\'s positions')
  if x.tag == LIFTED or (shape is not None and shape.tag == LIFTED_SHAPE):
    return _lifted_reshape(op, x, shape)
  if shape is not None and shape.tag == SHAPE and x.tag in (ROWS, FLAT):   # tf.shape(y)'s
    if x.tag == FLAT and x.per is None and shape.layout != FLAT and shape.blocks == x.blocks:
      return Kind(ROWS, x.blocks)   # a dense tensor's merged axes back to its rows' shape
    if shape.layout == FLAT and not same_for_each(shape.per):   # a count the values decide
      return flat_kind(x.per, x.blocks) if x.tag == FLAT and (x.per, x.blocks) == (
          shape.per, shape.blocks) else 'a reshape of flat rows to the shape of other entries'
    return _to_layout(x, times(shape.blocks, 1 if shape.layout != FLAT else shape.per))
  out, in_shape = op.outputs[0].shape, op.inputs[0].shape
  value = static_value(op.inputs[1]) if shape is None else None
  if value is not None and value.ndim == 1 and out.rank == len(value):
    out = out.merge_with([None if d < 0 else int(d) for d in value])
  if shape is not None and op.inputs[1].op.type == 'Pack' and x.tag in (ROWS, FLAT) and (
      [reader.kind(e) is not None for e in op.inputs[1].op.inputs][:2] == [False, True]) and (
          static_value(op.inputs[1].op.inputs[0]) == 1):
    return COLS_KIND   # [1, n * ..., ...]: layer norm's fused batch norm over the examples
  if shape is not None and op.inputs[1].op.type == 'Pack':   # [n, -1], [1, n], ...
    elements = op.inputs[1].op.inputs
    sized = [i for i, e in enumerate(elements) if reader.kind(e) is not None]
    first = static_value(elements[0]) if len(elements) > 1 else None
    if sized == [1] and len(elements) == 2 and first is not None and first == 1 and (
        in_shape.rank == 1):
      return COLS_KIND
    if sized == [0] and len(elements) == 2 and static_value(elements[1]) is not None and (
        static_value(elements[1]) == 1) and in_shape.rank == 1 and x.tag == ROWS:
      return x
    if sized == [0] and x.tag in (ROWS, FLAT):
      return _to_layout(x, batch_multiple(reader, elements[0]))
  if x.tag == COLS:
    if shape is not None and shapes.dim(in_shape) == 1 and (
        op.inputs[1].op.type == 'Shape' or shape.tag == SHAPE):
      return ROWS_KIND   # [1, n, ...] back to the rows' shape
    return 'a reshape of values with the batch on axis 1'
  if shape is not None:
    return 'a reshape to sizes computed from the batch the library cannot relate to it'
  if out.rank == 0:
    return 'a reshape of the batch to one value'
  if out.rank is None:
    return 'a reshape to an unknown rank'
  if in_shape.rank == 1 and out.rank == 2 and shapes.dim(out) == 1:
    return COLS_KIND   # [n] -> [1, n]
  if shapes.dim(out) is not None and value is not None and value[0] >= 0:
    return _to_layout(x, _static_multiple(reader, shapes.dim(out)))
  return _by_inner_sizes(x, in_shape, out, value)


def _static_multiple(reader, size: int):
  if reader.examples is None or size <= 0 or size % reader.examples:
    return None
  return size // reader.examples


def _to_layout(x, k):
  """`x` reshaped to k rows per example on axis 0 (a reshape keeps each example's values
  together in example order, within each of the b blocks): rows for k = b, flat rows of
  `per` k / b in b blocks, else why it mixes."""
  if k is None:
    return 'a reshape to a size the library cannot relate to the batch size'
  if rows_per_example(x, blocks=True) is None:
    return ('a reshape of flat rows whose rows per example are unknown to a size of the '
            'batch')
  b = x.blocks
  coefficient, names = (k, ()) if isinstance(k, int) else k
  if coefficient % b:
    return 'a reshape of rows stacked in blocks to a size that mixes the blocks'
  q = coefficient // b if not names else (coefficient // b, names)
  if q == 1:
    return x if x.tag == ROWS else Kind(ROWS, b)
  return flat_kind(q, b)


def _by_inner_sizes(x, in_shape, out, value):
  """A reshape to [-1, ...]: the rows per example from the sizes after axis 0."""
  inner_in = product(in_shape[1:]) if in_shape.rank else None
  inner_out = product(out[1:])
  each = 1 if x.tag == ROWS else x.per   # rows per example in each block
  if inner_in is not None and inner_out:
    if inner_in == inner_out:
      return x
    if isinstance(each, int) and (each * inner_in) % inner_out == 0:
      return _to_layout(x, x.blocks * each * inner_in // inner_out)
    if x.tag == FLAT and each is None and inner_in % inner_out == 0:
      return flat_kind(None, x.blocks)   # the flat rows' entries split further
    return 'a reshape that moves values between the batch\'s rows'
  if x.tag in (ROWS, FLAT) and (out.rank == 1 or _merges_batch(in_shape, value)):
    return flat_kind(None, x.blocks)   # each example's values, in example order ([n, T, ..., d]
    # to [-1, ..., d], T unknown: the batch axis merged with the next ones)
  return 'a reshape whose rows cannot be told from the graph'


def _merges_batch(in_shape, value) -> bool:
  """Is `value` [-1, d...], with d... the last axes of a shape of more axes (the ones
  before unknown): the batch axis merged with the next ones (`tf.nn.sparse_softmax_cross_
  entropy_with_logits` of [n, T, V] logits, T unknown, reshapes them to [-1, V])."""
  if value is None or value.ndim != 1 or len(value) < 2 or int(value[0]) != -1 or (
      in_shape.rank is None or in_shape.rank <= len(value)):
    return False
  kept = in_shape.as_list()[in_shape.rank - len(value) + 1:]
  return all(d is not None and d == int(v) for d, v in zip(kept, value[1:]))


def _lifted_reshape(op, x, shape):
  """[1, n, ...] to [n, ...] or [1, n, ...] and back: each entry's row kept, else mixing."""
  out, in_shape = op.outputs[0].shape, op.inputs[0].shape
  why = 'a reshape that moves entries lifted onto axis 1 between rows'
  if op.inputs[1].op.type == 'Pack' and out.rank == len(op.inputs[1].op.inputs):
    values = [static_value(e) for e in op.inputs[1].op.inputs]
    out = out.merge_with([None if v is None or int(v) < 0 else int(v) for v in values])
  if out.rank is None or in_shape.rank is None or (shape is not None and shape.tag not in (
      SIZE, SHAPE, LIFTED_SHAPE)):
    return why
  if x.tag == LIFTED:   # [1, n, d...] -> [n, d'...] or [1, n, d'...]
    inner = product(in_shape[2:])
    if out.rank >= 2 and shapes.dim(out) == 1 and shape is not None and shape.tag == LIFTED_SHAPE and (
        inner is not None and inner == product(out[2:])):
      return x
    if out.rank >= 1 and inner is not None and inner == product(out[1:]) and (
        shape is None or shape.tag != LIFTED_SHAPE):
      return unlifted(x)
    return why
  if x.tag in (ROWS, FLAT) and out.rank >= 2 and shapes.dim(out) == 1 and (   # [n, d...] -> [1, n, d'...]
      product(in_shape[1:]) is not None and product(in_shape[1:]) == product(out[2:])):
    return lifted(x)
  return why


def _tile(reader, op, kinds):
  x, multiples = kinds
  value = static_value(op.inputs[1])
  if multiples is None and x is not None and x.tag in (ROWS, FLAT) and value is not None and (
      value[0] == 1):
    return x
  if multiples is None and x is not None and x.tag == COLS and value is not None and (
      len(value) == 2 and value[1] == 1):
    return x   # more rows of the same columns (tf.metrics.auc's thresholds)
  elements = op.inputs[1].op.inputs if op.inputs[1].op.type == 'Pack' else ()
  sized = [i for i, e in enumerate(elements) if reader.kind(e) is not None]
  if x is None and multiples is not None and op.inputs[0].shape.rank == len(elements):
    if sized == [0] and shapes.dim(op.inputs[0]) == 1:
      return ROWS_KIND
    if sized == [1] and len(elements) == 2 and shapes.dim(op.inputs[0], 1) == 1:
      return COLS_KIND   # a constant column repeated for every example
  if multiples is not None and multiples.tag == SHAPE and (x is None) and (
      shapes.dim(op.inputs[0]) == 1):
    return ROWS_KIND if multiples.layout != FLAT else flat_kind(multiples.per)
  if x is not None and x.tag in (STAT, SIZE) and multiples is None:
    return x
  return 'a tile of the batch axis'


def _transpose(reader, op, kinds):
  x, perm = kinds
  value = static_value(op.inputs[1])
  if perm is None and x.tag in (STAT, SIZE):
    return x
  if x.tag == LIFTED:
    return x if perm is None and value is not None and list(value[:2]) == [0, 1] else (
        'a transpose that moves the batch axis of entries lifted onto axis 1')
  if perm is None and value is not None and (len(value) == 0 or value[0] == 0):
    return x if x.tag != SHAPE else SIZE_KIND
  if perm is None and value is not None and x.tag in (ROWS, COLS) and (
      x.tag == COLS or x.blocks == 1) and len(value) >= 2:
    axis = list(value).index(0 if x.tag == ROWS else 1)   # where the batch axis goes
    if axis < 2:   # [n, T, d] <-> [T, n, d]: time-major, the batch on axis 1
      return (ROWS_KIND, COLS_KIND)[axis]
  return 'a transpose that moves the batch axis'


def _expand_dims(reader, op, kinds):
  x, axis = kinds
  value = static_value(op.inputs[1])
  if axis is None and x.tag == SIZE and value is not None and int(np.reshape(value, [-1])[0]) in (
      0, -1) and op.inputs[0].shape.rank == 0 and batch_multiple(reader, op.inputs[0]) == 1:
    return SHAPE_KIND   # [n]: a shape whose first size is the batch's (a zero state's)
  if axis is None and x.tag in (STAT, SIZE):
    return x
  if axis is None and value is not None:
    a = int(np.reshape(value, [-1])[0])
    rank = op.inputs[0].shape.rank
    if a < 0 and rank is not None:
      a = a + rank + 1
    if x.tag == LIFTED:
      return x if a >= 2 else 'a new axis before the batch axis of entries lifted onto axis 1'
    if a == 0 and x.tag in (ROWS, FLAT):
      return lifted(x)   # [1, n, ...]: the pad-removing FFN's
    if a > 0:
      return x if x.tag != SHAPE else SIZE_KIND
    if x.tag == SHAPE or x.tag == SIZE:
      return SIZE_KIND
  return 'a new axis before the batch axis'


def _squeeze(reader, op, kinds):
  x = kinds[0]
  if x.tag in (STAT, SIZE):
    return x
  dims = list(op.get_attr('squeeze_dims'))
  rank = op.inputs[0].shape.rank
  dims = [d + rank if d < 0 and rank is not None else d for d in dims]
  if x.tag == POSITIONS:
    return x if dims and all(d >= 1 for d in dims) else 'a squeeze of tf.where\'s positions'
  if x.tag == LIFTED:
    if dims == [0]:
      return unlifted(x)
    if dims and all(d >= 2 for d in dims):
      return x
    return 'a squeeze of the batch axis of entries lifted onto axis 1'
  if (dims and 0 not in dims and (rank is None or all(d >= 0 for d in dims))) or (
      not dims and op.inputs[0].shape.rank and shapes.dim(op.inputs[0]) != 1):
    return x if x.tag != SHAPE else SIZE_KIND
  return 'a squeeze of the batch axis'


def _concat(reader, op, kinds):
  kinds, axis_kind, axis_tensor = kinds[:-1], kinds[-1], op.inputs[-1]
  kinds = [k for k, t in zip(kinds, op.inputs) if t.shape.num_elements() != 0]   # not [] (shape[:0])
  if axis_kind is not None:
    return 'a concat along an axis computed from the batch'
  rank = op.outputs[0].shape.rank
  axes = axes_of(axis_tensor, rank)
  if axes is None:
    return 'a concat along an axis unknown when the graph is built'
  present = [k for k in kinds if k is not None]
  if any(k.tag in (LIFTED, LIFTED_SHAPE) for k in present):
    if axes[0] >= 2 and all(k.tag == LIFTED for k in present):
      return elementwise(reader, op, kinds[:])
    if axes[0] == 0 and kinds[0] is not None and kinds[0].tag == LIFTED_SHAPE and len(
        present) == 1:
      return LIFTED_SHAPE_KIND   # [1, n] then sizes that do not depend on the batch
    return 'a concat along the batch axis of entries lifted onto axis 1'
  if axes[0] != 0:
    return elementwise(reader, op, kinds[:])
  tags = {k.tag for k in present}
  if tags == {ROWS} and len(present) == len(kinds):
    return Kind(ROWS, sum(k.blocks for k in present))
  if tags == {FLAT} and len(present) == len(kinds):
    return FLAT_KIND
  if kinds[0] is not None and kinds[0].tag == SHAPE and tags == {SHAPE}:
    return kinds[0]
  if kinds[0] is not None and kinds[0].tag == SHAPE and len(present) == 1:
    return kinds[0]   # the batch size first, then sizes that do not depend on it
  if tags <= {STAT, SIZE, SHAPE}:
    return stat_of(present) if STAT in tags else SIZE_KIND
  return 'a concat on the batch axis of rows with other values'


def _pack(reader, op, kinds):
  axis = op.get_attr('axis')
  present = [k for k in kinds if k is not None]
  tags = {k.tag for k in present}
  if tags & {LIFTED, LIFTED_SHAPE}:
    rank = op.outputs[0].shape.rank
    if tags == {LIFTED} and rank is not None and (axis if axis >= 0 else axis + rank) >= 2:
      return elementwise(reader, op, kinds)
    return 'a stack of entries lifted onto axis 1 before their batch axis'
  if axis != 0 and (axis > 0 or op.outputs[0].shape.rank is not None) and (
      axis > 0 or axis + op.outputs[0].shape.rank > 0):
    return elementwise(reader, op, kinds)
  if tags <= {SIZE} and kinds[0] is not None and all(
      t.shape.rank == 0 for t in op.inputs):   # [k * n, ...]: a shape of k rows per example
    k = batch_multiple(reader, op.inputs[0])
    if k is None:
      return SIZE_KIND
    return SHAPE_KIND if k == 1 else Kind(SHAPE, per=k, layout=FLAT)
  if tags <= {STAT, SIZE}:
    return stat_of(present) if STAT in tags else SIZE_KIND
  if tags == {ROWS} and len(present) == len(kinds) and len({k.blocks for k in present}) == 1:
    return COLS_KIND   # [n] values stacked: the batch on axis 1
  return 'a stack of rows on a new axis before the batch axis'


def _unpack(reader, op, kinds):
  kind = kinds[0]
  axis = op.get_attr('axis')
  if kind.tag == SHAPE and axis == 0:
    return [SIZE_KIND] + [None] * (len(op.outputs) - 1)
  if kind.tag in (STAT, SIZE):
    return [kind] * len(op.outputs)
  rank = op.inputs[0].shape.rank
  if axis > 0 or (axis < 0 and rank is not None and axis + rank > 0):
    return [kind] * len(op.outputs)
  return 'an unstack of the batch axis'


def _split(op, kind, axis_tensor, num_split, sizes_kind=None):
  if kind is not None and kind.tag in (STAT, SIZE) and (
      sizes_kind is None or sizes_kind.tag in (STAT, SIZE, SHAPE)):
    return [kind] * len(op.outputs)
  if sizes_kind is not None:
    return 'a split whose sizes depend on the batch'
  axes = axes_of(axis_tensor, op.outputs[0].shape.rank)
  if axes is None:
    return 'a split along an axis unknown when the graph is built'
  if kind.tag in (STAT, SIZE):
    return [kind] * len(op.outputs)
  if axes[0] != 0:
    return [kind] * len(op.outputs)
  count = len(op.outputs)
  if kind.tag in (ROWS, FLAT) and num_split is not None and kind.blocks % count == 0:
    return [Kind(kind.tag, kind.blocks // count, per=kind.per)] * count   # the views apart
  return 'a split of the batch axis'


def _split_even(reader, op, kinds):
  return _split(op, kinds[1], op.inputs[0], op.get_attr('num_split'))


def _split_v(reader, op, kinds):
  return _split(op, kinds[0], op.inputs[2], None, kinds[1])


def _strided_slice(reader, op, kinds):
  x = kinds[0]
  if any(k is not None for k in kinds[1:]):
    return _slice_by_batch(op, x)
  begin, end, strides = (static_value(t) for t in op.inputs[1:4])
  begin_mask, end_mask = op.get_attr('begin_mask'), op.get_attr('end_mask')
  ellipsis, new_axis = op.get_attr('ellipsis_mask'), op.get_attr('new_axis_mask')
  shrink = op.get_attr('shrink_axis_mask')
  if x.tag == LIFTED_SHAPE:   # [1, n, ...][i]: n at 1, static sizes elsewhere
    length = shapes.dim(op.inputs[0])
    if shrink & 1 and begin is not None and not (ellipsis & 1 or new_axis & 1) and (
        int(begin[0]) >= 0 or length is not None):
      start = int(begin[0]) + (length if int(begin[0]) < 0 else 0)
      return SIZE_KIND if start == 1 else None
    return SIZE_KIND
  if x.tag == LIFTED:
    return 'a slice of entries lifted onto axis 1'
  if x.tag == POSITIONS:   # all of them, as they are; a column of them is not a position
    same = op.outputs[0].shape.as_list() == op.inputs[0].shape.as_list() if (
        op.outputs[0].shape.rank is not None) else False
    return x if same and not (shrink or new_axis or ellipsis) and (begin_mask & 1 or (
        begin is not None and begin[0] == 0)) and end_mask & 1 and (
            strides is not None and strides[0] == 1) else 'a slice of tf.where\'s positions'
  if x.tag == SHAPE:
    if op.outputs[0].shape.num_elements() == 0:
      return None   # no size at all (shape[:0])
    if begin is None:
      return SIZE_KIND
    if ellipsis & 1 or new_axis & 1:
      return SIZE_KIND
    length = shapes.dim(op.inputs[0])
    start = 0 if begin_mask & 1 else int(begin[0])
    if start < 0:
      start = start + length if length is not None else -1
    if start < 0:
      return SIZE_KIND
    if shrink & 1:
      return SIZE_KIND if start == 0 else None
    return x if start == 0 else None
  if x.tag in (STAT, SIZE):
    return x
  if x.tag == COLS:
    return _time_major_slice(x, begin, end, strides, begin_mask, end_mask, ellipsis | new_axis,
                             shrink)
  if ellipsis & 1:
    return x
  if new_axis & 1 or shrink & 1:
    return 'a slice that picks rows of the batch'
  whole = (begin_mask & 1 or (begin is not None and begin[0] == 0)) and (end_mask & 1) and (
      strides is not None and strides[0] == 1)
  return x if whole else 'a slice of the batch axis'


def _time_major_slice(x, begin, end, strides, begin_mask, end_mask, moved, shrink):
  """A slice of time-major values [T, n, ...] (the batch on axis 1) that keeps axis 1 whole:
  of one step (`outputs[-1]`) rows, of steps the same columns."""
  if moved & 3 or shrink & 2 or begin is None or strides is None:
    return 'a slice of values with the batch on axis 1 that picks rows of the batch'
  if len(begin) >= 2 and not ((begin_mask & 2 or int(begin[1]) == 0) and end_mask & 2 and (
      int(strides[1]) == 1)):
    return 'a slice of values with the batch on axis 1 that picks rows of the batch'
  return ROWS_KIND if shrink & 1 else x


def _slice_by_batch(op, x):
  if x.tag in (ROWS, FLAT):
    return 'a slice of the batch axis at positions computed from the batch'
  return SIZE_KIND if x.tag in (SIZE, SHAPE) else x


def _slice(reader, op, kinds):
  x = kinds[0]
  if any(k is not None for k in kinds[1:]):
    return _slice_by_batch(op, x)
  begin, size = static_value(op.inputs[1]), static_value(op.inputs[2])
  if x.tag in (STAT, SIZE):
    return x
  if x.tag == SHAPE:
    if begin is not None and begin[0] > 0 and static_value(op.outputs[0]) is not None:
      return None   # static sizes after the batch's: the same on every shard
    return x if begin is not None and begin[0] == 0 else SIZE_KIND
  if begin is not None and size is not None and begin[0] == 0 and size[0] == -1:
    return x
  return 'a slice of the batch axis'


def _pad(reader, op, kinds):
  x = kinds[0]
  if any(k is not None for k in kinds[1:]):
    return 'padding computed from the batch'
  paddings = static_value(op.inputs[1])
  if x.tag in (STAT, SIZE):
    return x
  if paddings is None and op.inputs[1].op.type == 'Pack' and (
      op.inputs[1].op.get_attr('axis') == 0):   # [[0, 0], [0, m - tf.shape(x)[1]], ...]
    paddings = [static_value(op.inputs[1].op.inputs[0])]
  if paddings is not None and paddings[0] is not None and not np.any(paddings[0]):
    return x
  return 'padding of the batch axis'


def _top_k(reader, op, kinds):
  why = 'a top-k across the batch axis'
  x = kinds[0]
  rank = op.inputs[0].shape.rank
  if x.tag not in (STAT, SIZE) and not (x.tag == ROWS and rank is not None and rank >= 2):
    return why
  if any(k is not None for k in kinds[1:]):
    return 'an op whose size depends on the batch'
  return [x] * len(op.outputs)


def _reverse(reader, op, kinds):
  x = kinds[0]
  if kinds[1] is not None:
    return 'a reverse along axes computed from the batch'
  if x.tag in (STAT, SIZE):
    return x
  axes = axes_of(op.inputs[1], op.inputs[0].shape.rank)
  if axes is not None and (1 if x.tag == COLS else 0) not in axes:
    return x   # along other axes (of time-major values: along time, Keras' go_backwards)
  return 'a reverse across the batch axis'


def _cumulative(reader, op, kinds):
  x, axis_tensor, why = kinds[0], op.inputs[1], 'a cumulative sum across the batch axis'
  if x.tag in (STAT, SIZE):
    return x
  axes = axes_of(axis_tensor, op.inputs[0].shape.rank)
  if axes is not None and 0 not in axes:
    return x
  return why


# Op type -> the reader of its kinds (reader, op, kinds): the dispatch of `reader`.
RULES = {'Reshape': _reshape, 'Tile': _tile, 'Transpose': _transpose,
         'ExpandDims': _expand_dims, 'Squeeze': _squeeze, 'ConcatV2': _concat, 'Pack': _pack,
         'Unpack': _unpack, 'Split': _split_even, 'SplitV': _split_v,
         'StridedSlice': _strided_slice, 'Slice': _slice,
         **dict.fromkeys(('Pad', 'PadV2', 'MirrorPad'), _pad), 'TopKV2': _top_k,
         'ReverseV2': _reverse,
         **dict.fromkeys(('Cumsum', 'Cumprod', 'CumulativeLogsumexp'), _cumulative)}
