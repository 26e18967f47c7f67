"""Program order for a step's reads and writes of one variable.

A v1 graph runs every op as soon as its inputs are ready, so a read of a
variable and an update of it with no path between them race: which value the
read sees depends on the executor's scheduling. TensorFlow's own mini-batch
k-means (`tf.compat.v1.estimator.experimental.KMeans`) has such a race: it
gathers the old cluster counts for its learning rate 1 / (n + k) and, with no
edge between them, scatter-adds the new counts, so the learning rate is
sometimes 1 / (n + 2k): `bench/kmeans_race.py` saw 4 different results in 30
plain runs of 3 steps from one checkpoint with two inter-op threads, and 6
with one. `order_reads_before_writes` gives such reads the meaning of the
code that built them, as a `tf.function`'s automatic control dependencies
would: a read sees the value from before every update created after it.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from estimator_towers.base import ancestry
from estimator_towers.base import control_flow
from estimator_towers.base import interception
from estimator_towers.base import updates

# Ops that read a variable's value through its handle.
_READS = frozenset({'ReadVariableOp', 'ResourceGather', 'ResourceGatherNd'})


def _resource_accesses(ops: Sequence[tf.Operation]) -> dict:
  """{variable: [(position, op, is_write)]} for the top-level ops in `ops`."""
  accesses = {}
  for position, op in enumerate(ops):
    if control_flow.in_control_flow(op):
      continue  # Inside a v1 cond or loop: control edges cannot cross into it.
    is_write = updates.is_update(op)
    if not is_write and op.type not in _READS:
      continue
    for t in op.inputs:
      if t.dtype == tf.resource:
        accesses.setdefault(updates.variable_op(t).name, []).append((position, op, is_write))
        break
  return accesses


def order_reads_before_writes(ops: Sequence[tf.Operation]) -> int:
  """Makes each read of a variable run before the updates of it created later.

  Among `ops` (in creation order), for every read of a variable followed by a
  write of the same variable with no path between them, adds the control edge
  read -> write. Pairs where the write already leads to the read are left as
  they are (an edge would make a cycle), as are ops inside v1 control flow.

  Args:
    ops: the operations of one model_fn call, in creation order.

  Returns:
    The number of control edges added.
  """
  added = 0
  ancestors = {}
  for accesses in _resource_accesses(ops).values():
    for i, (_, read, read_is_write) in enumerate(accesses):
      if read_is_write:
        continue
      for _, write, is_write in accesses[i + 1:]:
        if not is_write:
          continue
        if write not in ancestors:
          ancestors[write] = ancestry.ancestors(write)
        if read in ancestors[write]:
          continue  # Already ordered.
        if read not in ancestors:
          ancestors[read] = ancestry.ancestors(read)
        if write in ancestors[read]:
          continue  # The read needs the write: keep it so.
        interception.add_control_inputs(write, [read])
        ancestors.clear()  # Paths changed.
        added += 1
  return added
