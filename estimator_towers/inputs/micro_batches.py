"""Micro-batches: a shard is a (device, micro-batch) pair.

With `micro_batches=k`, each device's shard of the global batch (the split rule
of `sharding`) is split again, by the same rule, into k micro-batches. The
towered model_fn is built once per shard; shard s runs on device s // k as its
micro-batch s % k, so shards are numbered device-major, in input order.

Micro-batches of one device run one after another within the step's single
`session.run`: each micro-batch after the first reads its inputs through
`gate` Identity ops, and `order_after` gives those ops control inputs on the
previous micro-batch's last ops (in TRAIN the device's running sums of the
gradients, that micro-batch's included; its outputs in EVAL and PREDICT).
Every op of the micro-batch's forward pass that reads none of its inputs (a
variable read feeding a Tile to the batch's size, a random op of a static
shape) waits for the gates too (`gate_sources`). So a micro-batch's forward
pass, every branch of it, starts only once the previous one's backward pass
has finished, its gradients have been added to the sums and its activations
are released: at its peak a device holds one micro-batch's activations, the
gradient sums (one value per trained parameter) and the whole batch's input.
Waiting for the sums, not only for the gradients, also keeps grappler from
merging a device's chain of sums into one AddN at the end of the step, which
would keep every micro-batch's gradients alive until then. Devices still run
in parallel with each other.

Batch normalisation with `sync_batch_norm=False` normalises each
micro-batch by its own statistics (a shard's, as across devices), and its
moving averages are updated once per step from the primary shard
(micro-batch 0 of device 0). `make_plan` refuses `sync_batch_norm=True` with
micro-batches, and left unset a batch norm is an error naming that choice
(`sync_points.unsynced`): with micro-batches that run one after another,
whole-batch statistics would need a forward pass over every micro-batch
before any normalises. A loss rebuilt
from the batch's statistics (token counts, sums of weights: `loss_algebra`)
seeds each micro-batch's backward pass with its numerators' coefficients,
computed from normalisers known before the first forward pass (`seeds`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import tensorflow as tf

from estimator_towers.base import control_flow
from estimator_towers.base import interception
from estimator_towers.inputs import sharding



@dataclasses.dataclass(frozen=True)
class Layout:
  """How shards map to devices: shard s is micro-batch s % k of device s // k.

  Attributes:
    num_devices: the tower devices.
    micro_batches: k, micro-batches per device.
  """
  num_devices: int
  micro_batches: int

  @property
  def num_shards(self) -> int:
    return self.num_devices * self.micro_batches

  def device_of(self, shard: int) -> int:
    return shard // self.micro_batches

  def micro_batch_of(self, shard: int) -> int:
    return shard % self.micro_batches

  def previous(self, shard: int) -> int | None:
    """The shard that runs before `shard` on its device, or None for the first."""
    return None if self.micro_batch_of(shard) == 0 else shard - 1

  def split_batch(self, batch, num_towers: int) -> list:
    """Shard sizes of a global batch of `batch` rows over `num_towers` towers."""
    return self.sizes(sharding.shard_sizes(batch, num_towers))

  def sizes(self, device_sizes: Sequence) -> list:
    """Shard sizes: each device's size split into k by `sharding.shard_sizes`."""
    if self.micro_batches == 1:   # a device's shard is its one micro-batch: no ops
      return list(device_sizes)
    sizes = []
    for size in device_sizes:
      sizes.extend(sharding.shard_sizes(size, self.micro_batches))
    return sizes


def split_device_shard(shard: Any, sizes: Sequence, fill_empty: bool,
                       borrow_first: bool) -> list:
  """A device's shard (features or labels) split into its micro-batches.

  Args:
    shard: the device's shard (None stays None).
    sizes: the micro-batch sizes (ints, or int32 scalars at run time).
    fill_empty: for training: a micro-batch empty at run time borrows a row
      (weight 0), as `sharding.split` does.
    borrow_first: the first micro-batch may be empty at run time as well (a
      device after the first whose shard, already filled by
      `sharding.fill_empty`, has one borrowed row).
  """
  if shard is None:
    return [None] * len(sizes)
  if not (fill_empty and borrow_first) or isinstance(sizes[0], int):
    return sharding.split(shard, sizes, fill_empty=fill_empty)
  # Micro-batch 0 of an empty device shard takes the borrowed row, the others
  # (then empty too) borrow it again.
  first = tf.maximum(sizes[0], 1)
  return sharding.split(shard, [first] + list(sizes[1:]), fill_empty=True)


# Names of a composite tensor's gated components, as `row_dependence` reads inputs.
_COMPONENTS = {tf.SparseTensor: ('indices', 'values', 'dense_shape')}


def gate(structure: Any, device: str) -> tuple[Any, list[tf.Operation]]:
  """`structure` through Identity ops on `device`, and those ops (to be ordered).

  A SparseTensor's components are named indices, values and dense_shape, a
  RaggedTensor's Ragged..., so that the gated inputs read as the ungated ones.
  None (absent labels) stays None.
  """
  ops = []

  def through(leaf):
    if leaf is None:
      return None
    parts = tf.nest.flatten(leaf, expand_composites=True)
    ragged = isinstance(leaf, tf.RaggedTensor)
    names = _COMPONENTS.get(type(leaf)) or [
        f'Ragged{j}' if ragged else 'Identity' for j in range(len(parts))]
    gated = []
    for part, name in zip(parts, names):
      with tf.device(device):
        gated.append(tf.identity(part, name=name))
      ops.append(gated[-1].op)
    return tf.nest.pack_sequence_as(leaf, gated, expand_composites=True)

  return tf.nest.map_structure(through, structure), ops


def _ops(values: Any) -> list[tf.Operation]:
  """The ops of a nest of Tensors, composite tensors (IndexedSlices...) and ops."""
  ops = []
  for value in tf.nest.flatten(values, expand_composites=True):
    if isinstance(value, tf.Operation):
      ops.append(value)
    elif isinstance(value, tf.Tensor):
      ops.append(value.op)
  return ops


# Ops that allocate nothing a micro-batch holds: they need no gate.
_INERT = frozenset(['Const', 'VarHandleOp', 'VariableV2', 'Placeholder', 'NoOp'])


def gate_sources(ops: Sequence[tf.Operation], gates: Sequence[tf.Operation] | None) -> None:
  """Makes the ops of a micro-batch's forward pass that no gate reaches wait for a gate.

  `ops`: the ops made while the micro-batch's model_fn was built, in creation
  order; `gates`: its input gates (None for a device's first micro-batch). An
  op reached from a gate (by a data or control input) waits already; one
  that is not (it reads only variables, constants or tensors from outside the
  micro-batch) gets a control input on the first gate. Ops inside v1 control
  flow are left alone (no control edge may cross into them; they wait for
  the ops that enter it).
  """
  if not gates:
    return
  reached = set(gates)
  for op in ops:
    if (any(t.op in reached for t in op.inputs) or any(c in reached for c in op.control_inputs)):
      reached.add(op)
    elif op.type not in _INERT and not control_flow.in_control_flow(op):
      interception.add_control_inputs(op, [gates[0]])
      reached.add(op)


def order_after(gates: Sequence[tf.Operation], done: Any) -> None:
  """Makes the `gates` ops (a micro-batch's inputs) wait for the ops of `done`.

  The gates were made before `done` existed (the shards are split before any
  tower is built), so the control inputs are added afterwards.
  """
  controls = _ops(done)
  if not controls:
    return
  for op in gates:
    interception.add_control_inputs(op, controls)
