"""The seeds of micro-batches: one backward pass per micro-batch, before the batch is whole.

A micro-batch's backward pass runs before the later micro-batches' forward
passes, so it cannot wait for the whole batch's statistics. It needs only
the coefficients dL/dS_i of the statistics that depend on trained variables
(the numerators), and for the losses above those depend only on statistics
that do not (sums of weights, token counts): f is linear in the numerators.
Those are computed, for every micro-batch, from its inputs before they pass
the micro-batch gates (a copy of tower 0's ops that compute them, on the
micro-batch's ungated inputs), and element counts from the micro-batch's own
forward pass (every example of a batch has the same shape, so the batch's
count is B times the micro-batch's count per example). Each micro-batch's
backward pass then seeds its numerators with those coefficients, and its
gradient adds into one buffer per variable, as for a mean. A loss whose
coefficients depend on a numerator (a normaliser computed from trained
variables, a ratio of two numerators) is refused at graph construction.
The gradient through the loss's shard-independent terms (a regulariser) is
the backward pass of the whole loss stopped at the totals.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.draws import keyed
from estimator_towers.loss import loss_algebra
from estimator_towers.loss import seeds as seeds_lib
from estimator_towers.loss import statistics as statistics_lib
from estimator_towers.loss.loss_algebra import Expression


def micro_batch(expression: Expression, find: Callable, ungated: Callable,
                nonempty: Sequence, sizes: Sequence, batch: Any,
                grad_y: tf.Tensor | None, across: Any = None) -> seeds_lib.Seeds | None:
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
          statistics_lib.report_unmatched(expression.loss, statistic.source, i)
          return None
      else:  # from the shard's inputs, before the gates
        source = _clone(statistic.source, expression, ungated(i), sizes[i], sizes[0], i)
      found[statistic.key] = statistic.of(source)
    values.append(found)
  totals = statistics_lib.whole_batch_totals(values, nonempty, across, (
      frozenset(s.key for s in statistics if s.trained),
      frozenset(s.key for s in statistics if s.counts and not s.trained)))
  numerators = [s for s in statistics if s.trained]
  ys, grad_ys, checks = [], [], []
  for i, found in enumerate(values):
    estimates = _estimated_counts(expression, found, sizes[i], batch)
    coefficients = _coefficients(expression, dict(totals, **estimates), numerators, totals,
                                 values)
    checks.extend(_check_counts(expression, estimates, totals, nonempty[i]))
    shard_ys, shard_grad_ys = seeds_lib.shard_seeds(found, coefficients,
                                                    seeds_lib.shard_weight(nonempty[i], grad_y))
    ys.append(shard_ys)
    grad_ys.append(shard_grad_ys)
  with tf.device(None), tf.name_scope('whole_batch_loss'), tf.control_dependencies(checks):
    loss = tf.identity(expression.rebuild(totals))
  return seeds_lib.Seeds(list(zip(ys, grad_ys)), loss, list(totals.values()))


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
           size: Any, first_size: Any, shard: int) -> tf.Tensor:
  """Tower 0's `source` computed again from another shard's `inputs`.

  `source` depends on no trained variable's values; its ops are copied with
  tower 0's inputs replaced by `inputs` (aligned with
  `expression.dependence`'s). Where it takes only the shape of a tensor
  computed from trained variables (a `tf.ones_like(losses)` that broadcasts
  weights, a `tf.size`), that shape is tower 0's with its first dimension
  scaled from tower 0's `first_size` examples to the shard's `size`. Keyed
  random draws draw the shard's own rows (`shard`'s position).
  """
  mapping = {t.name: i for t, i in zip(expression.dependence.input_tensors, inputs)}
  mapping.update(keyed.positions_for(source.graph, shard))   # its keyed draws' rows
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

  graph = tf.compat.v1.get_default_graph()
  with graph.colocate_with(inputs[0].op) if inputs else tf.device(None), \
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
