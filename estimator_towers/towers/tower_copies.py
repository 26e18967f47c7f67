"""Tower copies: the other towers' passes copied from tower 0's ops, not built again.

Every tower runs the same model_fn on a shard of the same shapes, so tower k
would build the very ops tower 0 built, with its own shard, device and random
seeds: its forward pass up to its first gradient request, and its part of the
backward pass. Building them runs the model_fn's Python and TensorFlow's
gradient code once more per tower (layer objects, variable lookups, op
construction: most of a towered graph's construction time); copying tower 0's
ops is one `import_graph_def` per tower and pass (`op_templates`).

The rule: tower k's forward pass is tower 0's ops from the start of its
model_fn to its first gradient request, less the ops that created variables
(only tower 0 creates them), the ops that update a variable with what only
feeds them (the other towers' updates are dropped anyway), the sync points'
joins (shared: a copy joins them) and the shapes, constants and variable
reads nothing reads; its backward pass is the part of tower 0's (the
gradient of tower 0's seeds alone) that its gradients and stateful ops
need. A copy holds what its step runs, not what TensorFlow built on the
way. In a copy, tower 0's shard, forward
tensors, seeds and sync-point results become tower k's, anything else from
outside (variables, the global step) stays but for the handles of variables
tower k has its own copy of (`replicated`, `collective`), which become the
copy's; devices and op seeds follow `op_templates`' rule.

A tower is copied only where that is what building it would give: never when
its shard differs from tower 0's in static shape or dtype; tower 0 asked which
tower it is (`current_tower`, `loss_denominator`, `global_mean`); a sync point
cannot be shared this way (a synchronised `tf.nn.moments`, differentiated
through its join); an op cannot be imported again (`op_templates`: v1
control flow, a function call, a placeholder, a shared name, a device scope);
or an op uses a tensor of tower 0 that has no counterpart in tower k. Then the
tower is built as before (the reason logged once per graph). `replicate` does
not copy with micro-batches or across workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf

from estimator_towers.base import ancestry
from estimator_towers.base import control_flow
from estimator_towers.base import updates
from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.towers import op_templates
from estimator_towers.towers import tower_context

Counterpart = op_templates.Counterpart


@dataclasses.dataclass
class Recording:
  """Ops made by tower 0 for a pass of its own (see `TowerCopies.recording`)."""
  first: int
  seeds: int
  ops: list = dataclasses.field(default_factory=list)
  template: op_templates.Template | str | None = None


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
    replicas: `replicas(k)`, tower k's own copies of the variables (original,
      copy) under `replicated` and `collective` (made when asked), or [].
    own: `own(k)`, tensors made before the towers that tower k reads in place
      of tower 0's (the position of its shard in the global batch, which
      keyed random draws read), in the same order for every k.
  """

  def __init__(self, graph: tf.Graph, device_of: Callable[[int], str],
               inputs_of: Callable[[int], list], primary: int,
               creation_spans: Sequence[tuple[int, int]], pinned: set, sync: Any,
               replicas: Callable[[int], list], own: Callable[[int], list] = lambda k: []):
    self._graph = graph
    self._own = own
    self._replicas = replicas
    self._pinned = pinned
    self._sync = sync
    self._device_of = device_of
    self._inputs_of = inputs_of
    self._primary = primary
    self._creation_spans = creation_spans
    self._start = self._reads = self._seeds = 0
    self._forward: op_templates.Template | str | None = None  # str: why it cannot be copied
    self._counterparts: dict[int, Counterpart] = {}
    self._prefixes: dict[int, str] = {}  # tower k's copies' name scope

  @contextlib.contextmanager
  def primary(self) -> Iterator[None]:
    """Tower 0's build (and the other towers', from its gradient requests) in the block.

    Its functional loops output all their intermediates (`loop_copies`): their
    gradients then leave them as their copies were made.
    """
    self._start = self._graph.version
    self._reads = tower_context.reads()
    self._seeds = interception.op_seed_count(self._graph)
    with control_flow.loops_with_all_intermediates():
      yield

  # -- The forward pass -------------------------------------------------------

  def copy(self, k: int, segment: Sequence[tf.Operation], request: Sequence
           ) -> Counterpart | None:
    """Tower k's forward pass as a copy of tower 0's `segment`; None if it cannot be.

    `request`: the tensors of tower 0's gradient request (its ys, initial
    gradients and stops), which tower k's copy must have. Returns
    `counterpart(tensor)`: tower k's tensor for a tensor of tower 0's segment
    or shard (None for any other).
    """
    if self._forward is None:
      self._forward = self._forward_template(segment, request)
    reason = self._forward if isinstance(self._forward, str) else self._shapes_differ(k)
    if reason:
      _log_once(reason)
      return None
    shard = dict(zip((t.ref() for t in self._inputs_of(self._primary)), self._inputs_of(k)))
    shard.update((original.handle.ref(), copy.handle) for original, copy in self._replicas(k))
    shard.update((t.ref(), mine) for t, mine in zip(self._own(self._primary), self._own(k)))
    self._prefixes[k] = self._graph.unique_name(f'tower_{k}')
    counterpart = self._instance(k, self._forward, lambda t: shard.get(t.ref()))
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

  def _forward_template(self, segment: Sequence[tf.Operation], request: Sequence
                        ) -> op_templates.Template | str:
    if tower_context.reads() != self._reads:
      return ('the model_fn asked which tower it builds (current_tower, '
              'loss_denominator or global_mean)')
    shared = self._sync.shared_ops()
    kept = _unread(_kept([op for op in segment if op not in shared]), request,
                   self._made_by_primary())
    ops, inputs = set(kept), {t.ref() for t in self._inputs_of(self._primary)}
    for tensor in request:
      if isinstance(tensor, tf.Tensor) and tensor.op not in ops and tensor.ref() not in inputs:
        return (f'the gradient request\'s {tensor.name} is not a tensor the model_fn built '
                f'on its shard')
    return self._sync.copy_reason() or self._template(
        kept, range(self._seeds, interception.op_seed_count(self._graph)), shared)

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

  def adopt(self, k: int, pairs: dict) -> None:
    """Tower k's counterparts (`pairs`: tower 0's tensor ref -> tower k's) of tensors made later."""
    if k in self._counterparts:
      forward = self._counterparts[k]

      def counterpart(tensor):
        found = pairs.get(tensor.ref()) if isinstance(tensor, tf.Tensor) else None
        return forward(tensor) if found is None else found
      self._counterparts[k] = counterpart

  def matches(self, k: int, tensor: tf.Tensor, theirs: tf.Tensor, depth: int = 8) -> bool:
    """True if tower k's `theirs` is the counterpart of tower 0's `tensor`.

    Either its copy, or what the library built from both towers' tensors after
    the copy (a loss statistic of each shard): a stateless op of the same type
    and attributes on the counterparts of `tensor`'s op's inputs, within `depth`
    ops of tensors with counterparts (or shared). Such ops are adopted as
    counterparts (`adopt`).
    """
    if k not in self._counterparts:
      return False
    pairs: dict = {}
    if not _same(self._counterparts[k], tensor, theirs, pairs, depth):
      return False
    if pairs:
      self.adopt(k, pairs)
    return True

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

  def copy_pass(self, k: int, recording: Recording, seeds: dict, results: Sequence[tf.Tensor]
                ) -> Counterpart | None:
    """Tower k's copy of a recorded pass of tower 0; None if it cannot be.

    `seeds` maps tower 0's initial gradients (by `ref()`) to tower k's; the
    rest of tower 0's tensors map to tower k's forward pass. `results`: the
    tensors of the pass a copy must have (its gradients); the copy holds
    the recorded ops they need (`_needed`), not those only tower 0's own
    pass made on the way (gradients nobody asked for).
    """
    if recording.template is None:
      shared = self._sync.shared_ops()  # the joins of batch statistics' gradients
      needed = _needed(recording.ops, results)
      recording.template = self._template(
          [op for op in recording.ops if op not in shared and op in needed],
          range(recording.seeds, interception.op_seed_count(self._graph)), shared)
    if isinstance(recording.template, str) or k not in self._counterparts:
      return None
    forward, joined = self._counterparts[k], self._sync.joined_by(self._primary, k)

    def theirs(tensor):
      found = seeds.get(tensor.ref())
      found = joined.get(tensor.ref()) if found is None else found
      return forward(tensor) if found is None else found
    copied = self._instance(k, recording.template, theirs)
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
                ) -> op_templates.Template | str:
    return op_templates.make(ops, self._made_by_primary() - shared,
                             self._device_of(self._primary), self._pinned, seed_range)

  def _made_by_primary(self) -> set:
    """The ops made since tower 0 started, but for variables' creation (shared by all towers)."""
    ops = self._graph.get_operations()
    creating = set()
    for first, end in self._creation_spans:
      creating.update(range(max(first, self._start), end))
    return {op for i, op in enumerate(ops[self._start:], self._start) if i not in creating}

  def _instance(self, k: int, template: op_templates.Template, theirs: Counterpart
                ) -> Counterpart | None:
    """`template` imported for tower k under its prefix; None (logged) if it cannot be."""
    counterpart, reason = op_templates.instance(template, self._prefixes[k],
                                                self._device_of(k), theirs)
    if reason:
      _log_once(reason)
    return counterpart


def components(grad: object) -> list:
  """A gradient's tensors (an IndexedSlices' values, indices and dense shape)."""
  if isinstance(grad, tf.IndexedSlices):
    return [t for t in (grad.values, grad.indices, grad.dense_shape) if t is not None]
  return [] if grad is None else [grad]


def map_gradient(counterpart: Counterpart, grad: object) -> object:
  """Tower k's counterpart of tower 0's gradient (a Tensor or IndexedSlices), or None."""
  if isinstance(grad, tf.IndexedSlices):
    parts = [counterpart(grad.values), counterpart(grad.indices),
             grad.dense_shape if grad.dense_shape is None else counterpart(grad.dense_shape)]
    if any(p is None for p in parts[:2]) or (grad.dense_shape is not None and parts[2] is None):
      return None
    return tf.IndexedSlices(*parts)
  return None if grad is None else counterpart(grad)


def _same(counterpart: Counterpart, tensor: tf.Tensor, theirs: tf.Tensor, pairs: dict,
          depth: int) -> bool:
  """`tensor`'s counterpart is `theirs`: shared, known, or the same op on counterparts
  (added to `pairs`)."""
  if tensor is theirs:
    return counterpart(tensor) is None   # shared by the towers
  found = pairs.get(tensor.ref())
  found = counterpart(tensor) if found is None else found
  if found is not None or depth <= 0:
    return found is theirs
  op, mine = tensor.op, theirs.op
  if (tensor.value_index != theirs.value_index or op.type != mine.type or op.op_def.is_stateful
      or len(op.inputs) != len(mine.inputs) or len(op.outputs) != len(mine.outputs)
      or _attributes(op) != _attributes(mine)):
    return False
  if not all(_same(counterpart, a, b, pairs, depth - 1) for a, b in zip(op.inputs, mine.inputs)):
    return False
  pairs.update((a.ref(), b) for a, b in zip(op.outputs, mine.outputs))
  return True


def _attributes(op: tf.Operation) -> dict:
  """An op's attributes but its colocation (which follows its tower)."""
  return {key: value.SerializeToString(deterministic=True)
          for key, value in op.node_def.attr.items() if key != '_class'}


def _kept(segment: Sequence[tf.Operation]) -> list:
  """The segment less its variable updates and the ops that only feed them.

  An op is dropped if it updates a variable, reads a dropped op's output, or
  has consumers in the segment that are all dropped.
  """
  members = set(segment)
  dropped = set()
  for op in segment:
    if updates.is_update(op) or any(t.op in dropped for t in op.inputs):
      dropped.add(op)
  for op in reversed(segment):
    if op in dropped:
      continue
    consumers = [c for t in op.outputs for c in t.consumers()]
    if consumers and all(c in members and c in dropped for c in consumers):
      dropped.add(op)
  return [op for op in segment if op not in dropped]


# Ops whose output only describes a tensor, is a constant or reads a variable: computed for
# nothing if unread.
_DESCRIBING = frozenset({'Shape', 'ShapeN', 'Rank', 'Size', 'Const', 'ReadVariableOp'})


def _unread(segment: Sequence[tf.Operation], request: Sequence, made: set) -> list:
  """The segment less the ops of `_DESCRIBING` that no op tower 0 `made` reads (data or
  control) and the gradient `request` does not name: a loss's static shape checks, the
  value an update of a moving average returns, a variable's initial value (which only its
  creation, not copied, reads)."""
  read = {t.op for t in request if isinstance(t, tf.Tensor)}
  for op in made:
    read.update(t.op for t in op.inputs)
    read.update(op.control_inputs)
  return [op for op in segment if op.type not in _DESCRIBING or op in read]


def _needed(ops: Sequence[tf.Operation], results: Sequence[tf.Tensor]) -> set:
  """The ops of `ops` that `results` or a stateful op of `ops` reads, directly or not.

  The walk stays within `ops` (a sync point's join made among them leads on to
  the towers' parts it reads); data and control inputs alike.
  """
  roots = [t.op for t in results] + [op for op in ops if op.op_def.is_stateful]
  return ancestry.ancestors_of_all(roots, within=set(ops))


def _log_once(reason: str) -> None:
  logs.info_once_per_graph(
      f'estimator_towers: the towers after the first are built by running the model_fn '
      f'again, not copied from the first one\'s ops, because {reason}. Building takes '
      f'longer; the step is the same.')
