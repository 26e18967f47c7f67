"""Tower k's counterpart of a tensor of tower 0, found by the path between them.

Every tower runs the same model_fn, so the ops between a tower's loss and a
tensor it was computed from are the same on every tower: the path of op
input indices that leads from tower 0's loss to its tensor, followed from
tower k's loss (checking op types on the way), reaches tower k's tensor.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorflow as tf


def in_losses(losses: Sequence[tf.Tensor]) -> Callable:
  """`find(i, tensor)`: the tensor of losses[i]'s graph matching `tensor` of losses[0]'s.

  Found by following, from losses[i], the path of op inputs that leads from
  losses[0] to `tensor`, checking op types; None if there is none.
  """
  def find(i: int, tensor: tf.Tensor) -> tf.Tensor | None:
    route = path(losses[0], tensor)
    return None if route is None else follow(losses[i], losses[0], route)
  return find


def path(start: tf.Tensor, target: tf.Tensor, limit: int = 512) -> tuple[int, ...] | None:
  """Input indices leading from `start` back to `target`, breadth first."""
  if not isinstance(start, tf.Tensor) or not isinstance(target, tf.Tensor):
    return None
  queue = [(start, ())]
  seen = set()
  while queue and len(seen) < limit:
    tensor, route = queue.pop(0)
    if tensor.op is target.op and tensor.value_index == target.value_index:
      return route
    if tensor.op.name in seen:
      continue
    seen.add(tensor.op.name)
    queue.extend((t, route + (j,)) for j, t in enumerate(tensor.op.inputs))
  return None


def follow(start: tf.Tensor, reference: tf.Tensor, route: tuple[int, ...]) -> tf.Tensor | None:
  """The tensor reached from `start` along `route`, if its ops match the reference's."""
  tensor = start
  for j in route:
    if (tensor.op.type != reference.op.type
        or len(tensor.op.inputs) != len(reference.op.inputs)):
      return None
    tensor, reference = tensor.op.inputs[j], reference.op.inputs[j]
  if (tensor.op.type != reference.op.type or tensor.value_index != reference.value_index
      or tensor.dtype != reference.dtype):
    return None
  return tensor
