"""Several losses in one gradient request: the gradient of one scalar.

`tf.gradients([l1, l2], vars)` (with or without `grad_ys`) is answered as the
request of sum_i <g_i, y_i> per shard (`loss/request_seeds`): where a loss
mixes the batch's rows (a max over the batch), its head on the whole batch;
otherwise the loss algebra's rule. The EstimatorSpec's loss, which mixes
rows too but is not what was differentiated, is its head's value on the
whole batch (`loss/reported`). Two requests (one per loss, summed) are
exact as well. Momentum; variables and slots within 1e-5 of plain after
steps 1 and 3 (an empty shard in step 3 on 3 towers).
"""

import functools

import pytest
import tensorflow as tf

import testlib
import estimator_towers as et
from test_batch_reductions import LAYOUTS, _input_fn, _xent


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


def _request(kind, xent, logits, tvars):
  """(the gradients of `kind`'s request, the loss reported)."""
  mixed = tf.reduce_mean(xent) + 0.5 * tf.reduce_max(xent)
  second = 0.1 * tf.reduce_mean(tf.square(logits))   # per-example
  if kind == 'mixed_and_per_example':
    return tf.gradients([mixed, second], tvars), mixed + second
  if kind == 'two_per_example':
    return tf.gradients([tf.reduce_mean(xent), second], tvars), tf.reduce_mean(xent) + second
  if kind == 'two_mixed':
    least = 0.5 * tf.reduce_min(xent)
    return tf.gradients([mixed, least], tvars), mixed + least
  if kind == 'initial_gradients':   # constants: sum_i <g_i, y_i>
    return (tf.gradients([mixed, second], tvars, grad_ys=[tf.constant(2.0), tf.constant(0.5)]),
            2.0 * mixed + 0.5 * second)
  assert kind == 'two_requests'   # compute_gradients of each, the sum applied
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(1.0)
  first = optimizer.compute_gradients(mixed, tvars)
  later = optimizer.compute_gradients(second, tvars)
  return [a + b for (a, _), (b, _) in zip(first, later)], mixed + second


def _two_losses_model_fn(kind, features, labels, mode):
  if labels is None:   # features a Tensor, no labels
    features, labels = {'x': features}, tf.cast(features[:, 0] > 0, tf.int32)
  logits, xent = _xent(features['x'], labels)
  tvars = tf.compat.v1.trainable_variables()
  grads, loss = _request(kind, xent, logits, tvars)
  train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).apply_gradients(
      zip(grads, tvars), tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


class _ReportedLoss(tf.compat.v1.train.SessionRunHook):
  """The loss each step reports (the spec's loss, as the Estimator summarises it)."""

  def __init__(self):
    self.values = []

  def begin(self):
    (summary,) = [op for op in tf.compat.v1.get_default_graph().get_operations()
                  if op.type == 'ScalarSummary' and op.name == 'loss']
    self._loss = summary.inputs[1]

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._loss)

  def after_run(self, run_context, run_values):
    self.values.append(float(run_values.results))


@functools.lru_cache(maxsize=None)
def _two_losses(kind, num_devices=0, micro_batches=1, labels=True):
  """(variables after steps 1 and 3, the losses reported), of plain (num_devices 0) or towers."""
  model_fn = functools.partial(_two_losses_model_fn, kind)
  if num_devices:
    model_fn = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                                     micro_batches=micro_batches)
  reported = _ReportedLoss()
  if not num_devices:
    plain = testlib.plain_train_and_read(model_fn, _input_fn(labels), hooks=[reported])
    return tuple(plain), reported.values
  est = testlib.stepwise_estimator(model_fn, num_cpus=num_devices)
  return tuple(testlib.train_and_read(est, _input_fn(labels), hooks=[reported])), reported.values


def _ours(warnings):
  """The warnings of an inexact loss (not the notice that the spec's loss, made after the
  request, costs other towers a second pass)."""
  return [w for w in warnings if "the EstimatorSpec's loss is not the tensor" not in w]


KINDS = ('mixed_and_per_example', 'two_per_example', 'two_mixed', 'initial_gradients',
         'two_requests')


@pytest.mark.parametrize('layout', ['3 towers', '1x2'])
@pytest.mark.parametrize('kind', KINDS)
def test_several_losses_in_one_request_train_as_plain(kind, layout, warnings):
  """tf.gradients([l1, l2]): the gradient of one scalar, sum_i <g_i, y_i> (its head on the
  whole batch where a loss mixes rows); the reported loss (which mixes rows too) is its head's
  value on the whole batch. No warning."""
  (plain_1, plain_3), plain_losses = _two_losses(kind)
  (towered_1, towered_3), losses = _two_losses(kind, *LAYOUTS[layout])
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  if layout == '3 towers':   # micro-batches: a spec's loss made after the request is not yet
    testlib.assert_close(losses, plain_losses, err_msg='reported loss')   # (as on main)
  assert not _ours(warnings), warnings


def test_several_losses_features_a_tensor_labels_none(warnings):
  (plain_1, plain_3), _ = _two_losses('mixed_and_per_example', labels=False)
  (towered_1, towered_3), _ = _two_losses('mixed_and_per_example', 2, 2, labels=False)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), warnings
