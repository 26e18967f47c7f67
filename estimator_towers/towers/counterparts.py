"""Tower k's counterpart of a tensor of tower 0, found by the path between them.

Every tower runs the same model_fn, so the ops between a tower's loss and a
tensor it was computed from are the same on every tower: the path of op
input indices that leads from tower 0's loss to its tensor, followed from
tower k's loss (checking op types on the way), reaches tower k's tensor
(for a shard's input itself, tower k's output of the split every tower
reads). A tensor no loss was computed from is matched by its position among the ops a
tower's build made (`Segments`).
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import tensorflow as tf


def in_losses(losses: Sequence[tf.Tensor]) -> Callable:
  """`find(i, tensor)`: the tensor of losses[i]'s graph matching `tensor` of losses[0]'s.

  Found by following, from losses[i], the path of op inputs that leads from
  losses[0] to `tensor`, checking op types; None if there is none.
  """
  routes, order = {}, {}

  def find(i: int, tensor: tf.Tensor) -> tf.Tensor | None:
    if tensor.name not in routes:
      if not order and isinstance(losses[0], tf.Tensor):   # the graph as the towers left it
        order.update((op.name, j) for j, op in enumerate(losses[0].graph.get_operations()))
      routes[tensor.name] = path(losses[0], tensor, order=order)
    route = routes[tensor.name]
    return None if route is None else follow(losses[i], losses[0], route)
  return find


def every_tower(losses: Sequence[tf.Tensor]) -> Callable:
  """`find(tensor)`: every tower's counterpart of tower 0's `tensor`, None if one is unknown."""
  find = in_losses(losses)

  def every(tensor: tf.Tensor) -> list | None:
    found = [tensor] + [find(i, tensor) for i in range(1, len(losses))]
    return None if any(t is None for t in found) else found
  return every


def path(start: tf.Tensor, target: tf.Tensor, limit: int = 1 << 16,
         order: dict | None = None) -> tuple[int, ...] | None:
  """Input indices leading from `start` back to `target`, breadth first.

  `order`: op name -> its place in the graph's creation order. An op made
  before `target`'s cannot be computed from it (an op's inputs exist before
  it): the walk does not enter it (a loss with weight decay over hundreds of
  variables reads each of them, far from the rows' path).
  """
  if not isinstance(start, tf.Tensor) or not isinstance(target, tf.Tensor):
    return None
  first = (order or {}).get(target.op.name)
  queue = collections.deque([(start, ())])
  seen = set()
  while queue and len(seen) < limit:
    tensor, route = queue.popleft()
    if tensor.op is target.op and tensor.value_index == target.value_index:
      return route
    if tensor.op.name in seen:
      continue
    seen.add(tensor.op.name)
    queue.extend((t, route + (j,)) for j, t in enumerate(tensor.op.inputs)
                 if first is None or order.get(t.op.name, first) >= first)
  return None


def follow(start: tf.Tensor, reference: tf.Tensor, route: tuple[int, ...]) -> tf.Tensor | None:
  """The tensor reached from `start` along `route`, if its ops match the reference's."""
  tensor = start
  for j in route:
    if (tensor.op.type != reference.op.type
        or len(tensor.op.inputs) != len(reference.op.inputs)):
      return None
    tensor, reference = tensor.op.inputs[j], reference.op.inputs[j]
  if tensor.op is reference.op and _shared_split(tensor.op):
    return tensor   # the split of the batch every tower reads: tower k's own output of it
  if (tensor.op.type != reference.op.type or tensor.value_index != reference.value_index
      or tensor.dtype != reference.dtype):
    return None
  return tensor


def _shared_split(op: tf.Operation) -> bool:
  """The split of the batch into the shards (one op, an output per shard: a static batch),
  or of the shards' sizes and bounds (`sharding`'s vectors, unstacked)."""
  return op.type in ('Split', 'SplitV', 'Unpack') and op.name.startswith('shard_inputs')


def along(ys: Sequence[tf.Tensor], ys_k: Sequence[tf.Tensor], tensor: tf.Tensor
          ) -> tf.Tensor | None:
  """Tower k's `tensor`, from which one of tower 0's `ys` was computed (tower k's: `ys_k`)."""
  for y, y_k in zip(ys, ys_k):
    route = path(y, tensor)
    if route is not None:
      found = follow(y_k, y, route)
      if found is not None:
        return found
  return None


class Segments:
  """The ops each tower's build made before its first whole-batch request.

  For a tensor that no request was derived from: the op made at the same
  position of tower k's build as `tensor`'s op in tower 0's (the ops that
  create variables left out, since only tower 0 creates them) is its
  counterpart, when every op up to it has the same type.

  Args:
    graph: the graph the towers are built in.
    creation_spans: (first, end) positions in the graph's op list of the ops
      made to create variables.
  """

  def __init__(self, graph: tf.Graph, creation_spans: Sequence[tuple[int, int]]):
    self._graph = graph
    self._creation_spans = creation_spans
    self._starts: dict[int, int] = {}
    self._ops: dict[int, list[tf.Operation]] = {}
    self._copied: dict[int, Callable] = {}  # tower -> its counterpart of a tensor

  def start(self, tower: int) -> None:
    """Tower `tower`'s build begins now."""
    self._starts[tower] = self._graph.version

  def close(self, tower: int) -> None:
    """Tower `tower`'s build has reached its first whole-batch request."""
    start = self._starts[tower]
    skip = set()
    for first, end in self._creation_spans:
      if end > start:
        skip.update(range(max(first, start) - start, end - start))
    self._ops[tower] = [op for i, op in enumerate(self._graph.get_operations()[start:])
                        if i not in skip]

  def ops(self, tower: int) -> list[tf.Operation]:
    """Tower `tower`'s segment (once closed)."""
    return self._ops[tower]

  def copied(self, tower: int, counterpart: Callable | None) -> None:
    """Tower `tower`'s segment is a copy of the primary's; `counterpart` maps it."""
    if counterpart is None:
      self._copied.pop(tower, None)
    else:
      self._copied[tower] = counterpart

  def match(self, primary: int, tower: int, tensor: tf.Tensor) -> tf.Tensor | None:
    """Tower `tower`'s op at the position of `tensor`'s op in `primary`'s segment."""
    if tower in self._copied:
      return self._copied[tower](tensor)
    mine, theirs = self._ops.get(primary), self._ops.get(tower)
    if not mine or theirs is None:
      return None
    position = {id(op): i for i, op in enumerate(mine)}.get(id(tensor.op))
    if position is None or position >= len(theirs):
      return None
    if any(a.type != b.type for a, b in zip(mine[:position + 1], theirs)):
      return None
    return theirs[position].outputs[tensor.value_index]
