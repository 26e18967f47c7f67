"""Joined tables: ops that stack one part per tower, and whose part is whose.

The rule. A sync point's table (`sync_points.join`) stacks every tower's
part of a statistic; the towers' results are computed from it. Read back
from one tower's loss, the other towers' parts are other shards' values, as
another shard's inputs are: a walk over one tower's graph (the row reader,
the loss algebra's searches) follows its own tower's part of a table only,
not the other towers' whole forward passes behind theirs. Which tower a walk
is of is told by the shard's input tensors it starts from (their names, as
`register_inputs` recorded them); a walk whose inputs are no one tower's
follows every part, as before there were tables.
"""

from __future__ import annotations

from typing import Iterable
import weakref

import tensorflow as tf

__all__ = ['add_table', 'others', 'register_inputs', 'tables']

# graph -> {table op name: {input index: tower}}
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# graph -> {shard input tensor name: tower}
_inputs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def add_table(op: tf.Operation, towers: Iterable[int]) -> None:
  """`op` stacks one part per tower: its input i is tower `towers[i]`'s."""
  _tables.setdefault(op.graph, {})[op.name] = dict(enumerate(towers))


def tables(graph: tf.Graph) -> frozenset:
  """The names of the tables built in `graph`."""
  return frozenset(_tables.get(graph, ()))


def register_inputs(graph: tf.Graph, tower: int, tensors: Iterable) -> None:
  """`tensors` are tower `tower`'s shard inputs."""
  names = _inputs.setdefault(graph, {})
  for t in tensors:
    if isinstance(t, tf.Tensor):
      names[t.name] = tower


def others(graph: tf.Graph, input_names: Iterable[str]):
  """`skip(op)`: the input indices of a table `op` that are other towers' parts than the one
  tower whose shard inputs are among `input_names` (the others there: values declared of a
  kind, rows cut on the whole batch); None where they are no one tower's, or there is no
  table."""
  found = _tables.get(graph)
  if not found:
    return None
  registered = _inputs.get(graph, {})
  towers = {registered[name] for name in input_names if name in registered}
  if len(towers) != 1:   # no one tower's inputs (others: declared kinds, cut rows)
    return None
  own = towers.pop()

  def skip(op: tf.Operation) -> frozenset:
    slots = found.get(op.name)
    if slots is None or own not in slots.values():
      return frozenset()
    return frozenset(i for i, tower in slots.items() if tower != own)
  return skip
