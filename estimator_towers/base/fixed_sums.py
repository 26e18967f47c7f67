"""Fixed-order sums: the shard grid's one binary tree over the S shards.

With the fixed shard grid (`shards=S`), every sum across shards is taken in
one order on every topology: the binary tree `summation_tree(0, S)`, in which
a range of shards [lo, hi) of more than one splits at lo + the largest power
of two below hi - lo (an aligned block of a power-of-two size is a subtree:
a device's shards). Floating-point addition gives the same bits for the same
operands in the same order. `add` is that addition out of grappler's reach,
and `mark(graph)` / `active(graph)` say whether a graph is built on the grid
(the stages that sum across shards ask). Off the grid, `in_sequence` sums
values left to right, also out of grappler's reach (see there why).
"""

from __future__ import annotations

from typing import Any, Sequence
import weakref

import tensorflow as tf

# The name scope of a sum across workers in the fixed order (`cluster.fixed_reduce`): its
# ops (cutting, exchanging, adding, joining) are one op across workers to the row reader.
ACROSS_WORKERS_SCOPE = 'fixed_order_across_workers'

_GRIDS: 'weakref.WeakKeyDictionary[tf.Graph, int]' = weakref.WeakKeyDictionary()


def in_sum_across_workers(op: tf.Operation) -> bool:
  """Whether `op` is one of a fixed-order sum across workers' ops (its name scope's)."""
  return any(part == ACROSS_WORKERS_SCOPE or part.startswith(ACROSS_WORKERS_SCOPE + '_')
             for part in op.name.split('/')[:-1])


def mark(graph: tf.Graph, shards: int) -> None:
  """`graph` is built on a grid of `shards` shards."""
  _GRIDS[graph] = shards


def active(graph: tf.Graph | None = None) -> bool:
  """Whether `graph` (the default graph) is built on the fixed shard grid."""
  return (graph or tf.compat.v1.get_default_graph()) in _GRIDS


def summation_tree(lo: int, hi: int) -> int | tuple:
  """The fixed binary tree over shards [lo, hi): a leaf's index, or (left, right)."""
  if hi - lo == 1:
    return lo
  power = 1
  while power * 2 < hi - lo:
    power *= 2
  return (summation_tree(lo, lo + power), summation_tree(lo + power, hi))


def leaves(tree: int | tuple) -> list[int]:
  """The shards of a (sub)tree, in order."""
  return [tree] if isinstance(tree, int) else leaves(tree[0]) + leaves(tree[1])


def add(a: Any, b: Any) -> Any:
  """a + b, None being nothing to add (a shard whose value does not reach the sum).

  Not an Add op: grappler's arithmetic optimizer rewrites a tree of Adds on
  one device into one AddN, which sums in an order of its own, and it would
  do so on one device but not across several. A BiasAdd of a as one row and
  b as its bias is the same elementwise addition, out of its reach, at an
  Add's cost (the reshapes copy nothing).
  """
  if a is None or b is None:
    return b if a is None else a
  a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
  if not a.dtype.is_floating:  # integers: the same value in any order (no GPU BiasAdd)
    return a + b
  total = tf.nn.bias_add(tf.reshape(a, [1, -1]), tf.reshape(b, [-1]))
  return tf.reshape(total, a.shape if a.shape.is_fully_defined() else tf.shape(a))


def evaluate(tree: int | tuple, values: dict) -> Any:
  """The sum of `values` ({leaf: value or None}) over `tree`."""
  if isinstance(tree, int):
    return values.get(tree)
  return add(evaluate(tree[0], values), evaluate(tree[1], values))


def sum_in_order(values: Sequence) -> Any:
  """The sum of per-shard values (in shard order; None adds nothing) over the fixed tree."""
  return evaluate(summation_tree(0, len(values)), dict(enumerate(values)))


def in_sequence(values: Sequence[tf.Tensor]) -> tf.Tensor:
  """((v0 + v1) + v2) + ...: the sum of same-shaped tensors left to right, out of grappler's reach.

  Not an AddN: an AddN of three or more values on one device is what
  grappler's memory optimizer rewrites, when one of its inputs is alive at
  that device's peak of memory, into additions to a temporary variable in
  the order the values arrive (a sum without a fixed order), and having
  changed the graph, it simulates the whole graph's memory again (twice),
  the dearest part of the first step's graph optimisation of a large towered
  graph (BERT's pre-training model_fn on 8 towers: seconds). Nor a chain of
  Adds, which the arithmetic optimizer merges into such an AddN. One
  reshape per value and a BiasAdd per addition (`add`'s elementwise
  addition), the same float additions as the chain.
  """
  values = [tf.convert_to_tensor(v) for v in values]
  if len(values) == 1:
    return values[0]
  if not values[0].dtype.is_floating:  # integers add to the same value in any order, and
    return tf.add_n(values)            # BiasAdd has no integer kernel on GPUs
  first = values[0]
  flat = tf.constant([-1], tf.int32)
  total = tf.reshape(first, tf.constant([1, -1], tf.int32))
  for value in values[1:]:
    total = tf.nn.bias_add(total, tf.reshape(value, flat))
  return tf.reshape(total, first.shape if first.shape.is_fully_defined() else tf.shape(first))


def aggregation(graph: tf.Graph | None = None) -> dict:
  """tf.gradients' options for the grid: a tensor's gradients from several consumers
  summed in the graph's order (a pairwise running sum), not per device first."""
  if not active(graph):
    return {}
  return {'aggregation_method': tf.AggregationMethod.EXPERIMENTAL_TREE}
