"""Sync points: a value of every tower, joined once, in the graph.

A cross-shard value (a batch norm's statistics, the two per-channel sums of
its backward pass) needs every tower's part before any tower can go on. The
towers are built one after another, so the first tower to reach a sync point
cannot wait for the others' parts: it stacks its own part into every later
tower's slot of the table, and each later tower's part replaces its slot's
input when that tower is built. `finish()` (once the towers are built) gives a
slot no tower filled a placeholder, which fails the step with its name instead
of a wrong or hanging step. The join is ordinary graph edges between the
towers' devices: TensorFlow sends the parts to the first tower's device and
the result back.

`SyncPoint` is one statistic's joins: forward, and one per backward pass.
`tables(graph)` names the joins' tables built in a graph: an op that reads
one reads every tower's part (what a copy of a tower's ops must not copy).
Each table's parts are recorded by tower (`base.tower_parts`): a walk over
one tower's graph follows its own part only.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import tower_parts


def tables(graph: tf.Graph) -> frozenset:
  """The names of the joins' tables (every tower's part stacked) built in `graph`."""
  return tower_parts.tables(graph)


class Exchange:
  """One join of every tower's value.

  `join(k, value, fn)` is called by every tower k with its value; it returns
  fn(the towers' values stacked in tower order), built once, by the first
  tower to call, on its device (the hub), and shared by all (for batch
  statistics a few hundred bytes each way, no collective). With `per_tower`,
  fn returns one result per tower (in tower order) and each tower gets its own.
  """

  def __init__(self, towers: Sequence[int]):
    self._towers = list(towers)
    self._values: dict[int, tf.Tensor] = {}
    self._table: tf.Operation | None = None
    self._slots: dict[int, int] = {}  # tower: its input of the table, filled later
    self._result = None
    self._per_tower = False
    self.made: list[tf.Operation] = []  # the join's ops, shared

  def value(self, tower: int) -> tf.Tensor | None:
    """The value tower `tower` joined, or None."""
    return self._values.get(tower)

  def result(self, tower: int) -> Any:
    """What `join` returns to tower `tower` (None before the first join)."""
    if self._result is None or not self._per_tower:
      return self._result
    return self._result[self._towers.index(tower)]

  def join(self, tower: int, value: tf.Tensor, fn: Callable[[tf.Tensor], Any] | None,
           per_tower: bool = False) -> Any:
    self._values[tower] = value
    if self._table is not None:
      if tower in self._slots:
        interception.replace_input(self._table, self._slots[tower], value)
      return self.result(tower)
    graph = tf.compat.v1.get_default_graph()
    first = graph.version
    table = tf.stack([self._values.get(k, value) for k in self._towers])
    self._table = table.op
    tower_parts.add_table(table.op, self._towers)   # input i: tower self._towers[i]'s part
    self._slots = {k: i for i, k in enumerate(self._towers) if k not in self._values}
    self._result, self._per_tower = fn(table), per_tower
    self.made = graph.get_operations()[first:]
    return self.result(tower)

  def finish(self) -> None:
    """Gives each slot no tower filled a placeholder: a step that runs it fails with its name."""
    for k, i in self._slots.items():
      if k not in self._values and self._table.inputs[i].op.type != 'Placeholder':
        with self._table.graph.as_default(), tf.control_dependencies(None):
          missing = tf.compat.v1.placeholder(self._table.inputs[i].dtype,
                                             self._table.inputs[i].shape,
                                             name=f'tower_{k}_statistics')
        interception.replace_input(self._table, i, missing)


class SyncPoint:
  """One batch statistic's exchanges: forward, and one per backward pass built.

  Each backward pass built through the sync point (one per gradient request
  that reaches it) exchanges once; the towers' j-th passes share one.
  """

  def __init__(self, towers: Sequence[int]):
    self._towers = towers
    self.forward = Exchange(towers)
    self._backward: list[Exchange] = []
    self._backward_uses: dict[int, int] = {}  # per tower

  @property
  def backward_exchanges(self) -> list[Exchange]:
    return list(self._backward)

  def finish(self) -> None:
    for exchange in [self.forward] + self._backward:
      exchange.finish()

  def backward(self, tower: int) -> Exchange:
    j = self._backward_uses.get(tower, 0)
    self._backward_uses[tower] = j + 1
    while len(self._backward) <= j:
      self._backward.append(Exchange(self._towers))
    return self._backward[j]
