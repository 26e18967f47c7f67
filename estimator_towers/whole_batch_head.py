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

What it does not do (the warning of `row_dependence` stays): micro-batches
(an error), across workers, a frontier tensor some tower has no counterpart
of, and a loss of several tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers import row_dependence as rd

_HEAD_KINDS = (rd.MIXED, rd.STAT, rd.SIZE, rd.SHAPE, rd.COLS, rd.UNIQUE)


def build(found: rd.RowDependence, loss: tf.Tensor, grad_y: Any, find: Callable,
          sizes: Sequence, nonempty: Sequence, batch: Any
          ) -> tuple[tf.Tensor, list, list] | None:
  """The whole batch's head of tower 0's `loss`, or None where it cannot be built.

  Args:
    found: `row_dependence.classify` of the loss (with mixing ops).
    loss: tower 0's loss.
    grad_y: the request's initial gradient of the loss, or None.
    find: `find(i, t)`, shard i's counterpart of tower 0's `t` (None: unknown).
    sizes, nonempty: per shard, its examples (int or scalar Tensor) and
      whether it has any (bool or Tensor).
    batch: the whole batch's examples.

  Returns:
    (whole-batch loss, per shard (frontier tensors, their initial
    gradients), every shard's frontier tensors: where the head's own
    backward pass stops).
  """
  head, frontier, shapes = _head(found, loss)
  if head is None:
    return None
  per_shard = []
  for i in range(len(sizes)):
    mine = [t if i == 0 else find(i, t) for t in frontier]
    if any(t is None for t in mine):
      return None
    per_shard.append(mine)
  device = loss.op.device
  with tf.device(device), tf.name_scope('whole_batch_head'):
    mapped = {}
    for j, t in enumerate(frontier):
      kind = found.kind(t)
      mapped[t.name] = _gathered([s[j] for s in per_shard], kind, sizes, nonempty)
    for t in shapes:
      mapped[t.name] = _whole_shape(t, found.kind(t.op.inputs[0]), batch)
    for op in head:
      copy = _copy(op, [mapped.get(t.name, t) for t in op.inputs])
      for a, b in zip(op.outputs, copy.outputs):
        mapped[a.name] = b
    whole = mapped[loss.name]
    everything = [t for shard in per_shard for t in shard]
    grads = tf.gradients(whole, everything, grad_ys=None if grad_y is None else [grad_y],
                         stop_gradients=everything)
  seeds, position = [], 0
  for shard in per_shard:
    shard_grads = []
    for t in shard:
      g = grads[position]
      position += 1
      if g is None:
        with tf.device(device):
          g = tf.zeros_like(t)
      shard_grads.append(tf.convert_to_tensor(g))
    seeds.append((list(shard), shard_grads))
  return whole, seeds, everything


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
    if k.tag in (rd.ROWS, rd.FLAT):
      frontier[t.name] = t
      continue
    if k.tag not in _HEAD_KINDS:
      return None, None, None
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


def _gathered(parts: list, kind: rd.Kind, sizes: Sequence, nonempty: Sequence) -> tf.Tensor:
  """The shards' rows of one frontier tensor, in input order (blocks kept apart)."""
  blocks = kind.blocks if kind.tag == rd.ROWS else 1
  pieces = [[] for _ in range(blocks)]
  for part, size, ne in zip(parts, sizes, nonempty):
    if kind.tag == rd.FLAT:   # entries of the shard's examples: all, or none if empty
      if ne is True:
        pieces[0].append(part)
      else:
        pieces[0].append(part[:tf.shape(part)[0] * tf.cast(ne, tf.int32)])
      continue
    if blocks == 1 and isinstance(size, int):
      pieces[0].append(part)
      continue
    rows = tf.shape(part)[0] // blocks   # with a borrowed row, 1 while size is 0
    for j in range(blocks):
      pieces[j].append(part[j * rows:j * rows + tf.cast(size, tf.int32)])
  flat = [p for block in pieces for p in block]
  return flat[0] if len(flat) == 1 else tf.concat(flat, 0)


def _whole_shape(t: tf.Tensor, kind: rd.Kind, batch: Any) -> tf.Tensor:
  """The whole batch's value of Shape(x) or Size(x), for per-example rows x."""
  x = t.op.inputs[0]
  rows = tf.cast(batch, t.dtype) * kind.blocks
  rest = tf.shape(x, out_type=t.dtype)[1:]
  if t.op.type == 'Size':
    return rows * tf.reduce_prod(rest)
  return tf.concat([tf.reshape(rows, [1]), rest], 0)


def _copy(op: tf.Operation, inputs: list) -> tf.Operation:
  """`op` again on `inputs`: its type and attributes (its gradient override too)."""
  attrs = {k: v for k, v in op.node_def.attr.items()
           if not k.startswith('_') or k == '_gradient_op_type'}
  return op.graph.create_op(op.type, list(inputs), [o.dtype for o in op.outputs],
                            attrs=attrs, name=op.name.split('/')[-1])
