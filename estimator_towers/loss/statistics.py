"""The shards' statistics and their totals: how the shards' parts add up to the batch's.

A rebuilt loss is f on the sums of the shards' statistics: each shard's
values of the loss's statistics (`shard_statistics`), summed over the shards
whose shard is not empty (`masked_sum`, `whole_batch_totals`; across workers
the cluster's sums), and f on them (`whole_batch_loss`). The example-count
rule weighs each tower's own loss instead (`tower_weights`), by the
reduction a TensorFlow loss function recorded or the loss's own reduce op
(`fallback_reduction`); `static_counts` tells a shard's static element count
from a hyper-parameter. The rule: values and totals only; what each
backward pass starts from is `seeds`'.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.base import fixed_sums
from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.loss.loss_algebra import Expression

# Reductions recorded by tf.compat.v1.losses (Reduction.SUM) and Keras
# (ReductionV2.SUM) that sum over the batch; every other one averages.
SUM_REDUCTIONS = ('weighted_sum', 'sum')


def static_counts(graph: tf.Graph, find: Callable | None, sizes: Sequence) -> Callable:
  """`is_count(d)`: is tower 0's constant divisor `d` its shard's static element count?

  With a static batch a `tf.size` or `tf.ones_like` of a shard tensor is a
  constant. It is a count if the shards' values differ; a hyper-parameter if
  they are equal while the shards' sizes differ; when every shard has the
  same size the two look alike, and the reduction a TensorFlow loss function
  recorded decides (a mean divides by a count), else a warning says which
  was assumed (a hyper-parameter).
  """
  def is_count(d: tf.Tensor) -> bool:
    if find is None or len(sizes) < 2 or not all(isinstance(s, int) for s in sizes):
      return False
    mine = _constants(d)
    theirs = [find(i, d) for i in range(1, len(sizes))]
    if mine is None or any(t is None for t in theirs):
      return False
    for t in theirs:
      other = _constants(t)
      if other is None or len(other) != len(mine):
        return False
      if any(a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(mine, other)):
        return True   # made from the shard's static shape
    if len(set(sizes)) > 1:
      return False
    recorded = interception.last_loss_reduction(graph)
    if recorded is not None:
      return str(recorded) not in SUM_REDUCTIONS
    logs.warning_once(
        f'estimator_towers: the loss divides by {d.name}, a constant the '
        f'same on every shard, which is either a '
        f'hyper-parameter or the shard\'s static size (a tf.size of a static '
        f'shape); it is taken as a hyper-parameter (the whole batch\'s loss '
        f'adds the shards\' sums over it). If it is the element count, '
        f'pass loss_reduction=\'mean\'.', key=f'static_count:{d.name}')
    return False
  return is_count


def _constants(t: tf.Tensor, limit: int = 256) -> list | None:
  """The values of the Const ops `t` is computed from, in input order (None: too many)."""
  found, pending, seen = [], [t.op], set()
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if len(seen) > limit:
      return None
    if op.type == 'Const':
      found.append(np.asarray(tf.get_static_value(op.outputs[0])))
    pending.extend(reversed([i.op for i in op.inputs]))
  return found


def fallback_reduction(graph: tf.Graph, loss: Any) -> str:
  """The example-count rule's reduction for a loss the algebra does not rebuild.

  The reduction the model_fn's last TensorFlow loss function recorded on the
  graph (v1 canned heads sum; tf.compat.v1.losses and Keras losses otherwise
  average), as TensorFlow's distribution strategies read it; else, if `loss`
  is a `tf.reduce_sum` or `tf.reduce_mean` over the batch axis, that; else a
  mean.
  """
  recorded = interception.last_loss_reduction(graph)
  if recorded is not None:
    return 'sum' if str(recorded) in SUM_REDUCTIONS else 'mean'
  return _reduction_of(loss) or 'mean'


def tower_weights(reduction: str, sizes: Sequence, batch: Any, towers: Sequence[int]) -> list:
  """Each built tower's weight in the example-count rule 'mean' or 'sum'."""
  if reduction == 'sum':  # a tower whose shard is empty at run time adds nothing
    return [1.0 if isinstance(sizes[k], int) else
            tf.cast(sizes[k] > 0, tf.float32) for k in towers]
  if isinstance(batch, int):
    return [sizes[k] / max(batch, 1) for k in towers]
  with tf.device(None), tf.name_scope('tower_weights'):
    total = tf.cast(tf.maximum(batch, 1), tf.float32)
    return [tf.cast(sizes[k], tf.float32) / total for k in towers]


def _reduction_of(loss: Any) -> str | None:
  """'sum' or 'mean' if `loss` is a tf.reduce_sum / tf.reduce_mean over axis 0."""
  if not isinstance(loss, tf.Tensor):
    return None
  op = loss.op
  while op.type in ('Identity', 'Cast') and op.inputs:
    op = op.inputs[0].op
  if op.type not in ('Sum', 'Mean') or len(op.inputs) != 2 or op.inputs[0].shape.rank == 0:
    return None
  axes = tf.get_static_value(op.inputs[1])
  rank = op.inputs[0].shape.rank
  if axes is None:  # reduce over every axis (axis=None) makes a Range of them
    if op.inputs[1].op.type != 'Range':
      return None
  elif rank is None or 0 not in [int(a) % rank for a in np.ravel(axes)]:
    return None
  return 'sum' if op.type == 'Sum' else 'mean'


def masked_sum(values: Sequence[tf.Tensor], nonempty: Sequence) -> tf.Tensor:
  """sum_k values[k] over the shards whose shard is not empty, in shard order (on the
  fixed shard grid, in its fixed tree: `fixed_sums`)."""
  terms = []
  for t, ne in zip(values, nonempty):
    if ne is False:
      continue
    terms.append(t if ne is True else tf.where(ne, t, tf.zeros_like(t)))
  if terms and fixed_sums.active():
    return fixed_sums.sum_in_order(terms)
  return fixed_sums.in_sequence(terms) if terms else tf.zeros_like(values[0])


def shard_statistics(expression: Expression, find: Callable, num_shards: int
                     ) -> list | None:
  """Per shard, {key: statistic}; `find(i, t)` is shard i's t, None if unknown."""
  found = []
  for i in range(num_shards):
    values = {}
    for statistic in expression.statistics:
      source = statistic.source if i == 0 else find(i, statistic.source)
      if source is None:
        report_unmatched(expression.loss, statistic.source, i)
        return None
      values[statistic.key] = statistic.of(source)
    found.append(values)
  return found


def report_unmatched(loss: tf.Tensor, source: tf.Tensor, shard: int) -> None:
  logs.warning_once(
      f'estimator_towers: the loss {loss.name} is computed from {source.name}, '
      f'but shard {shard} built no matching tensor (its model_fn took another '
      f'path), so the towers\' losses are weighted by their share of the '
      f'examples instead of rebuilt from the shards\' statistics.',
      key=f'loss_algebra:unmatched:{source.name}')


def whole_batch_loss(expression: Expression, statistics: Sequence[dict],
                     nonempty: Sequence, across: Any = None) -> tf.Tensor:
  """f on the sums of the shards' statistics (`statistics`: per shard, key -> value)."""
  return rebuilt_loss(expression, statistics, nonempty, across)[0]


def rebuilt_loss(expression: Expression, statistics: Sequence[dict], nonempty: Sequence,
                  across: Any = None) -> tuple[tf.Tensor, dict]:
  """(f on the totals, the totals): `whole_batch_loss` and the totals it was made from."""
  totals = whole_batch_totals(statistics, nonempty, across)
  with tf.device(None), tf.name_scope('whole_batch_loss'):
    return expression.rebuild(totals), totals


def whole_batch_totals(statistics: Sequence[dict], nonempty: Sequence, across: Any = None,
                       groups: Sequence[frozenset] = ()) -> dict:
  """key -> the sum of the shards' statistics (the cluster's, with `across`).

  Across workers, the statistics of each of `groups` (sets of keys) are
  summed by an all-reduce of their own, and the rest by another, so that a
  micro-batch's normalisers do not wait for the statistics of later
  micro-batches' forward passes.
  """
  with tf.device(None), tf.name_scope('whole_batch_loss'):
    totals = {key: masked_sum([s[key] for s in statistics], nonempty)
              for key in statistics[0]}
  if across is None:
    return totals
  result = {}
  rest = [k for k in totals if not any(k in g for g in groups)]
  for group in [rest] + [[k for k in totals if k in g] for g in groups]:
    if group:
      result.update(zip(group, across.global_total([totals[k] for k in group])))
  return result
