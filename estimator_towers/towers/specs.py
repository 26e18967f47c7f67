"""Merging the towers' EstimatorSpecs into the one Estimator sees."""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from estimator_towers.base import fixed_sums
from estimator_towers.inputs import sharding
from estimator_towers.towers import metric_order

ModeKeys = tf.estimator.ModeKeys


def weighted_sum(values: Sequence[tf.Tensor], weights: Sequence, nonempty: Sequence) -> tf.Tensor:
  """sum_k weights[k] * values[k], skipping towers whose shard is empty."""
  terms = []
  for value, weight, ne in zip(values, weights, nonempty):
    if ne is False:
      continue
    value = tf.convert_to_tensor(value)
    term = value * tf.cast(weight, value.dtype)
    if ne is not True:
      term = tf.where(ne, term, tf.zeros_like(term))
    terms.append(term)
  return tf.add_n(terms)


def _join(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """Per-example tensors joined in input order; a known scalar is tower 0's.

  Only a known scalar is per-batch; a tensor of unknown rank is taken as
  per-example.
  """
  if tensors[0].shape.rank == 0:
    return tensors[0]
  return sharding.concat(list(tensors))


def _join_nest(structures: Sequence) -> object:
  flat = [tf.nest.flatten(s) for s in structures]
  return tf.nest.pack_sequence_as(
      structures[0], [_join([f[i] for f in flat]) for i in range(len(flat[0]))])


def _concat_export_output(outputs: Sequence[tf.estimator.export.ExportOutput]):
  first = outputs[0]
  if isinstance(first, tf.estimator.export.ClassificationOutput):
    scores = None if first.scores is None else _join([o.scores for o in outputs])
    classes = None if first.classes is None else _join([o.classes for o in outputs])
    return tf.estimator.export.ClassificationOutput(scores=scores, classes=classes)
  if isinstance(first, tf.estimator.export.RegressionOutput):
    return tf.estimator.export.RegressionOutput(_join([o.value for o in outputs]))
  if isinstance(first, tf.estimator.export.PredictOutput):
    return tf.estimator.export.PredictOutput(_join_nest([o.outputs for o in outputs]))
  raise TypeError(
      f'Cannot join export output {type(first).__name__} across towers; '
      f'use ClassificationOutput, RegressionOutput or PredictOutput.')


def _concat_predictions(specs):
  """Per-example predictions joined in input order; others (scalars) from tower 0."""
  first = specs[0].predictions
  if first is None or (isinstance(first, dict) and not first):
    return first
  return _join_nest([s.predictions for s in specs])


def _respec(spec: tf.estimator.EstimatorSpec, **changes) -> tf.estimator.EstimatorSpec:
  """A new, validated EstimatorSpec: `spec` with `changes`."""
  fields = spec._asdict()
  fields.update(changes)
  return tf.estimator.EstimatorSpec(**fields)


def merge_train(spec, loss, train_op, counterparts) -> tf.estimator.EstimatorSpec:
  """Tower 0's TRAIN spec with the whole-batch loss and predictions.

  Args:
    spec: tower 0's EstimatorSpec (its train_op is the one update).
    loss: the weighted loss over the towers.
    train_op: the op Estimator runs.
    counterparts: maps a tensor of tower 0 to the list of every tower's
      matching tensor, or None where one is not known. Predictions that are not
      all known are left out of the TRAIN spec (Estimator does not read them
      in TRAIN) rather than reported for tower 0's shard only.
  """
  predictions = spec.predictions
  if isinstance(predictions, (dict, tf.Tensor)) and tf.nest.flatten(predictions):
    flat = tf.nest.flatten(predictions)
    per_tower = [counterparts(t) if t.shape.rank != 0 else [t] for t in flat]
    if any(p is None for p in per_tower):
      predictions = {}
    else:
      predictions = tf.nest.pack_sequence_as(predictions, [_join(p) for p in per_tower])
  return _respec(spec, loss=loss, train_op=train_op, predictions=predictions)


def _is_mean_of(update: object, loss: tf.Tensor) -> bool:
  """True if `update` is the update op of `tf.compat.v1.metrics.mean(loss)`.

  Matched on the graph `metrics.mean` builds: the update is a DivNoNan of the
  running total, read after an AssignAdd of the Sum of its values.
  """
  if not isinstance(update, tf.Tensor) or update.op.type != 'DivNoNan':
    return False
  read = update.op.inputs[0].op
  if read.type != 'ReadVariableOp':
    return False
  for control in read.control_inputs:
    if control.type == 'AssignAddVariableOp' and control.inputs[1].op.type == 'Sum':
      values = control.inputs[1].op.inputs[0]
      while values.op.type in ('Cast', 'Identity') and values.op is not loss.op:
        values = values.op.inputs[0]
      return values.op is loss.op and values.value_index == loss.value_index
  return False


def merge_eval(specs, loss, built=None) -> tf.estimator.EstimatorSpec:
  """Tower 0's metric values (the metric state is shared), every tower's updates (on the
  fixed shard grid in shard order: `metric_order`).

  A metric of the loss itself (`tf.compat.v1.metrics.mean(loss)`, as k-means'
  score) is a metric of a batch-level value: it is rebuilt on the whole
  batch's loss, so that it equals the plain model_fn's, rather than averaging
  the towers' shard losses. `built` are the specs as the model_fn returned
  them, where `specs` have fetches wrapped (empty_shards), to recognise it.
  """
  built = built or specs
  first = specs[0]
  metrics = {}
  for key, (value, _) in first.eval_metric_ops.items():
    updates = []
    for k, spec in enumerate(specs):
      if key not in spec.eval_metric_ops:
        raise ValueError(
            f'Tower {k} returned no eval_metric_ops[{key!r}] but tower 0 did; '
            f'every tower must return the same metrics.')
      updates.append(spec.eval_metric_ops[key][1])
    if len(specs) > 1 and all(_is_mean_of(s.eval_metric_ops[key][1], s.loss) for s in built):
      metrics[key] = tf.compat.v1.metrics.mean(loss, name=f'whole_batch_{key}')
    else:
      if fixed_sums.active():  # one order of the shards' additions to the state
        metric_order.in_shard_order(updates)
      metrics[key] = (value, tf.group(*updates))
  return _respec(first, loss=loss, eval_metric_ops=metrics,
                        predictions=_concat_predictions(specs))


def merge_predict(specs) -> tf.estimator.EstimatorSpec:
  first = specs[0]
  export_outputs = None
  if first.export_outputs:
    export_outputs = {
        key: _concat_export_output([s.export_outputs[key] for s in specs])
        for key in first.export_outputs}
  return _respec(first, predictions=_concat_predictions(specs),
                        export_outputs=export_outputs)
