"""On the fixed shard grid, the towers' metric updates write a metric's state in shard order.

Rule: EVAL's metrics keep one state (tower 0's local variables) to which every
tower's update op adds its shard's part. Run side by side, the towers' additions
reach the state in the executor's order, and floating-point addition depends on
it. With `shards=S` (`base.fixed_sums.active`), each tower's writes of a
metric's state wait for the previous shard's, so the state adds the S shards'
parts in shard order, batch after batch: the same bits on one device, N devices
and micro-batches (a shard's part has the same shapes and ops everywhere).
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import updates

_MOST_OPS = 10_000  # an update's own ops before its writes: a handful


def writes_of(update: Any) -> list[tf.Operation]:
  """The state writes an update op (or tensor) runs: found upstream of it, not past them."""
  start = update.op if isinstance(update, tf.Tensor) else update
  seen, queue, writes = {start}, [start], []
  while queue and len(seen) < _MOST_OPS:
    op = queue.pop()
    if updates.is_update(op):
      writes.append(op)
      continue
    for parent in [t.op for t in op.inputs] + list(op.control_inputs):
      if parent not in seen:
        seen.add(parent)
        queue.append(parent)
  return sorted(writes, key=lambda op: op.name)


def in_shard_order(updates: Sequence[Any]) -> None:
  """Each shard's writes of a metric's state wait for the previous shard's (in place)."""
  previous: list[tf.Operation] = []
  for update in updates:
    writes = writes_of(update)
    if previous:
      for op in writes:
        interception.add_control_inputs(op, [p for p in previous if p not in op.control_inputs])
    previous = writes or previous
