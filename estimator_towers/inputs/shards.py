"""The shards of one global batch: one per (device, micro-batch) pair, as the towers read them.

`make_shards` splits the global batch the input_fn gave (or takes the shards
`staged_input_fn` prefetched onto the devices) by the plan's layout: device
shards by `sharding`'s rule, each split again into its micro-batches
(`micro_batches`). Shards statically empty are not built at all; in
training, a shard whose size is known only at run time and turns out empty
borrows an example (weight 0), so that no tower runs on no rows. With
micro-batches, every built shard reads its inputs through gates, so that a
device's micro-batches run one after another (`order_next`). In EVAL and
PREDICT, a shard that may be empty at run time is gated instead
(`gate_empty`, `empty_shards`). Across workers, a worker whose input has
ended counts no examples in any shard (`live`).

A serving graph (an export) is told apart by its input: placeholders, not an
input_fn's iterator (`is_serving_input`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import tensorflow as tf

from estimator_towers.inputs import empty_shards
from estimator_towers.inputs import micro_batches as micro_batches_lib
from estimator_towers.inputs import sharding

ModeKeys = tf.estimator.ModeKeys


@dataclasses.dataclass
class Shards:
  """The shards of one global batch: one per (device, micro-batch) pair.

  Attributes:
    layout: which device and micro-batch each shard is.
    features: shard s's features.
    labels: shard s's labels (None entries when there are none).
    sizes: shard sizes (Python ints when the batch is static, else int32 scalars).
    batch: the global batch size.
    active: the shards that are built: those not statically empty (shard 0
      at least); the first is the primary.
    nonempty: per built shard, whether it has rows (a Python bool when
      static, else a bool Tensor).
    gates: per built shard (micro-batches), the Identity ops its inputs pass
      through, to be ordered after the previous micro-batch (or a head's gradient).
    ungated: per gated shard, its flattened inputs before the gates.
  """
  layout: micro_batches_lib.Layout
  features: list
  labels: list
  sizes: list
  batch: Any
  active: list
  nonempty: list
  gates: dict
  ungated: dict = dataclasses.field(default_factory=dict)

  def flat(self, k: int) -> list:
    """Shard k's tensors, flattened; absent labels (features-only input) have none."""
    return [t for t in tf.nest.flatten((self.features[k], self.labels[k]),
                                       expand_composites=True) if t is not None]

  def order_next(self, k: int, done: Any) -> None:
    """The next micro-batch of shard k's device waits for `done` (shard k's last ops)."""
    if k + 1 in self.gates and self.layout.previous(k + 1) == k:
      micro_batches_lib.order_after(self.gates[k + 1], done)

  def gate_empty(self) -> dict:
    """EVAL / PREDICT: a shard that may be empty at run time feeds its tower nothing.

    Returns {shard: its nonempty Tensor} for the gated shards (never the primary).
    """
    gated = {k: ne for k, ne in zip(self.active[1:], self.nonempty[1:])
             if not isinstance(ne, bool)}
    for k, ne in gated.items():
      self.features[k] = empty_shards.gate_inputs(self.features[k], ne)
      self.labels[k] = empty_shards.gate_inputs(self.labels[k], ne)
    return gated


def make_shards(features, labels, mode, tower_devices, staged,
                layout: micro_batches_lib.Layout, live: Any = None) -> Shards:
  """Splits the global batch (or the staged device shards) into the plan's shards.

  In training, a shard whose size is known only at run time and turns out
  empty borrows an example (weight 0), so that no tower runs on no rows.
  `live` (across workers): False when this worker's input has ended; then
  its batch is one zero example and every shard counts 0 examples.
  """
  num_devices = len(tower_devices)
  host = getattr(tf.nest.flatten(features, expand_composites=True)[0], 'device', '') or '/cpu:0'
  with tf.device(host), tf.name_scope('shard_inputs'):
    if staged is None:
      batch = sharding.batch_size(features, labels)
      sizes = layout.split_batch(batch, num_devices)
      shards = sharding.split((features, labels), sizes, fill_empty=mode == ModeKeys.TRAIN)
      feature_shards, label_shards = [list(s) for s in zip(*shards)]
    else:
      batch, sizes = staged.batch, list(staged.sizes)
      feature_shards, label_shards = list(staged.features), list(staged.labels)
  nonempty = [s > 0 for s in sizes]  # Python bools when the batch is static
  # Devices (or micro-batches) whose shard is statically empty are not built at all.
  active = [k for k in range(len(sizes)) if nonempty[k] is not False] or [0]
  if staged is not None and mode == ModeKeys.TRAIN:
    with tf.name_scope('shard_inputs'):
      for k in active[1:]:
        if not isinstance(sizes[k], int):
          with tf.device(tower_devices[k]):
            feature_shards[k] = sharding.fill_empty(feature_shards[k], sizes[k], feature_shards[0])
            label_shards[k] = sharding.fill_empty(label_shards[k], sizes[k], label_shards[0])
  shards = Shards(layout, feature_shards, label_shards, sizes, batch, active,
                  [nonempty[k] for k in active], {})
  if layout.micro_batches > 1:
    if staged is not None:
      _split_staged(shards, mode, tower_devices)
    _gate(shards, tower_devices)
  if live is not None:
    with tf.device(host), tf.name_scope('shard_inputs'):
      shards.batch = tf.where(live, shards.batch, 0)
      shards.sizes = [tf.where(live, s, 0) for s in shards.sizes]
      shards.nonempty = [tf.logical_and(live, ne) for ne in shards.nonempty]
  return shards


def _split_staged(shards: Shards, mode: str, tower_devices: Sequence[str]) -> None:
  """Staged device shards -> their micro-batches, split on each device."""
  layout, train = shards.layout, mode == ModeKeys.TRAIN
  features, labels, sizes = [], [], []
  with tf.name_scope('micro_batches'):
    for d, device in enumerate(tower_devices):
      with tf.device(device):
        micro_sizes = layout.sizes([shards.sizes[d]])
        borrow_first = d > 0 and d in shards.active
        features.extend(micro_batches_lib.split_device_shard(
            shards.features[d], micro_sizes, train, borrow_first))
        labels.extend(micro_batches_lib.split_device_shard(
            shards.labels[d], micro_sizes, train, borrow_first))
      sizes.extend(micro_sizes)
  nonempty = [s > 0 for s in sizes]
  shards.features, shards.labels, shards.sizes = features, labels, sizes
  shards.active = [k for k in range(len(sizes)) if nonempty[k] is not False] or [0]
  shards.nonempty = [nonempty[k] for k in shards.active]


def _gate(shards: Shards, tower_devices: Sequence[str]) -> None:
  """Every built micro-batch reads its inputs through gates (ordered once built)."""
  with tf.name_scope('micro_batch_gates'):
    for s in shards.active:
      device = tower_devices[shards.layout.device_of(s)]
      shards.ungated[s] = shards.flat(s)
      (shards.features[s], shards.labels[s]), shards.gates[s] = micro_batches_lib.gate(
          (shards.features[s], shards.labels[s]), device)


def is_serving_input(features: Any) -> bool:
  """True if the features are fed by placeholders (an export), not an input_fn."""
  pending = [t.op for t in tf.nest.flatten(features, expand_composites=True)
             if isinstance(t, tf.Tensor)]
  seen = set()
  while pending and len(seen) < 10000:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type == 'Placeholder':
      return True
    if op.type.startswith('IteratorGetNext') or op.type == 'Unstage':
      continue
    pending.extend(t.op for t in op.inputs)
  return False
