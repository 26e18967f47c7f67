"""Tower copies: the other towers' passes copied from tower 0's ops, not built again.

Every tower runs the same model_fn on a shard of the same shapes, so tower k
would build the very ops tower 0 built, with its own shard, device and random
seeds: its forward pass up to its first gradient request, and its part of the
backward pass. Building them runs the model_fn's Python and TensorFlow's
gradient code once more per tower (layer objects, variable lookups, op
construction: most of a towered graph's construction time); copying tower 0's
ops is one `import_graph_def` per tower and pass.

The rule: tower k's forward pass is tower 0's ops from the start of its
model_fn to its first gradient request, less the ops that created variables
(only tower 0 creates them) and the ops that update a variable with what only
feeds them (the other towers' updates are dropped anyway); its backward pass
is tower 0's (the gradient of tower 0's seeds alone) on tower k's forward
tensors and seeds. In a copy,
  - a tensor of tower 0 (its shard, its forward pass, its seeds) becomes tower
    k's; anything else from outside (variables, the global step) stays;
  - an op on tower 0's device goes to tower k's; one placed with a variable
    (or nowhere) stays; an op colocated with another follows the other's copy;
  - a random op seeded by the graph-level seed gets the next op seed, as
    building it would (op seeds follow creation order); an explicit op seed
    stays.

A tower is copied only where that is what building it would give: never when
its shard differs from tower 0's in static shape or dtype; tower 0 asked which
tower it is (`current_tower`, `loss_denominator`, `global_mean`); an op sits
in a v1 `tf.cond` or `tf.while_loop` or calls a function (TensorFlow's
gradient of a `tf.cond` rewrites the function in place); an op was put on another device by the
model_fn (a device scope); an op is a Placeholder or a stateful op with a
shared name (a table, a staging area); or an op uses a tensor of tower 0 that
has no counterpart in tower k. Then the tower is built as before (the reason
logged once).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf

from estimator_towers import cross_worker
from estimator_towers import interception
from estimator_towers import logs
from estimator_towers import placement as placement_lib
from estimator_towers import tower_context

Counterpart = Callable[[tf.Tensor], 'tf.Tensor | None']


@dataclasses.dataclass
class _Template:
  """Tower 0's ops to copy, prepared once.

  Attributes:
    ops: the ops copied, in creation order.
    node_defs: their NodeDefs, inputs named by tower 0's tensors.
    external: per input name of `node_defs` from outside the copied ops, the tensor.
    controls: per copied op's position, its control inputs from outside (a
      copy waits for their counterparts; for none if tower 0 made them for
      itself and they have none, as its dropped updates).
    devices: per copied op, 'tower' (tower k's device), 'colocated' (set by
      its colocation) or the device it keeps.
    colocated: per copied op's position, the ops it is colocated with.
    seeded: positions of the ops whose seeds are renewed per copy.
    made: the ops tower 0 made for itself so far (see `_made_by_primary`).
  """
  ops: list
  node_defs: list
  external: dict
  controls: dict
  devices: list
  colocated: dict
  seeded: set
  made: set


@dataclasses.dataclass
class Recording:
  """Ops made by tower 0 for a pass of its own (see `TowerCopies.recording`)."""
  first: int
  seeds: int
  ops: list = dataclasses.field(default_factory=list)
  template: _Template | str | None = None


class TowerCopies:
  """Copies tower 0's passes for the other towers of one TRAIN graph.

  Args:
    graph: the graph.
    device_of: `device_of(k)`, tower k's device.
    inputs_of: `inputs_of(k)`, tower k's shard tensors, flattened.
    primary: tower 0's index.
    creation_spans: (first, end) positions in the graph's op list of the ops
      made to create variables (shared by every tower).
    pinned: names of tower 0's ops a device scope of the model_fn placed.
    sync: the graph's sync points of batch statistics: its `copy_reason()`,
      `shared_ops()` (the joins, not copied) and `copied(primary, k,
      counterpart)` (tower k's copy joins them).
  """

  def __init__(self, graph: tf.Graph, device_of: Callable[[int], str],
               inputs_of: Callable[[int], list], primary: int,
               creation_spans: Sequence[tuple[int, int]], pinned: set, sync: Any):
    self._graph = graph
    self._pinned = pinned
    self._sync = sync
    self._device_of = device_of
    self._inputs_of = inputs_of
    self._primary = primary
    self._creation_spans = creation_spans
    self._start = self._reads = self._seeds = 0
    self._forward: _Template | str | None = None  # str: why it cannot be copied
    self._counterparts: dict[int, Counterpart] = {}
    self._prefixes: dict[int, str] = {}  # tower k's copies' name scope

  def primary_started(self) -> None:
    """Tower 0's build starts now."""
    self._start = self._graph.version
    self._reads = tower_context.reads()
    self._seeds = interception.op_seed_count(self._graph)

  # -- The forward pass -------------------------------------------------------

  def copy(self, k: int, segment: Sequence[tf.Operation]) -> Counterpart | None:
    """Tower k's forward pass as a copy of tower 0's `segment`; None if it cannot be.

    Returns `counterpart(tensor)`: tower k's tensor for a tensor of tower 0's
    segment or shard (None for any other).
    """
    if self._forward is None:
      shared = self._sync.shared_ops()
      if tower_context.reads() != self._reads:
        self._forward = ('the model_fn asked which tower it builds (current_tower, '
                         'loss_denominator or global_mean)')
      else:
        self._forward = self._sync.copy_reason() or self._template(
            _kept([op for op in segment if op not in shared]),
            range(self._seeds, interception.op_seed_count(self._graph)), shared)
    reason = self._forward if isinstance(self._forward, str) else self._shapes_differ(k)
    if reason:
      _log_once(reason)
      return None
    shard = dict(zip((t.ref() for t in self._inputs_of(self._primary)), self._inputs_of(k)))
    self._prefixes[k] = self._graph.unique_name(f'tower_{k}')
    counterpart = self._instance(k, self._forward, lambda t: shard.get(t.ref()),
                                 self._prefixes[k])
    if counterpart is None:
      return None

    def forward(tensor: tf.Tensor) -> tf.Tensor | None:
      if not isinstance(tensor, tf.Tensor):
        return None
      found = shard.get(tensor.ref())
      return counterpart(tensor) if found is None else found
    self._counterparts[k] = forward
    self._sync.copied(self._primary, k, forward)
    return forward

  def _shapes_differ(self, k: int) -> str | None:
    def spec(t):
      return t.dtype, (None if t.shape.rank is None else tuple(t.shape.as_list()))
    if [spec(t) for t in self._inputs_of(self._primary)] != [spec(t) for t in self._inputs_of(k)]:
      return ('the shards differ in static shape (the batch size is known and not a '
              'multiple of the device count)')
    return None

  # -- Backward passes --------------------------------------------------------

  def copied(self, k: int) -> bool:
    """True if tower k's forward pass is a copy."""
    return k in self._counterparts

  def any_copied(self) -> bool:
    return bool(self._counterparts)

  def counterpart(self, k: int, tensor: tf.Tensor) -> tf.Tensor | None:
    """Tower k's copy of tower 0's `tensor` (of its forward pass or shard), or None."""
    return self._counterparts[k](tensor) if k in self._counterparts else None

  @contextlib.contextmanager
  def recording(self) -> Iterator[Recording]:
    """Records the ops tower 0 makes meanwhile, to be copied by `copy_pass`."""
    recording = Recording(self._graph.version, interception.op_seed_count(self._graph))
    yield recording
    recording.ops = self._graph.get_operations()[recording.first:]

  def copy_pass(self, k: int, recording: Recording, seeds: dict) -> Counterpart | None:
    """Tower k's copy of a recorded pass of tower 0; None if it cannot be.

    `seeds` maps tower 0's initial gradients (by `ref()`) to tower k's; the
    rest of tower 0's tensors map to tower k's forward pass.
    """
    if recording.template is None:
      shared = self._sync.shared_ops()  # the joins of batch statistics' gradients
      recording.template = self._template(
          [op for op in recording.ops if op not in shared],
          range(recording.seeds, interception.op_seed_count(self._graph)), shared)
    if isinstance(recording.template, str) or k not in self._counterparts:
      return None
    forward, joined = self._counterparts[k], self._sync.joined_by(self._primary, k)

    def theirs(tensor):
      found = seeds.get(tensor.ref())
      found = joined.get(tensor.ref()) if found is None else found
      return forward(tensor) if found is None else found
    copied = self._instance(k, recording.template, theirs, self._prefixes[k])
    if copied is None:
      return None
    self._sync.copied_pass(self._primary, k, copied, set(recording.template.ops))
    made = recording.template.made

    def counterpart(tensor):  # a tensor shared by the towers is its own counterpart
      found = copied(tensor)
      found = theirs(tensor) if found is None else found
      return tensor if found is None and tensor.op not in made else found
    return counterpart

  # -- Templates and their instances ------------------------------------------

  def _template(self, ops: list, seed_range: range, shared: set = frozenset()
                ) -> _Template | str:
    members, made = set(ops), self._made_by_primary() - shared
    node_defs, external, controls, devices, colocated, seeded = [], {}, {}, [], {}, set()
    for op in ops:
      reason = _unsafe(op)
      if reason:
        return reason
      node_def = tf.compat.v1.NodeDef()
      node_def.CopyFrom(op.node_def)
      node_def.ClearField('device')
      del node_def.input[:]
      for tensor in op.inputs:
        name = f'{tensor.op.name}:{tensor.value_index}'
        if tensor.op not in members:
          external[name] = tensor
        node_def.input.append(name)
      for control in op.control_inputs:
        if control in members:
          node_def.input.append(f'^{control.name}')
        else:
          controls.setdefault(len(node_defs), []).append(control)
      targets = _colocation_targets(op)
      if targets:
        colocated[len(node_defs)] = targets
        devices.append('colocated')
      else:
        device = None if op.name in self._pinned else self._device_rule(op)
        if device is None:
          return (f'{op.name} was put on {op.device!r} by the model_fn (a device '
                  f'scope), not by the tower')
        devices.append(device)
      if _graph_seeded(op, self._graph, seed_range):
        seeded.add(len(node_defs))
      node_defs.append(node_def)
    return _Template(ops, node_defs, external, controls, devices, colocated, seeded, made)

  def _device_rule(self, op: tf.Operation) -> str | None:
    """'tower', a device op keeps on every tower, or None (placed by the model_fn)."""
    if not op.device:
      return ''
    for tensor in op.inputs:
      if tensor.dtype == tf.resource:
        return '' if op.type in placement_lib.CALL_OPS else op.device
    if _same_device(op.device, self._device_of(self._primary)):
      return 'tower'
    return None

  def _made_by_primary(self) -> set:
    """The ops made since tower 0 started, but for variables' creation (shared by all towers)."""
    ops = self._graph.get_operations()
    return {op for i, op in enumerate(ops[self._start:], self._start)
            if not any(first <= i < end for first, end in self._creation_spans)}

  def _instance(self, k: int, template: _Template, theirs: Counterpart, prefix: str
                ) -> Counterpart | None:
    """`template` imported for tower k under `prefix`, or None if an input has no counterpart.

    Tower 0's op names are unique, so its forward and backward ops can share
    one prefix per tower.
    """
    graph = self._graph
    device = tf.DeviceSpec.from_string(self._device_of(k)).to_string()
    renamed = {op.name: f'{prefix}/{op.name}' for op in template.ops}
    input_map = {}
    for name, tensor in template.external.items():
      found = theirs(tensor)
      if found is None and tensor.op in template.made:
        _log_once(f'{tensor.name} of the first tower has no counterpart in the others')
        return None
      input_map[name] = tensor if found is None else found
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    for i, (op, node_def) in enumerate(zip(template.ops, template.node_defs)):
      copied = graph_def.node.add()
      copied.CopyFrom(node_def)
      copied.name = renamed[op.name]
      for j, name in enumerate(copied.input):
        if name.startswith('^'):
          copied.input[j] = '^' + renamed[name[1:]]
        elif name not in input_map:
          source, index = name.rsplit(':', 1)
          copied.input[j] = f'{renamed[source]}:{index}'
      if i in template.colocated:
        names = []
        for target in template.colocated[i]:
          mapped = renamed.get(target.name) or _op_name(theirs, target)
          if mapped is None and target in template.made:
            _log_once(f'{op.name} is colocated with {target.name}, which has no '
                      f'counterpart in the other towers')
            return None
          names.append(f'loc:@{mapped or target.name}'.encode())
        copied.attr['_class'].list.s[:] = names
      elif template.devices[i] == 'tower':
        copied.device = device
      else:
        copied.device = template.devices[i]
      if i in template.seeded:
        copied.attr['seed'].i, copied.attr['seed2'].i = tf.compat.v1.random.get_seed(None)
    with graph.as_default(), graph.device(None):
      copies = interception.import_ops(graph_def, input_map,
                                       [renamed[op.name] for op in template.ops])
    for i, controls in template.controls.items():
      interception.add_control_inputs(copies[i], _their_controls(controls, template.made, theirs))
    by_op = dict(zip(template.ops, copies))

    def counterpart(tensor: tf.Tensor) -> tf.Tensor | None:
      op = by_op.get(tensor.op) if isinstance(tensor, tf.Tensor) else None
      return None if op is None else op.outputs[tensor.value_index]
    return counterpart


def map_gradient(counterpart: Counterpart, grad: object) -> object:
  """Tower k's counterpart of tower 0's gradient (a Tensor or IndexedSlices), or None."""
  if isinstance(grad, tf.IndexedSlices):
    parts = [counterpart(grad.values), counterpart(grad.indices),
             grad.dense_shape if grad.dense_shape is None else counterpart(grad.dense_shape)]
    if any(p is None for p in parts[:2]) or (grad.dense_shape is not None and parts[2] is None):
      return None
    return tf.IndexedSlices(*parts)
  return None if grad is None else counterpart(grad)


def _their_controls(controls: list, made: set, theirs: Counterpart) -> list:
  """Tower k's control inputs for tower 0's `controls` from outside a template.

  An op the towers share is the same op; one tower 0 made for itself is its
  counterpart, or none if it has none (an update of tower 0's, dropped).
  """
  found = []
  for control in controls:
    if control not in made:
      found.append(control)
    elif _op_name(theirs, control) is not None:
      found.append(control.graph.get_operation_by_name(_op_name(theirs, control)))
  return found


def _op_name(theirs: Counterpart, op: tf.Operation) -> str | None:
  """The name of tower k's counterpart of tower 0's `op` (through its first output)."""
  if not op.outputs:
    return None
  found = theirs(op.outputs[0])
  return None if found is None else found.op.name


def _colocation_targets(op: tf.Operation) -> list:
  try:
    groups = op.get_attr('_class')
  except ValueError:
    return []
  graph = op.graph
  return [graph.get_operation_by_name(g.decode()[len('loc:@'):]) for g in groups
          if g.startswith(b'loc:@')]


def _mutating(op: tf.Operation) -> bool:
  return op.type.startswith(cross_worker.MUTATING_PREFIXES)


def _kept(segment: Sequence[tf.Operation]) -> list:
  """The segment less its variable updates and the ops that only feed them.

  An op is dropped if it updates a variable, reads a dropped op's output, or
  has consumers in the segment that are all dropped.
  """
  members = set(segment)
  dropped = set()
  for op in segment:
    if _mutating(op) or any(t.op in dropped for t in op.inputs):
      dropped.add(op)
  for op in reversed(segment):
    if op in dropped:
      continue
    consumers = [c for t in op.outputs for c in t.consumers()]
    if consumers and all(c in members and c in dropped for c in consumers):
      dropped.add(op)
  return [op for op in segment if op not in dropped]


def _unsafe(op: tf.Operation) -> str | None:
  """Why `op` cannot be copied as it is, or None."""
  if interception.in_control_flow(op):
    return f'{op.name} is inside a v1 tf.cond or tf.while_loop'
  if interception.calls_function(op):
    return (f'{op.name} calls a function (a tf.cond, tf.while_loop or tf.function '
            f'in graph mode)')
  if op.type in ('Placeholder', 'PlaceholderV2'):
    return f'the model_fn made a placeholder ({op.name})'
  try:
    shared = op.get_attr('shared_name')
  except ValueError:
    shared = b''
  if shared:
    return f'{op.name} is a stateful op with a shared name'
  return None


def _same_device(a: str, b: str) -> bool:
  return tf.DeviceSpec.from_string(a or '') == tf.DeviceSpec.from_string(b or '')


def _graph_seeded(op: tf.Operation, graph: tf.Graph, seed_range: range) -> bool:
  """True if op's seeds came from the graph-level seed and the op seed counter."""
  if graph.seed is None:
    return False
  try:
    seed, seed2 = op.get_attr('seed'), op.get_attr('seed2')
  except ValueError:
    return False
  expected = tf.compat.v1.random.get_seed(0)[0]  # the graph-level seed, truncated
  if (seed, seed2) == (0, 2**31 - 1):  # get_seed's stand-in for (0, 0)
    seed2 = 0
  return seed == expected and seed2 in seed_range


def _log_once(reason: str) -> None:
  logs.info_once_per_graph(
      f'estimator_towers: the towers after the first are built by running the model_fn '
      f'again, not copied from the first one\'s ops, because {reason}. Building takes '
      f'longer; the step is the same.')
