"""Building one tower: the user's model_fn on its shard, on its device, with the shared variables.

A tower is one run of the model_fn on one shard (`inputs.shards`), under the
shard's device (`placement`), with tower 0's variables (`sharing`: tower 0
creates them, every later tower gets them back), inside `tower_context` so
that the model_fn can ask which tower it is. Collections a tower fills with
its own copies (UPDATE_OPS, LOSSES, SUMMARIES) hold only what that tower
adds while it is built; tower 0's are kept afterwards, so side effects and
summaries come from tower 0 alone. A tower built only for its forward pass
is stopped at its gradient request by `TowerStop`, and its control edges to
its own variable updates are cut (`detach_side_effects`): an empty shard
must not write NaN statistics. While a tower is built, `tf.shape` and
`tf.size` of its tensors are Shape and Size ops even for a static shape
(`interception.shape_reads_kept`), so the graph tells the shard's size from
a constant.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import updates
from estimator_towers.inputs import micro_batches as micro_batches_lib
from estimator_towers.inputs import shards as shards_lib
from estimator_towers.placement import strategies as placement_lib
from estimator_towers.towers import sharing
from estimator_towers.towers import tower_context

GraphKeys = tf.compat.v1.GraphKeys

# Collections a tower fills with its own copies; each tower sees only its own
# while it is built, and tower 0's are kept afterwards.
PER_TOWER_COLLECTIONS = (GraphKeys.UPDATE_OPS, GraphKeys.LOSSES, GraphKeys.SUMMARIES)


class TowerStop(BaseException):
  """Raised inside a non-primary tower at the request it was built for.

  A BaseException, so that a model_fn's own `except Exception` cannot swallow
  it.
  """


@contextlib.contextmanager
def tower_collections(base: dict, keep: dict | None = None) -> Any:
  """While a tower is built, per-tower collections hold only what it adds.

  They start as `base` (their state before any tower); what the tower adds is
  stored in `keep` if given. Afterwards they are as they were before, so a
  tower built in the middle of tower 0 leaves tower 0's view untouched.
  """
  graph = tf.compat.v1.get_default_graph()
  before = {key: graph.get_collection(key) for key in PER_TOWER_COLLECTIONS}
  for key in PER_TOWER_COLLECTIONS:
    graph.get_collection_ref(key)[:] = base[key]
  try:
    yield
  finally:
    for key in PER_TOWER_COLLECTIONS:
      if keep is not None:
        keep[key] = graph.get_collection(key)[len(base[key]):]
      graph.get_collection_ref(key)[:] = before[key]


def detach_side_effects(ops: Sequence[tf.Operation]) -> None:
  """Drops control edges from a tower's ops to its own variable updates.

  A model_fn often computes its loss or gradients under
  `control_dependencies(update_ops)`; in towers other than tower 0 that would
  run their batch-norm updates as well (and an empty shard would write NaN
  statistics). Data edges are untouched.
  """
  mutating = set()
  for op in ops:
    if (updates.is_update(op)
        or any(t.op in mutating for t in op.inputs)
        or any(c in mutating for c in op.control_inputs)):
      mutating.add(op)
  for op in ops:
    controls = op.control_inputs
    keep = [c for c in controls if c not in mutating]
    if len(keep) != len(controls):
      op._remove_all_control_inputs()  # pylint: disable=protected-access
      op._add_control_inputs(keep)  # pylint: disable=protected-access


class TowerBuilder:
  """Builds one tower: the model_fn on its shard, on its device, with shared variables.

  Args:
    run: `run(features, labels, mode)` calls the user's model_fn.
    mode: the Estimator mode.
    shards: the shards of the global batch.
    placement: the variable placement over the tower devices.
  """

  def __init__(self, run: Callable, mode: str, shards: shards_lib.Shards,
               placement: placement_lib.Placement):
    self.run = run
    self.mode = mode
    self.shards = shards
    self.placement = placement
    self.graph = tf.compat.v1.get_default_graph()
    self.tower_devices = placement.tower_devices
    self.variable_sharing = sharing.VariableSharing(placement.variable_device,
                                                    placement.replica_device)
    # Per-tower collections as they were before any tower was built.
    self.base = {key: self.graph.get_collection(key) for key in PER_TOWER_COLLECTIONS}
    self.root_scope = tf.compat.v1.get_variable_scope()
    self.devices = interception.device_stack(self.graph)
    self.pinned: set[str] = set()  # the primary's ops placed by a device scope of the model_fn
    interception.reset_loss_reduction(self.graph)

  @property
  def primary(self) -> int:
    return self.shards.active[0]

  def device_of(self, k: int) -> str:
    """Shard k's device."""
    return self.tower_devices[self.shards.layout.device_of(k)]

  def build(self, k: int, reuse: bool, **reuse_args) -> Any:
    """Shard k's model_fn on its device; None if it stopped at a gradient request.

    Variables are per device (device d's shards use its copies, if any). A
    micro-batch's ops that read none of its inputs wait for its gates too.
    Shape reads of the shard are ops, not constants, even where its shape is
    static (`interception.shape_reads_kept`): a head on the whole batch reads
    the whole batch's size.
    """
    d = self.shards.layout.device_of(k)
    device = self.tower_devices[d]
    reuse_args.setdefault('copies', d != self.shards.layout.device_of(self.primary))
    pinned, first_op = self.pinned if k == self.primary else None, len(self.graph.get_operations())
    # A variable's initializer is tower 0's: an init_from_checkpoint again in a later tower
    # (whose ops may wait for its micro-batch's input) must not replace it.
    initializers = interception.initializers(self.graph) if k != self.primary else None
    with tf.compat.v1.device(placement_lib.tower_device(device, pinned)), (
        self.variable_sharing.reusing(d, self.root_scope, **reuse_args) if reuse
        else self.variable_sharing.creating()), tower_context.entering(
            k, len(self.shards.sizes), device, primary=k == self.primary), \
        interception.shape_reads_kept():
      try:
        spec = self.run(self.shards.features[k], self.shards.labels[k], self.mode)
      except TowerStop:  # at the gradient request it was built for
        spec = None
      finally:
        if initializers:
          interception.set_initializers(initializers)
    if self.shards.layout.previous(k) is not None:  # a device's first: not ordered after one
      micro_batches_lib.gate_sources(self.graph.get_operations()[first_op:], self.shards.gates[k])
    return spec

  def build_each(self) -> list:
    """EVAL / PREDICT: every built shard's whole model_fn, in `tower_k/` name scopes.

    Tower 0 (the primary) keeps the plain names, and its collections are kept.
    """
    tower_specs, kept = [], {}
    for k in self.shards.active:
      tower_kept = {}
      with tf.name_scope(f'tower_{k}') if k != self.primary else contextlib.nullcontext(), \
          tower_collections(self.base, tower_kept):
        tower_specs.append(self.build(k, reuse=k != self.primary))
      kept = kept or tower_kept
    self.keep_collections(kept)
    return tower_specs

  def keep_collections(self, kept: dict) -> None:
    """Per-tower collections: as before the towers, plus the primary's additions."""
    for key in PER_TOWER_COLLECTIONS:
      self.graph.get_collection_ref(key)[:] = self.base[key] + kept.get(key, [])
