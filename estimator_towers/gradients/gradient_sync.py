"""The sync point of gradients: where the parts of a variable's gradient meet.

A variable's whole-batch gradient is built in parts: one per tower device (a
backward pass per shard, its micro-batches summed on the device), or one per
copy of the variable a tower read (one backward pass over every tower). The
parts meet here, in three steps, the same for every placement:

1. Between the devices of this task: the placement's all-reduce where it has
   one (`Placement.combine`, the 'collective' strategy), else a sum on the
   variable's aggregation device (its own, or the workers' CPU for a
   parameter server's, so that only the sum is sent).
2. Between the workers of a cluster (`cross_worker.CrossWorker`), when the
   global batch spans them: each task's part summed over the tasks.
3. The shard-independent part, once: the gradient of a rebuilt loss's terms
   that do not come through the shards' statistics (a regulariser; the same
   on every task), added after the sum so that it is counted once.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf


def add(grads: Sequence) -> Any:
  """Sum of one variable's gradient parts (Tensors or IndexedSlices; None skipped)."""
  parts = [g for g in grads if g is not None]
  if not parts:
    return None
  if len(parts) == 1:
    return parts[0]
  if all(isinstance(p, tf.IndexedSlices) for p in parts):
    return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                            tf.concat([p.indices for p in parts], 0),
                            parts[0].dense_shape)
  return tf.add_n([tf.convert_to_tensor(p) for p in parts])


class GradientSync:
  """Where a variable's gradient parts meet (see the module docstring).

  Args:
    aggregation_device: `aggregation_device(variable)`, the device on which
      its parts are summed.
    combine: `combine(parts)`, a variable's gradient from its parts, one per
      tower device in device order, or None where it cannot (the placement's
      all-reduce); None: parts are added.
    across: a `cross_worker.CrossWorker` when the global batch spans the
      workers of a cluster, else None.
  """

  def __init__(self, aggregation_device: Callable[[tf.Variable], str],
               combine: Callable[[list], Any] | None = None, across: Any = None):
    self.aggregation_device = aggregation_device
    self._combine = combine
    self.across = across

  def meet(self, x: Any, parts: Sequence) -> Any:
    """Step 1: x's gradient from this task's parts."""
    if sum(p is not None for p in parts) <= 1:
      return add(parts)
    if not isinstance(x, tf.Variable):
      with tf.device(None), tf.name_scope('combine_gradients'):
        return add(parts)
    reduced = self._combine(list(parts)) if self._combine else None
    if reduced is not None:
      return reduced
    with tf.device(self.aggregation_device(x)), tf.name_scope('combine_gradients'):
      return add(parts)

  def finish(self, xs: Sequence, answer: Sequence, direct: Sequence | None) -> list:
    """Steps 2 and 3: summed over the workers, then the shard-independent part `direct`."""
    answer = list(answer)
    if self.across is not None:
      chosen = [i for i, x in enumerate(xs)
                if isinstance(x, tf.Variable) and answer[i] is not None]
      for i, total in zip(chosen, self.across.sum([answer[i] for i in chosen])):
        answer[i] = total
    if direct is None:
      return answer
    for i, (x, own, extra) in enumerate(zip(xs, answer, direct)):
      if extra is None or own is None:
        answer[i] = own if extra is None else extra
        continue
      device = (self.across.device if self.across is not None else
                self.aggregation_device(x) if isinstance(x, tf.Variable) else None)
      with tf.device(device), tf.name_scope('shard_independent_gradient'):
        answer[i] = add([own, extra])
    return answer
