"""Towered vs plain: one training step, evaluation, prediction, checkpoints.

The reference is the plain single-device model_fn run by a plain Estimator on
the same data. With the default settings the towered step equals the plain
step on the whole batch, for the batch-separable model (tf.compat.v1.layers)
and for the Keras model with BatchNormalization (synchronised by default).
With `sync_batch_norm=False` each tower normalises its own shard, so that
reference is built from plain steps on each shard alone: with SGD the towered
update is w + sum_k (n_k / B) * (w_k - w), where w_k is the plain step on shard
k, and the moving statistics are those of the plain step on shard 0.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn

pytestmark = pytest.mark.core_equivalence  # CI runs them under TF1 behaviour too (.ci/run)

DEVICE_COUNTS = [1, 2, 3, 4]
BATCHES = [7, 2]  # 7 divides by none of 2..4; 2 is smaller than 3 and 4.


def shard_bounds(batch, n):
  q, r = divmod(batch, n)
  sizes = [q + (1 if k < r else 0) for k in range(n)]
  offsets = np.cumsum([0] + sizes[:-1])
  return list(zip(offsets, sizes))


@functools.lru_cache(maxsize=None)
def plain_step(model_name, batch, start=0, size=None, learning_rate=None):
  """Variables after one plain SGD step on examples [start, start+size)."""
  x, y = testlib.data(batch)
  size = batch if size is None else size
  params = {} if learning_rate is None else {'learning_rate': learning_rate}
  est = testlib.make_estimator(testlib.MODELS[model_name], params=params)
  est.train(testlib.input_fn(x[start:start + size], y[start:start + size], size), steps=1)
  return testlib.variables(est)


def expected_step(model_name, batch, num_devices, sync_batch_norm=None):
  if model_name == 'v1_layers' or sync_batch_norm is None:
    return plain_step(model_name, batch)
  initial = plain_step(model_name, batch, learning_rate=0.0)
  expected = {}
  shards = [(o, n) for o, n in shard_bounds(batch, num_devices) if n]
  steps = [plain_step(model_name, batch, int(o), n) for o, n in shards]
  for name, w in initial.items():
    if 'moving_' in name:  # batch-norm statistics: tower 0's shard feeds them.
      expected[name] = steps[0][name]
    elif name == 'global_step':
      expected[name] = 1
    else:
      expected[name] = w + sum((n / batch) * (s[name] - w) for (_, n), s in zip(shards, steps))
  return expected


@functools.lru_cache(maxsize=None)
def plain_eval_and_predict(model_name, batch, checkpoint_dir):
  x, y = testlib.data(batch)
  est = testlib.make_estimator(testlib.MODELS[model_name], model_dir=checkpoint_dir)
  fn = testlib.input_fn(x, y, batch)
  return est.evaluate(fn), testlib.predictions(est, fn)


@pytest.mark.parametrize('model_name', sorted(testlib.MODELS))
@pytest.mark.parametrize('batch', BATCHES)
@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_train_eval_predict_match_plain(model_name, batch, num_devices):
  x, y = testlib.data(batch)
  fn = testlib.input_fn(x, y, batch)
  towered = replicate_model_fn(testlib.MODELS[model_name],
                               devices=testlib.cpu_devices(num_devices))
  est = testlib.make_estimator(towered, num_cpus=num_devices)
  est.train(fn, steps=1)

  # One SGD step equals the plain step; the checkpoint has exactly the plain names.
  testlib.assert_variables_close(testlib.variables(est),
                                 expected_step(model_name, batch, num_devices))

  # On the towered checkpoint, evaluate/predict equal the plain model_fn's, and
  # the checkpoint restores into the plain model_fn (which predicts the same).
  plain_metrics, plain_predictions = plain_eval_and_predict(model_name, batch, est.model_dir)
  metrics = est.evaluate(fn)
  assert sorted(metrics) == sorted(plain_metrics)
  for key in plain_metrics:
    testlib.assert_close(metrics[key], plain_metrics[key], err_msg=key)
  predicted = testlib.predictions(est, fn)
  assert predicted.shape == (batch, testlib.NUM_CLASSES)
  testlib.assert_close(predicted, plain_predictions, err_msg='predictions')


@pytest.mark.parametrize('num_devices', [2, 3])
def test_the_opt_out_normalises_each_shard_with_its_own_statistics(num_devices):
  """sync_batch_norm=False: the step of the shards' own statistics, moving averages from tower 0."""
  x, y = testlib.data(7)
  towered = replicate_model_fn(testlib.MODELS['keras_bn'], devices=testlib.cpu_devices(num_devices),
                               sync_batch_norm=False)
  est = testlib.make_estimator(towered, num_cpus=num_devices)
  est.train(testlib.input_fn(x, y, 7), steps=1)
  testlib.assert_variables_close(testlib.variables(est),
                                 expected_step('keras_bn', 7, num_devices, sync_batch_norm=False))
