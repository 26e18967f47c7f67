"""Cached representation gradients: a loss that mixes the batch's rows, with micro-batches.

The rule. Micro-batches run one after another and never hold the whole
batch's rows at once, so a loss whose ops mix the rows (an in-batch softmax,
a batch top-k: `row_dependence`) cannot be computed on any one of them. It is
computed in two passes over the micro-batches, as GradCache does (Gao et al.
2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup"):

1. First pass: each micro-batch's frontier tensors (the last per-example
   tensors the head reads: the representations) are computed from its inputs
   before its gates, by a copy of tower 0's ops from the shard's inputs to the
   frontier, on the micro-batch's device. Nothing differentiates it (its
   outputs pass `tf.stop_gradient`), so its activations are freed once its
   frontier rows exist, and a device's micro-batches run it one after another
   (each one's inputs wait for the previous one's frontier rows).
2. The head (`whole_batch_head`) runs once, on the whole batch's frontier
   rows gathered from the first pass (all-gathered across workers, once per
   step): the step's loss, its gradient with respect to each micro-batch's
   frontier rows (the cached gradient), and the gradient of the head's own
   variables (a trained temperature), once, from the head's backward pass
   stopped at the frontier.
3. Second pass: the micro-batches as built (their forward passes, each
   device's one after another) start only once the cached gradient exists
   (their input gates wait for it), and each one's backward pass starts from
   its frontier tensors with its rows of the cached gradient; the parts of a
   variable's gradient add into one buffer per variable, as for any loss.

A device then holds one micro-batch's activations plus the frontier rows
(and the first device the head's tensors: a whole batch's as on one device,
`B x B` for an in-batch softmax, except where the head is made of rows: then
one chunk's rows at a time per device, `chunked_head`), and computes each micro-batch's forward
pass to the frontier twice. Both passes give the same
values only if the ops before the frontier are functions of their inputs: a
stateful op among them (a random op such as dropout's, a variable update) is
refused at graph construction; reads of variables are kept (both passes read
the values from before the step's update), and so are a sync point's table
and what is computed from it alone (a synchronised batch norm's statistics
of the whole batch, across workers an all-reduce): the first pass reads the
step's own. Mixing in the middle of the
network (attention over the batch, then more layers) is exact the same way:
the head is everything after the frontier, run on the whole batch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import fixed_sums
from estimator_towers.base import tower_parts
from estimator_towers.draws import keyed
from estimator_towers.heads import chunked_head
from estimator_towers.heads import whole_batch_head
from estimator_towers.inputs import micro_batches
from estimator_towers.rows import row_dependence as rd

# Stateful ops that only read variables: both passes read the same values.
_READS = frozenset(('ReadVariableOp', 'ResourceGather', 'ResourceGatherNd'))


def build(found: rd.RowDependence, loss: tf.Tensor, grad_y: Any, find: Callable,
          inputs: Sequence[tf.Tensor], ungated: Callable, gates: Callable,
          sizes: Sequence, nonempty: Sequence, batch: Any, across: Any = None
          ) -> tuple[tf.Tensor, list, list] | str:
  """The whole batch's head of tower 0's `loss` on the first pass's rows (see the module doc).

  Args:
    found, loss, grad_y, find, sizes, nonempty, batch, across: as for
      `whole_batch_head.build` (shards are micro-batches).
    inputs: tower 0's shard tensors, flattened (after its gates).
    ungated: `ungated(i)`, shard i's flattened inputs before its gates
      (aligned with `inputs`).
    gates: `gates(i)`, the Identity ops shard i's inputs pass through, to
      wait for the cached gradient (none: a later gradient request, whose
      micro-batches the first request's order already holds).

  Returns:
    As `whole_batch_head.build`: (whole-batch loss, per shard (its frontier
    tensors, their rows of the cached gradient), the first pass's frontier
    tensors), or a sentence saying why there is none.

  Raises:
    ValueError: for a stateful op between the inputs and the frontier.
  """
  first = _FirstPass(loss, list(inputs), ungated,
                     lambda i, t: (t if i == 0 else find(i, t)).device)
  built = whole_batch_head.build(found, loss, grad_y, find, sizes, nonempty, batch, across,
                                 split=chunked_head.build, cached=first.value)
  if isinstance(built, str):
    return built
  _, shards, *_ = built
  cached = [g for _, grads in shards for g in grads]
  for i in range(len(sizes)):   # the second pass waits for the cached gradient
    micro_batches.order_after(gates(i), cached)
  return built


class _FirstPass:
  """Each shard's frontier rows from its ungated inputs, without activations kept.

  `value(i, t)` is shard i's copy of tower 0's per-example tensor `t`. Shard
  i's copy starts after the previous shard of its device has made its
  frontier rows: `whole_batch_head.build` asks for every tensor of shard i
  before any of shard i + 1.
  """

  def __init__(self, loss: tf.Tensor, inputs: list, ungated: Callable, device_of: Callable):
    self._loss = loss
    self._inputs = inputs
    self._ungated = ungated
    self._device_of = device_of   # (i, t): the device of shard i's own counterpart of t
    self._copies: dict[int, dict] = {}    # shard -> tower 0's tensor name -> its copy
    self._values: dict[int, dict] = {}    # shard -> tower 0's tensor name -> value
    self._devices: dict[int, str] = {}
    self._scopes: dict[int, str] = {}
    self._root = ''
    self._made: dict[str, list] = {}   # device -> its last shard's values
    self._order: dict[str, int] | None = None

  def value(self, i: int, t: tf.Tensor) -> tf.Tensor:
    if i not in self._copies:
      self._start(i, self._device_of(i, t))
    values = self._values[i]
    if t.name not in values:
      with tf.device(self._devices[i]), tf.name_scope(self._scopes[i]):
        values[t.name] = tf.stop_gradient(self._copy(t, self._copies[i]))
      self._made[self._devices[i]].append(values[t.name])
    return values[t.name]

  def _start(self, i: int, device: str) -> None:
    """Shard i's inputs, after the previous shard's frontier rows on its device."""
    ungated = list(self._ungated(i))
    if len(ungated) != len(self._inputs):
      raise ValueError(f'estimator_towers: shard {i} has {len(ungated)} input tensors, tower 0 '
                       f'{len(self._inputs)}; please report this.')
    previous = self._made.get(device, [])
    if not self._scopes:
      with tf.name_scope('cached_gradients') as root:
        self._root = root
    self._scopes[i] = f'{self._root}shard_{i}/'   # one scope per shard, entered again
    with tf.device(device), tf.name_scope(self._scopes[i]), \
        tf.control_dependencies([v.op for v in previous]):
      ordered = [tf.identity(u) for u in ungated]
    self._devices[i] = device
    self._copies[i] = {t.name: u for t, u in zip(self._inputs, ordered)}
    self._copies[i].update(keyed.positions_for(self._inputs[0].graph, i))   # its draws' rows
    self._values[i] = {}
    self._made[device] = []

  def _copy(self, target: tf.Tensor, copies: dict) -> tf.Tensor:
    """Tower 0's `target` computed from the tensors `copies` maps (ops copied in graph order)."""
    if target.name in copies:
      return copies[target.name]
    ops, pending = {}, [target.op]
    tables = tower_parts.tables(target.graph)
    while pending:
      op = pending.pop()
      if op.name in ops:
        continue
      ops[op.name] = op
      if op.name in tables:
        # A sync point's table (a batch norm's statistics): every shard's rows, as built. What
        # reads it (the whole batch's statistics, across workers an all-reduce) is the step's.
        continue
      pending.extend(t.op for t in op.inputs if t.name not in copies)
    order = self._graph_order(target.graph)
    shared = set(tables)   # a table and what is computed from it alone: the step's own
    for op in sorted(ops.values(), key=lambda op: order[op.name]):
      if op.name in shared or (any(t.op.name in shared for t in op.inputs)
                               and not any(t.name in copies for t in op.inputs)):
        shared.add(op.name)
        continue
      if not any(t.name in copies for t in op.inputs) and not (
          op.control_inputs and not op.op_def.is_stateful):
        continue   # independent of the shard (a variable's read, a constant): tower 0's
      # A constant made under tower 0's control dependencies (the shape a loss function
      # reshapes to, after its assert on the labels' shape) is copied without them: tower 0's
      # waits for tower 0's gated inputs, which wait for this pass (a cycle).
      self._check_stateless(op, target)
      copy = _copy_op(op, [copies.get(t.name, t) for t in op.inputs])
      for a, b in zip(op.outputs, copy.outputs):
        copies[a.name] = b
    return copies[target.name]

  def _graph_order(self, graph: tf.Graph) -> dict:
    if self._order is None or len(self._order) != len(graph.get_operations()):
      self._order = {op.name: j for j, op in enumerate(graph.get_operations())}
    return self._order

  def _check_stateless(self, op: tf.Operation, target: tf.Tensor) -> None:
    if not op.op_def.is_stateful or op.type in _READS:
      return
    grid = fixed_sums.active(op.graph)  # the grid's shards: one backward pass each
    raise ValueError(
        f'{"shards=S" if grid else "micro_batches > 1"} cannot train the loss '
        f'{self._loss.name} exactly: it mixes the batch\'s rows, so each '
        f'{"shard" if grid else "micro-batch"}\'s rows of {target.name} (read by the '
        f'mixing ops) are computed twice, once for the whole batch\'s head and once for '
        f'its own backward pass, but they are computed through the stateful op '
        f'{op.name} ({op.type}), which would give other values the second time (as '
        f'dropout\'s random mask does). Apply it after the mixing ops read those rows '
        f'(the head runs once, on the whole batch), use a stateless op with a fixed seed '
        f'(tf.random.stateless_uniform), or '
        + ('train without shards=S (towers alone are exact to float32 rounding).' if grid
           else 'use micro_batches=1 (towers alone are exact).'))


def _copy_op(op: tf.Operation, inputs: list) -> tf.Operation:
  """`op` again on `inputs` (its type and attributes; no device or colocation of its own)."""
  attrs = {k: v for k, v in op.node_def.attr.items() if not k.startswith('_')}
  return op.graph.create_op(op.type, list(inputs), [o.dtype for o in op.outputs],
                            attrs=attrs, name=op.name.split('/')[-1])
