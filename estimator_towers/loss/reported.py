"""The loss Estimator reports: the whole batch's, from the towers' losses, by the loss's rule.

In TRAIN and EVAL the EstimatorSpec's loss is the single-device loss of the
global batch: rebuilt from the shards' statistics where the loss algebra
reads the loss as a function of them (`loss_algebra`: a token-weighted mean
is the sum of the numerators over the sum of the denominators, never a mean
of ratios), else the towers' losses weighted by the rule (a mean: each
tower by its share of the examples; a sum: 1). Across workers the loss is
the cluster's. In EVAL a shard that may be empty at run time adds nothing
(its statistics through `empty_shards.live`, 0 when it is empty). In TRAIN
a loss that mixes the batch's rows and was not itself what a gradient
request differentiated (one of several tensors of a request, or their sum)
is its head's value on the whole batch (`whole_batch_head`, forward only).
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from estimator_towers.heads import whole_batch_head
from estimator_towers.inputs import empty_shards
from estimator_towers.inputs import shards as shards_lib
from estimator_towers.loss import loss_algebra
from estimator_towers.loss import statistics as statistics_lib
from estimator_towers.rows import row_dependence
from estimator_towers.towers import counterparts
from estimator_towers.towers import specs as specs_lib


def reported_loss(built: Sequence, losses: Sequence, shards: shards_lib.Shards,
                  loss_reduction: str, graph: tf.Graph,
                  gated: dict | None = None, batch: Any = None, across: Any = None
                  ) -> tf.Tensor:
  """The whole batch's loss from the towers' `losses`, by `loss_algebra`'s rule.

  `built`: the losses as the towers built them (`losses` may be their gated
  stand-ins). `gated` (EVAL): shards that may be empty at run time; their
  statistics are taken through `empty_shards.live`, 0 when the shard is empty.
  `batch` and `across`: the cluster's batch size and all-reduces, across
  workers (the loss is then the cluster's).
  """
  batch = shards.batch if batch is None else batch
  find = counterparts.in_losses(built)

  def counterpart(i, tensor):
    found = find(i, tensor)
    k = shards.active[i]
    if found is None or not gated or k not in gated:
      return found
    return empty_shards.live(found, gated[k])

  if not gated:
    head = _head_value(built[0], shards, find, batch, across)
    if head is not None:
      return head
  with tf.name_scope('tower_loss'):
    analysis = loss_algebra.analyse(
        built[0], shards.flat(shards.active[0]), (), loss_reduction,
        lambda: statistics_lib.fallback_reduction(graph, built[0]),
        micro_batches=shards.layout.micro_batches > 1,
        static_count=statistics_lib.static_counts(
            graph, find, [shards.sizes[k] for k in shards.active]))
    if analysis.rule == 'rebuild':
      statistics = statistics_lib.shard_statistics(analysis.expression, counterpart, len(built))
      if statistics is not None:
        return statistics_lib.whole_batch_loss(analysis.expression, statistics,
                                               shards.nonempty, across)
    rule = analysis.rule if analysis.rule != 'rebuild' else 'mean'
    weights = statistics_lib.tower_weights(rule, shards.sizes, batch, shards.active)
    loss = specs_lib.weighted_sum(losses, weights, shards.nonempty)
    return loss if across is None else across.sum([loss])[0]


def whole_batch_value(values: Sequence[tf.Tensor], shards: shards_lib.Shards, graph: tf.Graph,
                      batch: Any = None, across: Any = None) -> tf.Tensor | None:
  """A scalar other than the loss (a summary's, a hook's) for the whole batch, from its
  counterpart on every built tower (`values`), by the loss algebra's rule (a mean, a sum,
  a ratio of sums); None where it does not read it (nothing is reported: the caller says
  so)."""
  batch = shards.batch if batch is None else batch
  inputs = shards.flat(shards.active[0])
  if row_dependence.classify([values[0]], inputs).mixing:
    return None
  find = counterparts.in_losses(values)
  analysis = loss_algebra.read_quietly(values[0], inputs, statistics_lib.static_counts(
      graph, find, [shards.sizes[k] for k in shards.active]))
  if analysis is None:
    return None
  if analysis.rule == 'const':
    return values[0]
  if analysis.rule == 'rebuild':
    statistics = statistics_lib.shard_statistics(analysis.expression, find, len(values))
    return None if statistics is None else statistics_lib.whole_batch_loss(
        analysis.expression, statistics, shards.nonempty, across)
  weights = statistics_lib.tower_weights(analysis.rule, shards.sizes, batch, shards.active)
  value = specs_lib.weighted_sum(values, weights, shards.nonempty)
  return value if across is None else across.sum([value])[0]


def _head_value(loss: tf.Tensor, shards: shards_lib.Shards, find: Any, batch: Any,
                across: Any) -> tf.Tensor | None:
  """A TRAIN loss that mixes the batch's rows: its head on the whole batch (None: it does not
  mix, or the head cannot be built, which the loss algebra's check then reports)."""
  if not isinstance(loss, tf.Tensor):
    return None
  found = row_dependence.classify([loss], shards.flat(shards.active[0]),
                                  loss_algebra.is_declared)
  if not found.mixing:
    return None
  sizes = [shards.sizes[k] for k in shards.active]
  built = whole_batch_head.build(found, loss, None, find, sizes, shards.nonempty, batch, across,
                                 record=False)   # forward only: the gradient's head is counted
  return None if isinstance(built, str) else built[0]
