"""The sum across workers in the shard grid's fixed order: a reduce-scatter and an all-gather.

Rule: with the fixed shard grid (`shards=S`) on W workers, each worker holds an
aligned block of S / W shards (a power of two: `inputs.grid`), so its own sum
is one subtree of the grid's summation tree, and the tree above the workers is
`base.fixed_sums.summation_tree(0, W)` over their ranks. A collective
all-reduce adds in an order of its own (a ring starts each chunk at another
worker), so this sum is taken in three collectives instead, each of the
group's members the host CPU of one training task:

1. an all-to-all: the flat tensor is cut into W chunks, and chunk c of every
   worker goes to the group's member c;
2. member c adds its W pieces over the tree, in rank order (the members' ranks
   are all-gathered once per graph: the group's order is TensorFlow's);
3. an all-gather of the summed chunks, in the group's order: every worker gets
   the whole sum.

Each worker sends and receives (W - 1) / W of the tensor's bytes in 1 and in
3: the ring all-reduce's bound, never every worker's whole tensor. Cutting a
sum into chunks does not change its bits: addition is elementwise. The
collectives are TensorFlow's own (`tf.raw_ops`' V2 collectives), on a group
key of their own over the same tasks. Their ops are in one name scope
(`fixed_sums.ACROSS_WORKERS_SCOPE`), which the row reader reads as one op
across workers: a total of statistics.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from estimator_towers.base import fixed_sums


class FixedReduce:
  """Sums a flat tensor over the training tasks in the fixed tree's order.

  Args:
    size: W, the training tasks.
    rank: this task's rank (0 the chief).
    group_key: the collectives' group (this task's member: `device`).
    instance_key: `instance_key()`, the graph's next collective instance key
      (the same sequence on every task).
    device: this task's member device (its host CPU).
    timeout: the collectives' own timeout in seconds (0: none).
  """

  def __init__(self, size: int, rank: int, group_key: int, instance_key: Callable[[], int],
               device: str, timeout: Callable[[], float]):
    self.size = size
    self.rank = rank
    self.group_key = group_key
    self._instance_key = instance_key
    self.device = device
    self._timeout = timeout
    self._positions: tf.Tensor | None = None  # rank -> the member's place in the group

  def _collective(self, op, value: tf.Tensor) -> tf.Tensor:
    return op(input=value, group_size=self.size, group_key=self.group_key,
              instance_key=self._instance_key(), ordering_token=[],
              communication_hint='auto', timeout_seconds=float(self._timeout()))

  def _rank_positions(self) -> tf.Tensor:
    """Each rank's place among the group's members (gathered once per graph)."""
    if self._positions is None:
      with tf.name_scope('group_order'):
        ranks = self._collective(tf.raw_ops.CollectiveGatherV2, tf.constant([self.rank]))
        self._positions = tf.argsort(ranks)
    return self._positions

  def __call__(self, flat: tf.Tensor) -> tf.Tensor:
    """The sum over the tasks of `flat` (1-D, the same length on every task)."""
    with tf.device(self.device), tf.name_scope(fixed_sums.ACROSS_WORKERS_SCOPE):
      positions = self._rank_positions()
      length = tf.size(flat)
      chunk = (length + self.size - 1) // self.size
      rows = tf.reshape(tf.pad(flat, [[0, chunk * self.size - length]]), [self.size, -1])
      pieces = self._collective(tf.raw_ops.CollectiveAllToAllV2, rows)
      by_rank = tf.gather(pieces, positions)
      mine = fixed_sums.evaluate(fixed_sums.summation_tree(0, self.size),
                                 {r: by_rank[r] for r in range(self.size)})
      total = self._collective(tf.raw_ops.CollectiveGatherV2, mine)[:length]
      total.set_shape(flat.shape)
      return total
