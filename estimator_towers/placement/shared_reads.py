"""One read of a variable per device and step.

Every use of a resource variable builds its own `ReadVariableOp`, which runs
where the variable lives; a tower on another device receives each read's
value on its own. A device that runs several shards (micro-batches, or a grid
with more shards than devices) so received every variable once per shard, and
a tower that uses a variable twice (tied weights) twice: (k - 1) M more bytes
per device and step than the one copy the step needs. Two reads of one handle
that wait for nothing may both run at the step's start, so serving the
consumers of both from one of them is one of the executions TensorFlow may
already choose: the values, and so the math and its bits, are unchanged, and
the device receives the variable once. A read that waits (a later
micro-batch's, behind its gate) joins them only if no write of its variable
is among what it waits for: it could then run first as well. Reads inside a
v1 `tf.cond` or loop, or on the variable's own device, are left as they are.
"""

from __future__ import annotations

from typing import Iterable

import tensorflow as tf

from estimator_towers.base import ancestry
from estimator_towers.base import control_flow
from estimator_towers.base import interception
from estimator_towers.base import updates
from estimator_towers.placement import devices as devices_lib

__all__ = ['share_reads']


def _writes(ops: list[tf.Operation]) -> dict[tf.Operation, set[tf.Operation]]:
  """{VarHandleOp: the ops among `ops` that write that variable}."""
  writes = {}
  for op in ops:
    if updates.is_update(op):
      for tensor in op.inputs:
        if tensor.dtype == tf.resource:
          writes.setdefault(updates.variable_op(tensor), set()).add(op)
          break
  return writes


def _receiving_device(read: tf.Operation) -> str | None:
  """The one device, not the variable's own, that every consumer of `read` is on, or None."""
  consumers = read.outputs[0].consumers()
  devices = {c.device for c in consumers}
  if not consumers or len(devices) != 1 or '' in devices:
    return None
  device = devices_lib.canonical(devices.pop())
  home = interception.resource_device(read.inputs[0])
  if home is None or devices_lib.canonical(home) == device:
    return None
  return device


def share_reads(ops: Iterable[tf.Operation]) -> int:
  """Makes the unordered reads of one variable handle received by one device one read.

  Args:
    ops: the operations to look at (a towered graph's, after its towers are built).

  Returns:
    The number of reads whose consumers now read another read of the same handle.
  """
  ops = list(ops)
  writes, waits = None, {}  # the writes are looked up only if a read waits for something
  groups = {}
  for op in ops:
    if op.type != 'ReadVariableOp' or control_flow.in_control_flow(op):
      continue
    device = _receiving_device(op)
    if device is None:
      continue
    if op.control_inputs:  # it may join only if no write of its variable comes before it
      gate = frozenset(op.control_inputs)
      if gate not in waits:
        waits[gate] = set().union(*(ancestry.ancestors(c) for c in gate))
      writes = _writes(ops) if writes is None else writes
      if waits[gate] & writes.get(updates.variable_op(op.inputs[0]), set()):
        continue
    groups.setdefault((op.inputs[0].ref(), device), []).append(op)
  shared = 0
  for reads in groups.values():
    free = [read for read in reads if not read.control_inputs]
    if not free:  # the one kept waits for nothing: no consumer can come to wait for itself
      continue
    kept = free[0].outputs[0]
    for read in reads:
      if read is free[0]:
        continue
      value = read.outputs[0]
      for consumer in list(value.consumers()):
        for index, tensor in enumerate(consumer.inputs):
          if tensor is value:
            interception.replace_input(consumer, index, kept)
      shared += 1
  return shared
