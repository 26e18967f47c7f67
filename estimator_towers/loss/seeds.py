"""The seeds: per shard, the tensors its backward pass differentiates and their initial gradients.

`Seeds` is what every rule gives (`request_seeds` picks the rule). Here the
towers' two: the example-count rule (`weighted`: each shard's own loss, its
initial gradient times w_k) and a rebuilt loss on towers (`rebuilt`: one
backward pass through the whole batch's loss, or across workers each
shard's statistics seeded with the loss's coefficients dL/dS at the totals,
`shard_seeds`). The rule: a shard's seeds reach its own part of the
gradient only; what all shards share (the shard-independent terms) is
reached once, through `Seeds.stops`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.loss import statistics as statistics_lib
from estimator_towers.loss.loss_algebra import Expression


@dataclasses.dataclass
class Seeds:
  """Per shard, the tensors its backward pass differentiates and their initial gradients.

  Attributes:
    shards: per shard, (ys, grad_ys).
    loss: the whole batch's loss (rebuilt losses), else None.
    stops: with micro-batches or across workers, the totals `loss` is made
      from: a backward pass through `loss` stopped there adds what the
      shards' passes do not (the shard-independent terms). Empty otherwise.
    one_pass: the towers' backward passes must be one (`batch_mixing`: every
      tower's rows meet in a tensor computed on the whole batch), not copies
      of tower 0's.
  """
  shards: list
  loss: tf.Tensor | None = None
  stops: list = dataclasses.field(default_factory=list)
  one_pass: bool = False


def weighted(ys: Sequence[list], grad_ys: Sequence[list], weights: Sequence) -> Seeds:
  """The example-count rule: each shard's own ys, their initial gradients times w_k."""
  return Seeds([(list(y), [_weighted_grad_y(t, g, w) for t, g in zip(y, g_list)])
                for y, g_list, w in zip(ys, grad_ys, weights)])


def _weighted_grad_y(y: tf.Tensor, grad_y: Any, weight: Any) -> Any:
  """The initial gradient of a tower's y: weight * (grad_y or ones), on y's device."""
  if isinstance(weight, (int, float)) and weight == 1:
    return grad_y
  with tf.device(y.op.device):
    base = tf.ones_like(y) if grad_y is None else grad_y
    return base * tf.cast(weight, base.dtype)


def rebuilt(expression: Expression, find: Callable, nonempty: Sequence, grad_y: Any,
            across: Any = None, per_shard: bool = False) -> Seeds | None:
  """Towers: the whole batch's loss, one backward pass through it (None: a shard unmatched).

  Across workers (or with `per_shard`) each shard's backward pass must give
  its own part of the gradient only (the parts are summed over the tasks),
  so each shard's statistics are seeded with the loss's coefficients dL/dS at
  the (cluster's) totals, and `stops` holds the totals: the loss's backward
  pass stopped there is the shard-independent part, added once after the sum.
  """
  statistics = statistics_lib.shard_statistics(expression, find, len(nonempty))
  if statistics is None:
    return None
  whole, totals = statistics_lib.rebuilt_loss(expression, statistics, nonempty, across)
  if across is None and not per_shard:
    return Seeds([([whole], [grad_y])] + [([], [])] * (len(nonempty) - 1), whole)
  keys = [s.key for s in expression.statistics if s.trained]  # the others reach no variable
  with tf.device(None), tf.name_scope('whole_batch_coefficients'):
    found = tf.gradients(whole, [totals[key] for key in keys],
                         grad_ys=None if grad_y is None else [grad_y])
  coefficients = dict(zip(keys, found))
  shards = [shard_seeds(values, coefficients, shard_weight(ne, None))
            for values, ne in zip(statistics, nonempty)]
  return Seeds(shards, whole, list(totals.values()))


def shard_seeds(values: dict, coefficients: dict, weight: Any) -> tuple[list, list]:
  """A shard's statistics and their seeds: the loss's coefficient dL/dS times the shard's weight.

  Statistics whose coefficient is None (the loss does not depend on them) get none.
  """
  keys = [key for key, c in coefficients.items() if c is not None]
  return ([values[key] for key in keys],
          [coefficients[key] * tf.cast(weight, coefficients[key].dtype) for key in keys])


def shard_weight(nonempty: Any, grad_y: tf.Tensor | None) -> Any:
  """A shard's weight (0 for a shard empty at run time), times `grad_y` when given."""
  weight = 1.0 if nonempty is True else 0.0 if nonempty is False else tf.cast(nonempty, tf.float32)
  return weight if grad_y is None else grad_y * tf.cast(weight, grad_y.dtype)
