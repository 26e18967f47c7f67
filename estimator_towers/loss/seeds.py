"""The seeds of the whole-batch gradient: what each shard's backward pass starts from.

`loss_algebra` gives the rule for a loss; the seeds follow from it:

- 'mean' / 'sum' (the example-count rule): each shard's own loss, with the
  initial gradient w_k (n_k / B for a mean, 1 for a sum, 0 for a shard
  empty at run time) times the requested one (`tower_weights`).
- 'rebuild', towers: the whole batch's loss itself, f on the sums of the
  shards' statistics (`whole_batch_loss`), with the requested initial
  gradient: one backward pass through it reaches every shard. Across
  workers, each shard's statistics seeded with the loss's coefficients at
  the cluster's totals, so that a task's pass gives its own part only.
- 'rebuild', micro-batches (`micro_batch`): A micro-batch's backward pass runs
  before the later micro-batches' forward passes, so it cannot wait for the
  whole batch's statistics. It needs only the coefficients dL/dS_i of the
  statistics that depend on trained variables (the numerators), and for the
  losses above those depend only on statistics that do not (sums of weights,
  token counts): f is linear in the numerators. Those are computed, for every
  micro-batch, from its inputs before they pass the micro-batch gates (a copy
  of tower 0's ops that compute them, on the micro-batch's ungated inputs), and
  element counts from the micro-batch's own forward pass (every example of a
  batch has the same shape, so the batch's count is B times the micro-batch's
  count per example). Each micro-batch's backward pass then seeds its
  numerators with those coefficients, and its gradient adds into one buffer
  per variable, as for a mean. A loss whose coefficients depend on a numerator
  (a normaliser computed from trained variables, a ratio of two numerators) is
  refused at graph construction.
  The gradient through the loss's shard-independent terms (a regulariser)
  is the backward pass of the whole loss stopped at the totals.
- a loss that mixes the batch's rows (`row_dependence`): its head on the
  whole batch (`whole_batch_head`); each shard's frontier tensors are seeded
  with their rows of the head's gradient. With micro-batches the head reads
  the rows of a first pass over the micro-batches (`cached_gradients`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.heads import cached_gradients
from estimator_towers.heads import row_wise_head
from estimator_towers.heads import whole_batch_head
from estimator_towers.loss import loss_algebra
from estimator_towers.loss.loss_algebra import Expression
from estimator_towers.rows import row_dependence
from estimator_towers.towers import counterparts

# Reductions recorded by tf.compat.v1.losses (Reduction.SUM) and Keras
# (ReductionV2.SUM) that sum over the batch; every other one averages.
SUM_REDUCTIONS = ('weighted_sum', 'sum')


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


def for_request(graph: tf.Graph, loss_reduction: str, inputs: Sequence[tf.Tensor],
                variables: Sequence, ys: Sequence[list], grad_ys: Sequence[list],
                nonempty: Sequence, sizes: Sequence, batch: Any,
                ungated: Callable | None, across: Any = None, per_shard: bool = False,
                gates: Callable | None = None) -> Seeds:
  """The seeds of one gradient request, per shard (shard 0 the primary).

  Args:
    graph: the graph (for the reduction a TensorFlow loss function recorded).
    loss_reduction: the plan's.
    inputs: the primary's shard tensors, flattened.
    variables: the trained variables the request is with respect to.
    ys, grad_ys: per shard, the request's tensors and initial gradients.
    nonempty, sizes: per shard, whether it has examples and how many.
    batch: the global batch's number of examples.
    ungated: with micro-batches, `ungated(i)`: shard i's inputs before its
      gates; None for towers.
    across: a `cross_worker.CrossWorker` when the batch spans workers (the
      totals are the cluster's; `batch` is the cluster's), else None.
    per_shard: a rebuilt loss's seeds per shard even for towers alone (each
      tower's backward pass its own: `tower_copies`).
    gates: with micro-batches, `gates(i)`: the Identity ops shard i's inputs
      pass through.
  """
  loss = ys[0][0] if len(ys[0]) == 1 else None
  find = counterparts.in_losses([y[0] for y in ys]) if loss is not None else None
  head = _whole_batch_head(loss, ys[0], inputs, grad_ys, find, nonempty, sizes, batch,
                           None if ungated is None else (ungated, gates or (lambda i: [])),
                           across)
  if isinstance(head, Seeds):
    return head
  analysis = loss_algebra.analyse(loss, inputs, variables, loss_reduction,
                                  lambda: fallback_reduction(graph, loss),
                                  static_count=static_counts(graph, find, sizes),
                                  targets=ys[0], micro_batches=ungated is not None,
                                  note=head)
  found = None
  if analysis.rule == 'rebuild':
    if ungated is None:
      found = rebuilt(analysis.expression, find, nonempty, grad_ys[0][0], across, per_shard)
    else:
      found = micro_batch(analysis.expression, find, ungated, nonempty, sizes, batch,
                          grad_ys[0][0], across)
  if found is not None:
    return found
  rule = analysis.rule if analysis.rule != 'rebuild' else 'mean'
  return weighted(ys, grad_ys, tower_weights(rule, sizes, batch, range(len(sizes))))


def _whole_batch_head(loss: Any, ys: Sequence, inputs: Sequence[tf.Tensor],
                      grad_ys: Sequence[list], find: Callable | None, nonempty: Sequence,
                      sizes: Sequence, batch: Any, micro: tuple | None, across: Any = None
                      ) -> Seeds | str | None:
  """A loss that mixes the batch's rows, its head on the whole batch (`whole_batch_head`).

  Each shard's backward pass starts from its frontier tensors' rows of the
  head's gradient; the head's own variables get theirs from the head's
  backward pass stopped at the frontier (`stops`). With micro-batches
  (`micro`: their `ungated` and `gates`), the head reads a first pass's rows
  (`cached_gradients`). None where no op mixes rows; a sentence saying why
  the head cannot be built (for `row_dependence`'s warning) where one does.
  """
  found = row_dependence.classify(ys, inputs, loss_algebra.is_declared)
  if not found.mixing:
    return None
  if not isinstance(loss, tf.Tensor):
    return 'the gradient request is of several tensors, and the head takes one loss'
  if micro is None:
    built = whole_batch_head.build(found, loss, grad_ys[0][0], find, sizes, nonempty, batch,
                                   across, split=row_wise_head.build)
  else:
    built = cached_gradients.build(found, loss, grad_ys[0][0], find, inputs, *micro, sizes,
                                   nonempty, batch, across)
  if isinstance(built, str):
    return built
  whole, shards, stops, where = built
  logs.info_once_per_graph(
      f'estimator_towers: the loss {loss.name} depends on {found.mixing[0].describe()}, '
      f'which mixes the batch\'s rows: its head ({len(found.frontier)} gathered tensor(s) '
      f'to the loss) runs on the whole batch {where}'
      f'{", on the rows of a first pass over the micro-batches" if micro else ""}.')
  return Seeds(shards, whole, stops)


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
  statistics = shard_statistics(expression, find, len(nonempty))
  if statistics is None:
    return None
  whole, totals = _rebuilt_loss(expression, statistics, nonempty, across)
  if across is None and not per_shard:
    return Seeds([([whole], [grad_y])] + [([], [])] * (len(nonempty) - 1), whole)
  keys = [s.key for s in expression.statistics if s.trained]  # the others reach no variable
  with tf.device(None), tf.name_scope('whole_batch_coefficients'):
    found = tf.gradients(whole, [totals[key] for key in keys],
                         grad_ys=None if grad_y is None else [grad_y])
  coefficients = dict(zip(keys, found))
  shards = [_shard_seeds(values, coefficients, _weight(ne, None))
            for values, ne in zip(statistics, nonempty)]
  return Seeds(shards, whole, list(totals.values()))


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
  """sum_k values[k] over the shards whose shard is not empty."""
  terms = []
  for t, ne in zip(values, nonempty):
    if ne is False:
      continue
    terms.append(t if ne is True else tf.where(ne, t, tf.zeros_like(t)))
  return tf.add_n(terms) if terms else tf.zeros_like(values[0])


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
  return _rebuilt_loss(expression, statistics, nonempty, across)[0]


def _rebuilt_loss(expression: Expression, statistics: Sequence[dict], nonempty: Sequence,
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


def micro_batch(expression: Expression, find: Callable, ungated: Callable,
                nonempty: Sequence, sizes: Sequence, batch: Any,
                grad_y: tf.Tensor | None, across: Any = None) -> Seeds | None:
  """Seeds for one backward pass per shard (see the module docstring).

  Args:
    expression: tower 0's loss.
    find: `find(i, t)`, shard i's counterpart of tower 0's `t` (None: unknown).
    ungated: `ungated(i)`, shard i's flattened inputs before its gates,
      aligned with the inputs `expression.dependence` was made from.
    nonempty: per shard, True, False or a bool Tensor.
    sizes: per shard, its number of examples (int or int32 Tensor).
    batch: the global batch's number of examples.
    grad_y: the gradient requested for the loss (None: 1).
    across: a `cross_worker.CrossWorker` (the totals and `batch` are the
      cluster's), or None.

  Raises:
    ValueError: if a coefficient depends on a trained variable's statistic.
  """
  statistics = expression.statistics
  _check_per_example(expression)
  values = []   # per shard, key -> value
  for i in range(len(sizes)):
    found = {}
    for statistic in statistics:
      if statistic.trained or statistic.counts or i == 0:
        source = statistic.source if i == 0 else find(i, statistic.source)
        if source is None:
          report_unmatched(expression.loss, statistic.source, i)
          return None
      else:  # from the shard's inputs, before the gates
        source = _clone(statistic.source, expression, ungated(i), sizes[i], sizes[0])
      found[statistic.key] = statistic.of(source)
    values.append(found)
  totals = whole_batch_totals(values, nonempty, across, (
      frozenset(s.key for s in statistics if s.trained),
      frozenset(s.key for s in statistics if s.counts and not s.trained)))
  numerators = [s for s in statistics if s.trained]
  ys, grad_ys, checks = [], [], []
  for i, found in enumerate(values):
    estimates = _estimated_counts(expression, found, sizes[i], batch)
    coefficients = _coefficients(expression, dict(totals, **estimates), numerators, totals,
                                 values)
    checks.extend(_check_counts(expression, estimates, totals, nonempty[i]))
    shard_ys, shard_grad_ys = _shard_seeds(found, coefficients, _weight(nonempty[i], grad_y))
    ys.append(shard_ys)
    grad_ys.append(shard_grad_ys)
  with tf.device(None), tf.name_scope('whole_batch_loss'), tf.control_dependencies(checks):
    loss = tf.identity(expression.rebuild(totals))
  return Seeds(list(zip(ys, grad_ys)), loss, list(totals.values()))


def _check_per_example(expression: Expression) -> None:
  """Raises for an element count whose rows depend on values (see `micro_batch`)."""
  for statistic in expression.statistics:
    if statistic.counts and not statistic.per_example:
      raise ValueError(
          f'micro_batches > 1 cannot train the loss {expression.loss.name} '
          f'exactly: it divides by the element count of {statistic.source.name}, '
          f'whose rows depend on values (an op such as tf.boolean_mask\'s Where '
          f'made it), so the whole batch\'s count is known only after the last '
          f'micro-batch\'s forward pass. Count with a sum of the mask instead '
          f'(tf.reduce_sum(values * mask) / tf.reduce_sum(mask)), or use '
          f'micro_batches=1 (towers alone are exact).')


def _estimated_counts(expression: Expression, found: dict, size: Any, batch: Any) -> dict:
  """The whole batch's element counts as one shard sees them before its backward pass.

  B * count / max(n, 1): every example of a batch has the same shape.
  """
  estimates = {}
  with tf.device(None), tf.name_scope('micro_batch_counts'):
    for statistic in expression.statistics:
      if statistic.counts:
        count = found[statistic.key]
        per_example = count / tf.cast(tf.maximum(size, 1), count.dtype)
        estimates[statistic.key] = per_example * tf.cast(batch, count.dtype)
  return estimates


def _check_counts(expression: Expression, estimates: dict, totals: dict, nonempty: Any
                  ) -> list:
  """Asserts that a shard's estimated counts are the whole batch's (run with the loss)."""
  checks = []
  for statistic in expression.statistics:
    if not statistic.counts or nonempty is False:
      continue
    wrong = tf.abs(estimates[statistic.key] - totals[statistic.key]) > 0.5
    if nonempty is not True:
      wrong = tf.logical_and(wrong, nonempty)
    checks.append(tf.debugging.Assert(tf.logical_not(wrong), [
        f'estimator_towers: with micro_batches > 1 the whole batch\'s element '
        f'count {statistic.source.name} is taken, before the backward pass, as '
        f'B times a micro-batch\'s count per example, but the micro-batches\' '
        f'counts are not proportional to their examples (as after '
        f'tf.boolean_mask): estimated', estimates[statistic.key], 'counted',
        totals[statistic.key], '. Count with a sum of the mask instead, '
        f'e.g. tf.reduce_sum(values * mask) / tf.reduce_sum(mask), or use '
        f'micro_batches=1.']))
  return checks


def _shard_seeds(values: dict, coefficients: dict, weight: Any) -> tuple[list, list]:
  """A shard's statistics and their seeds: the loss's coefficient dL/dS times the shard's weight.

  Statistics whose coefficient is None (the loss does not depend on them) get none.
  """
  keys = [key for key, c in coefficients.items() if c is not None]
  return ([values[key] for key in keys],
          [coefficients[key] * tf.cast(weight, coefficients[key].dtype) for key in keys])


def _weight(nonempty: Any, grad_y: tf.Tensor | None) -> Any:
  weight = 1.0 if nonempty is True else 0.0 if nonempty is False else tf.cast(nonempty, tf.float32)
  return weight if grad_y is None else grad_y * tf.cast(weight, grad_y.dtype)


def _coefficients(expression: Expression, known: dict, numerators: list, totals: dict,
                  values: list) -> dict:
  """dL/dS for each numerator, from what a shard knows before its backward pass.

  `known`: the totals, with the element counts the shard's estimates.
  """
  with tf.device(None), tf.name_scope('micro_batch_coefficients'):
    whole = expression.rebuild(known)
    wanted = [known[s.key] for s in numerators]
    gradients = tf.gradients(whole, wanted) if wanted else []
  forbidden = {totals[s.key].op.name for s in numerators}
  forbidden.update(v[s.key].op.name for v in values for s in numerators)
  coefficients = {}
  for statistic, gradient in zip(numerators, gradients):
    if gradient is not None and loss_algebra.depends_on(gradient, forbidden):
      raise ValueError(
          f'micro_batches > 1 cannot train the loss {expression.loss.name} '
          f'exactly: its gradient with respect to the statistic '
          f'{statistic.source.name} (a sum over the batch of values computed '
          f'from trained variables) depends on the whole batch\'s value of a '
          f'statistic computed from trained variables, which is known only '
          f'after the last micro-batch\'s forward pass, while the first '
          f'micro-batch\'s backward pass runs before it. A loss whose '
          f'normalisers depend only on the inputs (token counts, sums of '
          f'weights, element counts) trains exactly; for this one use '
          f'micro_batches=1 (towers alone are exact).')
    coefficients[statistic.key] = gradient
  return coefficients


def _clone(source: tf.Tensor, expression: Expression, inputs: Sequence[tf.Tensor],
           size: Any, first_size: Any) -> tf.Tensor:
  """Tower 0's `source` computed again from another shard's `inputs`.

  `source` depends on no trained variable's values; its ops are copied with
  tower 0's inputs replaced by `inputs` (aligned with
  `expression.dependence`'s). Where it takes only the shape of a tensor
  computed from trained variables (a `tf.ones_like(losses)` that broadcasts
  weights, a `tf.size`), that shape is tower 0's with its first dimension
  scaled from tower 0's `first_size` examples to the shard's `size`.
  """
  mapping = {t.name: i for t, i in zip(expression.dependence.input_tensors, inputs)}
  memo: dict = {}

  def clone(t: tf.Tensor) -> tf.Tensor:
    if t.name in mapping:
      return mapping[t.name]
    if t.name in memo:
      return memo[t.name]
    if not expression.dependence.shard(t):
      return t
    op = t.op
    if op.type in loss_algebra.SHAPE_OPS and expression.dependence.of(op.inputs[0], values=True)[1]:
      memo[t.name] = _shape_of_shard(t, op.inputs[0], size, first_size)
      return memo[t.name]
    if op.op_def.is_stateful:
      raise ValueError(
          f'micro_batches > 1: the loss {expression.loss.name} divides by '
          f'{source.name}, computed from the inputs through the stateful op '
          f'{op.name} ({op.type}), which cannot be computed again for each '
          f'micro-batch before its backward pass. Compute the normaliser '
          f'without it, or use micro_batches=1.')
    memo[t.name] = loss_algebra.copy_op(op, [clone(i) for i in op.inputs]).outputs[t.value_index]
    return memo[t.name]

  with tf.compat.v1.colocate_with(inputs[0].op) if inputs else tf.device(None), \
      tf.name_scope('micro_batch_normaliser'):
    return clone(source)


def _shape_of_shard(t: tf.Tensor, x: tf.Tensor, size: Any, first_size: Any) -> tf.Tensor:
  """`t`, a Shape / Size / Rank / OnesLike / ZerosLike of tower 0's `x`, for a shard of `size`."""
  op = t.op
  if op.type == 'Rank':
    return tf.rank(x)
  shape = tf.shape(x)
  first = shape[0] // tf.maximum(tf.cast(first_size, shape.dtype), 1) * tf.cast(size, shape.dtype)
  shape = tf.concat([[first], shape[1:]], 0)
  if op.type in ('Shape', 'ShapeN'):
    return tf.cast(shape, t.dtype)
  if op.type == 'Size':
    return tf.cast(tf.reduce_prod(shape), t.dtype)
  return tf.fill(shape, tf.constant(1 if op.type == 'OnesLike' else 0, t.dtype))
