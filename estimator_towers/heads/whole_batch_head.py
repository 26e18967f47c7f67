"""The whole-batch head: the ops that mix the batch's rows, run on the whole batch.

The rule. Where tower 0's loss depends on ops that mix the batch's rows
(`row_dependence`: an in-batch softmax's similarity matrix, a batch top-k, an
opaque function of the batch's embeddings, attention over the batch), the
*head* is everything from the last per-example tensors (the frontier) to the
loss: the mixing ops, every op after them, and the statistics and batch-size
values they read. The head is built once more, on the whole batch:

- each frontier tensor is the towers' counterparts gathered in input order,
  on the first tower's device (a stacked layout's blocks kept apart: the
  first views of every tower, then the second views; an empty shard's
  borrowed row left out), so a `tf.range(batch)` label or a 2B-wide one-hot
  is the global one, and a shape read of a per-example tensor is the whole
  batch's shape (computed, not gathered);
- the head's ops are copies of tower 0's (same types and attributes) on those
  values; the head's variables (a trained temperature) are tower 0's reads.

Its loss is the whole batch's loss, reported as the step's loss. Its
gradient with respect to each gathered tensor is cut back into the towers'
rows, and each tower's backward pass starts there (a seed per frontier
tensor, as `seeds` seeds a statistic); the head's own variables get their
gradient once, from the head's backward pass stopped at the towers' frontier
tensors. Nothing else changes: every op before the frontier runs on its
tower, on its rows, and the gradient each row receives is the sum over every
consumer of that row in the whole batch's head.

Across workers the frontier rows are all-gathered from the workers in rank
order and every worker runs the same head (`across_workers`).

`tf.where`'s positions are never gathered (a shard's positions index its own
rows only): the head computes them again from the gathered mask they were
taken of, so a scatter back to them in the head is the whole batch's.

Where the head is made of rows (a softmax per row over the whole batch's
columns, then a mean), `row_wise_head` splits it instead: each tower
computes its own rows against the gathered columns, so that no device holds
a B x B tensor; this module's single head is the fallback.

With micro-batches the head reads each micro-batch's frontier rows from a
first pass that keeps no activations (`cached_gradients`, the `cached`
argument of `build`), and the seeds go to the micro-batches' own tensors; a
head made of rows then runs in row chunks, one at a time per device
(`chunked_head`).

A static batch size changes nothing: while a tower is built its shape reads
(`tf.shape`, `tf.size`, `tf.zeros_like`, `tf.ones_like`) stay ops of the
graph (`interception.shape_reads_kept`), which the head reads as the whole
batch's. A batch size read in Python (`x.shape[0]`) is a constant of the
graph: a head that reads a constant holding the shard's static size in its
value (`static_size`), or in its shape where the head does not build on the
whole batch, is an error at graph construction naming the constant and the
fix (`tf.shape(x)[0]`); the graph cannot tell it from a hyper-parameter.
One built by TensorFlow's gradient code (under an `<op>_grad` scope: a
`tf.gradients` of the shard's static shape through the mixing ops) is the
same error, naming that code and the fix (leave the batch dimension unknown).

What it does not do (the warning of `row_dependence` stays): a frontier
tensor some tower has no counterpart of, a frontier of a SparseTensor's
indices or their example column (positions in each shard's own rows, which
gathered would name other examples), and a head that holds a
synchronised batch norm (mixing ops before a batch norm with
`sync_batch_norm`: `synchronised`). (A gradient request of several tensors
is one scalar's: `request_seeds`.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence
import weakref

import numpy as np
import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import shapes
from estimator_towers.draws import keyed
from estimator_towers.rows import row_dependence as rd
from estimator_towers.sync_points import join as sync_points

_HEAD_KINDS = (rd.MIXED, rd.STAT, rd.SIZE, rd.SHAPE, rd.COLS, rd.UNIQUE, rd.OFFSETS,
               rd.INDICES)


def build(found: rd.RowDependence, loss: tf.Tensor, grad_y: Any, find: Callable,
          sizes: Sequence, nonempty: Sequence, batch: Any, across: Any = None,
          split: Callable | None = None, cached: Callable | None = None, record: bool = True
          ) -> tuple[tf.Tensor, list, list, str] | str:
  """The whole batch's head of tower 0's `loss`, or why it cannot be built.

  Args:
    found: `row_dependence.classify` of the loss (with mixing ops).
    loss: tower 0's loss.
    grad_y: the request's initial gradient of the loss, or None.
    find: `find(i, t)`, shard i's counterpart of tower 0's `t` (None: unknown).
    sizes, nonempty: per shard, its examples (int or scalar Tensor) and
      whether it has any (bool or Tensor).
    batch: the whole batch's examples (the cluster's, across workers).
    across: a `cross_worker.CrossWorker` when the batch spans workers: each
      frontier tensor is then all-gathered from the workers in rank order, and
      every worker runs the same head on the cluster's rows.
    split: `split(found, loss, grad_y, find, frontier, shapes, per_shard,
      sizes, nonempty, batch, across)`, the head made of rows computed per
      tower (`row_wise_head`; with `cached`, per_shard the cached values and
      `own=` the shards' own frontier tensors: `chunked_head`), tried first:
      what it returns, or a sentence saying why not (then the head runs
      once, here).
    cached: `cached(i, t)`, the value the head reads for shard i's rows of
      tower 0's per-example `t`, where it is not the towers' own (micro-batches:
      `cached_gradients`' first pass); None: the towers' own.
    record: a head built once is recorded for `built_once` (False: a value
      only reported, not differentiated: `loss/reported`).

  Returns:
    (whole-batch loss, per shard (frontier tensors, their initial
    gradients), every shard's frontier tensors: where the head's own
    backward pass stops, where the head runs), or a sentence saying why
    there is none.
  """
  head, frontier, shapes = _head(found, loss)
  if head is None:
    return f'the loss {loss.name} is not computed from the mixing ops alone'
  per_shard = []
  for i in range(len(sizes)):
    mine = [t if i == 0 else find(i, t) for t in frontier]
    missing = [f.name for f, t in zip(frontier, mine) if t is None]
    if missing:
      return f'shard {i} built no counterpart of {missing[0]}'
    per_shard.append(mine)
  values = per_shard if cached is None else [[cached(i, t) for t in frontier]
                                             for i in range(len(sizes))]
  static = static_size(head, found, frontier)
  if static is not None:
    raise ValueError(_refused(found, loss, static))
  synced = synchronised(head)
  if synced is not None:
    return synced
  if split is not None:   # micro-batches: on the first pass's rows, seeds at their own
    extra = {} if cached is None else {'own': per_shard, 'cached': cached}
    try:
      built = split(found, loss, grad_y, find, frontier, shapes, values, sizes, nonempty,
                    batch, across, **extra)
    except (ValueError, TypeError) as error:   # not row-wise after all: the single head
      built = str(error)
    if not isinstance(built, str):
      return built
  try:
    built = _build(found, loss, grad_y, head, frontier, shapes, (per_shard, values), sizes,
                   nonempty, batch, across, cached or (lambda i, t: t))
  except (ValueError, TypeError) as error:
    shaped = _shaped_by_size(head, found, frontier)
    if shaped is not None:
      raise ValueError(_refused(found, loss, shaped)) from error
    return f'building it on the whole batch failed ({error})'
  device = loss.op.device or 'the first tower'
  if record:
    _once.setdefault(loss.graph, []).append(Once(found.mixing[0], device))
  return built + (f'{_ONCE}{device}',)


@dataclasses.dataclass(frozen=True)
class Once:
  """A head built once, on the whole batch: its first mixing op and its device."""
  mixing: rd.Mixing
  device: str


_ONCE = 'on '
_once: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # graph -> [Once]


def runs_once(where: str) -> bool:
  """Whether `build`'s `where` is the head built once on one device (not split per tower)."""
  return where.startswith(_ONCE)


def built_once(graph: tf.Graph) -> list:
  """The heads `build` built once, on the whole batch, in `graph` (`Once`s, in order)."""
  return list(_once.get(graph, ()))


def synchronised(head: list) -> str | None:
  """Why not, if the head holds a sync point of the towers (`sync_batch_norm`'s join).

  A copy of tower 0's synchronised batch norm on the whole batch's rows would
  join the whole batch's statistics with the other towers' shard statistics
  (and a fused one's gradient is its tower's own).
  """
  joins = sync_points.tables(head[0].graph) if head else frozenset()
  for op in head:
    if op.name in joins:
      return (f'the head holds a batch norm synchronised across the towers '
              f'(sync_batch_norm\'s join {op.name!r}), whose copy on the whole batch would '
              f'combine the whole batch\'s statistics with the other towers\'; the batch norm '
              f'reads rows that the mixing ops made')
  return None


def _refused(found: rd.RowDependence, loss: tf.Tensor, why: str) -> str:
  return (f'estimator_towers: the loss {loss.name} depends on {found.mixing[0].describe()}, '
          f'which mixes the batch\'s rows, so it trains through its head on the whole batch; '
          f'but {why} (see docs/cross_example.md).')


def static_size(head: list, found: rd.RowDependence, frontier: list) -> str | None:
  """Why not, if a constant the head reads holds the shard's static size in its value.

  Shape reads of a tower's tensors are ops of the graph even for a static
  shape (`interception.shape_reads_kept`): the head reads them as the whole
  batch's. What is left is a size read in Python (`x.shape[0]`), a constant
  of the graph from the model_fn's call, which the head cannot tell from a
  hyper-parameter. A constant that is a factor or a term of a batch-size
  value (`2 * tf.shape(x)[0]`) is not one, nor is an axis, a begin or a
  stride (`_POSITIONS`), nor a float (a size read in Python feeds a range,
  an identity matrix, a one-hot's depth, a shape: integers).
  """
  rows = _static_rows(head, found, frontier)
  if not rows:
    return None
  for op in head:
    if keyed.built_by_draws(op):   # a keyed draw's own arithmetic (groups, offsets)
      continue
    if op.type in rd.ARITHMETIC and any(
        found.kind(t) is not None and found.kind(t).tag in (rd.SIZE, rd.SHAPE)
        for t in op.inputs):
      continue
    for t in _sizes_read(op, found):
      if found.kind(t) is not None:
        continue
      const = _constant_with(t, found, lambda c: _holds(tf.get_static_value(c), rows))
      if const is not None:
        return _python_size(t, const, rows, 'value')
  return None


# Op type -> its inputs that are positions (axes, begins, strides), never a size (negative:
# counted from the last input).
_POSITIONS = {'Slice': (1,), 'StridedSlice': (1, 3), 'ConcatV2': (-1,), 'Concat': (0,),
              'Transpose': (1,), 'Split': (0,), 'SplitV': (2,), 'GatherV2': (2,),
              'ExpandDims': (1,), 'ReverseV2': (1,), 'ArgMax': (1,), 'ArgMin': (1,),
              'Cumsum': (1,), 'Cumprod': (1,),
              **dict.fromkeys(('Sum', 'Mean', 'Max', 'Min', 'Prod', 'All', 'Any',
                               'EuclideanNorm'), (1,))}


def _sizes_read(op: tf.Operation, found: rd.RowDependence | None = None) -> list:
  """`op`'s inputs but those that are positions (`_POSITIONS`), and but a one-hot's depth
  where its indices are the examples' own (labels: a number of classes)."""
  positions = _POSITIONS.get(op.type, ())
  if op.type == 'OneHot' and found is not None and found.kind(op.inputs[0]) is not None and (
      found.kind(op.inputs[0]).tag in (rd.ROWS, rd.FLAT)):
    positions = (1,)
  return [t for i, t in enumerate(op.inputs)
          if i not in positions and i - len(op.inputs) not in positions]


def _static_rows(head: list, found: rd.RowDependence, frontier: list) -> set:
  """The static sizes of the shard's rows the head reads (1 left out: a broadcast's)."""
  rows = {shapes.dim(t) for t in frontier if shapes.dim(t) is not None}
  rows |= {shapes.dim(t) for op in head for t in op.inputs
           if shapes.dim(t) is not None and found.kind(t) is not None
           and found.kind(t).tag in (rd.ROWS, rd.FLAT)}
  rows.discard(1)
  return rows


def _shaped_by_size(head: list, found: rd.RowDependence, frontier: list) -> str | None:
  """Why not, if a constant the head reads has the shard's static size in its shape.

  Asked where the head on the whole batch failed to build (`tf.eye(n)` of a
  Python int `n` against the whole batch's B x B matrix).
  """
  rows = _static_rows(head, found, frontier)
  for op in head if rows else ():
    if keyed.built_by_draws(op):
      continue
    for t in op.inputs:
      if found.kind(t) is None:
        const = _constant_with(t, found, lambda c: any(d in rows for d in c.shape.as_list()))
        if const is not None:
          return _python_size(t, const, rows, 'shape')
  return None


def _python_size(t: tf.Tensor, const: tf.Tensor, rows: set, where: str) -> str:
  if _gradient_code(const):
    return _static_gradient(t, const, rows, where)
  return (f'its head on the whole batch reads the constant {const.name}'
          f'{"" if t.name == const.name else f" (through {t.name})"}, which holds the '
          f'shard\'s static size ({sorted(rows)[0]}) in its {where}: a batch size read as a '
          f'Python int (x.shape[0], x.shape.as_list()[0]) is a constant of the graph from '
          f'when the model_fn was called, which the head on the whole batch would use as '
          f'the whole batch\'s. Read the batch size with tf.shape(x)[0] (a shape read, '
          f'which the head reads as the whole batch\'s size); if {const.name} is a '
          f'hyper-parameter that only equals the shard\'s size, pick a batch size whose '
          f'shards differ from it, or train on one device')


def _gradient_code(const: tf.Tensor) -> bool:
  """Whether TensorFlow's gradient code built `const` (under an `<op>_grad` name scope of a
  `tf.gradients` call inside the model_fn), from a static shape, not the model_fn itself."""
  return any(part.endswith('_grad') for part in const.op.name.split('/')[:-1])


def _static_gradient(t: tf.Tensor, const: tf.Tensor, rows: set, where: str) -> str:
  return (f'its head on the whole batch reads the constant {const.name}'
          f'{"" if t.name == const.name else f" (through {t.name})"}, which holds the '
          f'shard\'s static size ({sorted(rows)[0]}) in its {where}: TensorFlow\'s gradient '
          f'code built it from a static shape of the shard, for a tf.gradients (or '
          f'GradientTape) call inside the model_fn through ops that mix the batch\'s rows, and '
          f'the head on the whole batch would use it as the whole batch\'s. Leave the batch '
          f'dimension unknown (batch(..., drop_remainder=False), no set_shape or '
          f'tf.ensure_shape of a static batch size), or train on one device')


def _holds(value: Any, rows: set) -> bool:
  """Whether an integer constant's value holds one of `rows` (a scalar, or a vector of sizes)."""
  if value is None:
    return False
  value = np.asarray(value)
  return value.ndim <= 1 and value.dtype.kind in 'iu' and bool(np.isin(value, list(rows)).any())


_VARIABLE_READS = frozenset(('ReadVariableOp', 'VarHandleOp', 'VariableV2', 'Variable',
                             'ResourceGather'))
_SHAPE_READS = frozenset(('Shape', 'ShapeN', 'Size', 'Rank'))


def _constant_with(t: tf.Tensor, found: rd.RowDependence, holds: Callable,
                   limit: int = 200) -> tf.Tensor | None:
  """A constant `t` is computed from for which `holds(constant)`, not through a
  variable, a shape read, a tensor of the shard (those the head reads as the
  whole batch's) or a keyed draw (its constants are Philox's groups)."""
  pending, seen = [t], set()
  while pending and len(seen) < limit:
    x = pending.pop()
    if (x.op.name in seen or x.op.type in _VARIABLE_READS or x.op.type in _SHAPE_READS
        or found.kind(x) is not None or interception.is_folded_rank(x)
        or keyed.built_by_draws(x.op)):
      continue
    seen.add(x.op.name)
    if x.op.type == 'Const':
      if holds(x):
        return x
      continue
    pending.extend(_sizes_read(x.op, found))
  return None


def _build(found, loss, grad_y, head, frontier, shapes, shards, sizes, nonempty, batch,
           across, value):
  """The head's copy on the gathered rows, and the seeds (see `build`)."""
  per_shard, values = shards
  device = loss.op.device
  with tf.device(device), tf.name_scope('whole_batch_head'):
    mapped = {}
    for j, t in enumerate(frontier):
      kind = found.kind(t)
      mapped[t.name] = gathered([s[j] for s in values], kind, sizes, nonempty)
      if across is not None:
        mapped[t.name] = across_workers(mapped[t.name], kind, across)
    for t in shapes:
      mapped[t.name] = whole_shape(t, found.kind(t.op.inputs[0]), batch,
                                   value(0, t.op.inputs[0]))
    for op in head:
      copy = copy_op(op, [mapped.get(t.name, t) for t in op.inputs])
      for a, b in zip(op.outputs, copy.outputs):
        mapped[a.name] = b
    whole = mapped[loss.name]
    everything = [t for shard in values for t in shard]
    grads = gradients_of([whole], everything, None if grad_y is None else [grad_y],
                         stop_gradients=True)
  return whole, shard_seeds(per_shard, values, grads, device), everything


def _differentiable(t: tf.Tensor) -> bool:
  return t.dtype.is_floating or t.dtype.is_complex


def gradients_of(ys: list, tensors: list, grad_ys: list | None, stop_gradients: bool = False,
                 **kwargs) -> list:
  """tf.gradients of `ys` with respect to each of `tensors`: None for a mask or ids (a
  frontier tensor the head reads that is not differentiable: tf.where's mask)."""
  floats = [t for t in tensors if _differentiable(t)]
  if stop_gradients:
    kwargs['stop_gradients'] = floats
  grads = tf.compat.v1.gradients(ys, floats, grad_ys=grad_ys, **kwargs) if floats else []
  found = dict(zip([t.name for t in floats], grads))
  return [found.get(t.name) for t in tensors]


def shard_seeds(per_shard: list, values: list, grads: list, device: str | None = None) -> list:
  """Per shard, (its tensors, their initial gradients) from `grads`, one per tensor of
  `values` in order (zeros where a tensor has none: on `device`, else on its own)."""
  seeds, position = [], 0
  for shard, shard_values in zip(per_shard, values):
    shard_tensors, shard_grads = [], []
    for t, v in zip(shard, shard_values):
      g = grads[position]
      position += 1
      if g is None and not _differentiable(v):
        continue   # a mask or ids the head reads (tf.where's): no gradient to seed
      if g is None:
        with tf.device(v.device if device is None else device):
          g = tf.zeros_like(v)
      shard_tensors.append(t)
      shard_grads.append(tf.convert_to_tensor(g))
    seeds.append((shard_tensors, shard_grads))
  return seeds


def _head(found: rd.RowDependence, loss: tf.Tensor):
  """(head ops in graph order, frontier tensors, per-example tensors whose shape it reads)."""
  kind = found.kind(loss)
  if kind is None or kind.tag != rd.MIXED:
    return None, None, None
  ops, frontier, shapes, seen = {}, {}, {}, set()
  pending = [loss]
  while pending:
    t = pending.pop()
    if t.name in seen:
      continue
    seen.add(t.name)
    k = found.kind(t)
    if k is None:
      continue   # no input of the shard: tower 0's value (a variable's read)
    if k.tag in (rd.ROWS, rd.FLAT) and k.layout in rd.SPARSE_POSITIONS:
      return None, None, None   # a SparseTensor's indices: each shard's own rows, not gathered
    if k.tag in (rd.ROWS, rd.FLAT):
      frontier[t.name] = t
      continue
    if k.tag not in _HEAD_KINDS and k.tag != rd.POSITIONS:
      return None, None, None   # positions: computed again from the gathered rows they index
    op = t.op
    source = found.kind(op.inputs[0]) if op.inputs else None
    if op.type in ('Shape', 'Size') and source is not None and source.tag == rd.ROWS:
      shapes[t.name] = t
      continue
    if op.type in ('Shape', 'Size') and source is not None and source.tag == rd.FLAT:
      frontier[op.inputs[0].name] = op.inputs[0]
    ops[op.name] = op
    pending.extend(op.inputs)
  order = {op.name: i for i, op in enumerate(loss.graph.get_operations())}
  return (sorted(ops.values(), key=lambda op: order[op.name]),
          sorted(frontier.values(), key=lambda t: (order[t.op.name], t.value_index)),
          list(shapes.values()))


def gathered(parts: list, kind: rd.Kind, sizes: Sequence, nonempty: Sequence) -> tf.Tensor:
  """The shards' rows of one frontier tensor, in input order (blocks kept apart)."""
  blocks = kind.blocks if kind.tag in (rd.ROWS, rd.FLAT) else 1
  pieces = [[] for _ in range(blocks)]
  for part, size, ne in zip(parts, sizes, nonempty):
    if kind.tag == rd.FLAT:   # entries of the shard's examples: all, or none if empty
      if ne is not True:
        part = part[:tf.shape(part)[0] * tf.cast(ne, tf.int32)]
      if blocks == 1:
        pieces[0].append(part)
        continue
      entries = tf.shape(part)[0] // blocks   # a stacked layout's blocks: equal parts
      for j in range(blocks):
        pieces[j].append(part[j * entries:(j + 1) * entries])
      continue
    if blocks == 1:   # with a borrowed row, 1 row while size is 0
      pieces[0].append(part if isinstance(size, int) else part[:tf.cast(size, tf.int32)])
      continue
    rows = tf.shape(part)[0] // blocks   # with a borrowed row, 1 while size is 0
    for j in range(blocks):
      pieces[j].append(part[j * rows:j * rows + tf.cast(size, tf.int32)])
  flat = [p for block in pieces for p in block]
  return flat[0] if len(flat) == 1 else tf.concat(flat, 0)


def across_workers(mine: tf.Tensor, kind: rd.Kind, across: Any, summed: bool = False
                   ) -> tf.Tensor:
  """Every worker's rows of a gathered frontier tensor, in rank order (uneven counts too).

  Each worker pads its rows to the largest count, one all-reduce sums the
  workers' slots, and the padding is dropped. Every worker then runs the
  same head on the same rows, so the gradient with respect to a worker's
  rows is its own slice of its own head's gradient: no all-reduce backward.
  With `summed` (each worker's consumers are its own rows' only, as in
  `row_wise_head`) the workers' gradients are summed before the slice.
  A stacked layout's blocks stay apart (each worker's first views, then the
  second views).
  """
  blocks = kind.blocks if kind.tag in (rd.ROWS, rd.FLAT) else 1
  if blocks > 1:
    return tf.concat([across_workers(part, rd.Kind(kind.tag), across, summed)
                      for part in tf.split(mine, blocks, 0)], 0)

  @tf.custom_gradient
  def all_rows(rows):
    result, offset = cluster_rows(rows, across)

    def grad(upstream):
      if summed:
        (upstream,) = across.sum([upstream])
      with tf.device(across.device):
        return upstream[offset:offset + tf.shape(rows)[0]]
    return result, grad

  with tf.name_scope('across_workers'):
    out = all_rows(mine)
  out.set_shape(tf.TensorShape([None]).concatenate(mine.shape[1:]))
  return out


def cluster_rows(rows: tf.Tensor, across: Any) -> tuple[tf.Tensor, tf.Tensor]:
  """(every worker's `rows` in rank order, where this worker's begin), uneven counts too.

  Each worker pads its rows to the largest count, one all-reduce sums the
  workers' slots, and the padding is dropped. Not differentiable.
  """
  with tf.device(across.device):
    count = tf.shape(rows)[0]
    (counts,) = across.sum([tf.one_hot(across.rank, across.size, dtype=tf.int32) * count])
    top = tf.reduce_max(counts)
    padding = [[0, top - count]] + [[0, 0]] * (rows.shape.rank - 1)
    padded = tf.pad(rows, padding)
    slots = tf.scatter_nd([[across.rank]], padded[None],
                          tf.concat([[across.size], tf.shape(padded)], 0))
  (total,) = across.sum([slots])
  with tf.device(across.device):
    return (tf.boolean_mask(total, tf.sequence_mask(counts, top)),
            tf.reduce_sum(counts[:across.rank]))


def whole_shape(t: tf.Tensor, kind: rd.Kind, batch: Any, x: tf.Tensor | None = None
                ) -> tf.Tensor:
  """The whole batch's value of Shape(x) or Size(x), for per-example rows x (`t`'s input)."""
  x = t.op.inputs[0] if x is None else x
  rows = tf.cast(batch, t.dtype) * kind.blocks
  rest = tf.shape(x, out_type=t.dtype)[1:]
  if t.op.type == 'Size':
    return rows * tf.reduce_prod(rest)
  return tf.concat([tf.reshape(rows, [1]), rest], 0)


def copy_op(op: tf.Operation, inputs: list) -> tf.Operation:
  """`op` again on `inputs`: its type and attributes (its gradient override too)."""
  attrs = {k: v for k, v in op.node_def.attr.items()
           if not k.startswith('_') or k == '_gradient_op_type'}
  copy = op.graph.create_op(op.type, list(inputs), [o.dtype for o in op.outputs],
                            attrs=attrs, name=op.name.split('/')[-1])
  interception.copy_gradient_function(op, copy)
  return copy
