"""What an op waits for: its inputs' and control inputs' ops, transitively.

Stages that add an order between ops (a read before a variable's later
writes, the global step's writes after the step's read, a worker's copies
after the session start's broadcast) first ask whether one op already waits
for the other, or would wait for itself: one walk, the op itself included.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ['ancestors', 'ancestors_of_all']


def ancestors(op: tf.Operation) -> set[tf.Operation]:
  """`op` and every op it waits for, through inputs and control inputs."""
  return ancestors_of_all([op])


def ancestors_of_all(ops, within=None) -> set[tf.Operation]:
  """Every op of `ops` and every op they wait for: what a run of them runs. With `within`
  (a set of ops), the walk stays inside it: only its ops are found and followed."""
  seen, stack = set(), list(ops)
  while stack:
    node = stack.pop()
    if node not in seen and (within is None or node in within):
      seen.add(node)
      stack.extend([t.op for t in node.inputs] + list(node.control_inputs))
  return seen
