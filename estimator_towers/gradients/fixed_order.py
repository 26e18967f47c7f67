"""The fixed summation order of the shard grid: one binary tree over the S shards.

With `shards=S` (`inputs.grid`), a variable's whole-batch gradient is the sum
of its S per-shard gradients taken in one order on every topology: the
binary tree `base.fixed_sums.summation_tree(0, S)`.
Floating-point addition gives the same bits for the same operands in the same
order, so when each shard's gradient is computed by the same ops on the same
shapes, the sum is bit-identical on 1, 2 or 4 devices and with micro-batches.

Where the sum runs: a subtree whose shards are all on one device is summed on
that device (a device's own shards form a subtree: `inputs.grid` requires
it), so only one value per device leaves it. The levels of the tree above
the devices: where the variable's aggregation device is one of the towers'
(every placement on towers that include it: 'cpu' with /cpu:0 a tower, 'gpu',
'replicated', 'collective'), the upper tree is a tree reduction: a node is
added on the device of its subtree that holds the aggregation device, or else
of its left subtree, so each device sends its sum once ((N - 1) M bytes cross
for M bytes of gradient, half the ring all-reduce's 2 (N - 1) M) and a
level's additions run on several devices at once. Otherwise (the host CPU
aggregating for GPUs) by a fixed-order reduce-scatter: each device's sum is
cut into N chunks, chunk c's upper tree is added on device c (each device
sends (N - 1) / N of the gradient's bytes), and the chunks are gathered on
the aggregation device ((N - 1) / N more): the
ring all-reduce's bytes, never every device's whole gradient on one. Cutting
a sum into chunks does not change its bits: addition is elementwise.

A sparse gradient (IndexedSlices) is made dense per shard first, so that its
sum has one order too.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from estimator_towers.base import fixed_sums


class FixedOrder:
  """Sums per-shard values over the fixed tree.

  Args:
    num_shards: S.
    device_of: `device_of(k)`, the device shard k runs on.
  """

  def __init__(self, num_shards: int, device_of: Callable[[int], str]):
    self.num_shards = num_shards
    self._device_of = device_of
    self.tree = fixed_sums.summation_tree(0, num_shards)

  def _device(self, tree: int | tuple) -> str | None:
    """The one device a subtree's shards run on, or None if they span several."""
    devices = {self._device_of(k) for k in fixed_sums.leaves(tree)}
    return devices.pop() if len(devices) == 1 else None

  def local(self, parts: dict, on_node: Callable[[int, list], None] | None = None) -> tuple:
    """The tree with each one-device subtree summed on its device.

    Returns (upper, sums): `upper` the tree above the devices, whose leaves are
    keys of `sums` (the one-device subtrees' first shards) mapping to their
    sums. `on_node(last, values)`: called per one-device node with its last
    shard and its value (to order a micro-batch after it).
    """
    sums = {}

    def local_sum(tree):
      if isinstance(tree, int):
        value = parts.get(tree)
        if isinstance(value, tf.IndexedSlices):
          with tf.device(self._device_of(tree)):
            value = tf.convert_to_tensor(value)
      else:
        left, right = local_sum(tree[0]), local_sum(tree[1])
        device = self._device_of(fixed_sums.leaves(tree)[0])
        with tf.device(device), tf.name_scope('fixed_order_sum'):
          value = fixed_sums.add(left, right)
      if on_node is not None and value is not None:
        on_node(fixed_sums.leaves(tree)[-1], [value])
      return value

    def walk(tree):
      if self._device(tree) is not None:
        first = fixed_sums.leaves(tree)[0]
        sums[first] = local_sum(tree)
        return first
      return (walk(tree[0]), walk(tree[1]))

    return walk(self.tree), sums

  def total(self, parts: dict, aggregation_device: str | None,
            on_node: Callable[[int, list], None] | None = None) -> Any:
    """The sum of `parts` ({shard: value or None}) over the tree.

    Above the devices: a tree reduction where `aggregation_device` is one of
    theirs, otherwise a fixed-order reduce-scatter and a gather on it (see the
    module docstring).
    """
    upper, sums = self.local(parts, on_node)
    if isinstance(upper, int):
      return sums[upper]
    present = [v for v in sums.values() if v is not None]
    if not present:
      return None
    devices = [self._device_of(k) for k in sums]
    shape = present[0].shape
    size = shape.num_elements() if shape.is_fully_defined() else None
    if _canonical(aggregation_device) in map(_canonical, devices):
      return self._tree_reduce(upper, sums, _canonical(aggregation_device))
    if size is None or size < len(devices):
      with tf.device(aggregation_device), tf.name_scope('fixed_order_sum'):
        return fixed_sums.evaluate(upper, sums)
    chunks = _chunk_sizes(size, len(devices))
    cut = {}
    for k, value in sums.items():
      if value is not None:
        with tf.device(self._device_of(k)), tf.name_scope('fixed_order_scatter'):
          cut[k] = tf.split(tf.reshape(value, [-1]), chunks)
    reduced = []
    for c, device in enumerate(devices):
      with tf.device(device), tf.name_scope('fixed_order_reduce'):
        reduced.append(fixed_sums.evaluate(upper, {k: (None if k not in cut else cut[k][c])
                                         for k in sums}))
    with tf.device(aggregation_device), tf.name_scope('fixed_order_gather'):
      return tf.reshape(tf.concat(reduced, 0), shape)

  def _tree_reduce(self, upper: int | tuple, sums: dict, aggregation_device: str) -> Any:
    """The tree above the devices, each node added on the device of its subtree that
    holds `aggregation_device`, or else of its left subtree: every device sends its
    value once ((N - 1) M bytes, as sending all to the aggregation device) and the
    additions of one level run on several devices at once (log2 N of them on the
    aggregation device, not N - 1)."""

    def reduce(tree):
      if isinstance(tree, int):
        return sums.get(tree), _canonical(self._device_of(tree))
      (left, left_device), (right, right_device) = reduce(tree[0]), reduce(tree[1])
      device = right_device if right_device == aggregation_device else left_device
      with tf.device(device), tf.name_scope('fixed_order_sum'):
        return fixed_sums.add(left, right), device

    return reduce(upper)[0]


def _chunk_sizes(size: int, parts: int) -> list[int]:
  q, r = divmod(size, parts)
  return [q + (1 if c < r else 0) for c in range(parts)]


def _canonical(device: str | None) -> str:
  return tf.DeviceSpec.from_string(device or '').to_string()
