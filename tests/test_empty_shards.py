"""Issue 16: EVAL and PREDICT with shards that are empty at run time.

25 examples in batches of 12 with an unknown batch dimension: the last batch
has one example, so every tower but tower 0 gets an empty shard there (1/0/0
on 3 towers). Such a tower must not run the model_fn's computations on an
empty batch: a `py_func` that divides by the batch length (as the upstream
Transformer's BLEU metric) must not fail or give NaN, and metrics and
predictions must equal the plain model_fn's. A py_func may mix the batch's
rows (issue 33, `row_dependence`), so in EVAL that model_fn runs on the whole
batch: its metrics are plain's, the per-batch scalar's too; its predictions
still come from the towers.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn

ModeKeys = tf.estimator.ModeKeys
NUM_EXAMPLES = 25
BATCH = 12
DEVICE_COUNTS = [2, 3, 5]


def _data():
  x, _ = testlib.data(NUM_EXAMPLES, seed=3)
  y = np.random.RandomState(4).rand(NUM_EXAMPLES).astype(np.float32)
  return x, y


def _input_fn():
  x, y = _data()
  return tf.data.Dataset.from_tensor_slices(({'x': x, 'y': y}, y)).batch(BATCH)


def _doubled(y):
  """Per example; a ZeroDivisionError on an empty batch."""
  n = len(y)
  return (y * 2 * (n / n)).astype(np.float32)


def _batch_mean(y):
  """Per batch; NaN on an empty batch."""
  return np.sum(y, dtype=np.float64) / len(y)


def py_func_model_fn(features, labels, mode):
  prediction = tf.compat.v1.layers.dense(
      features['x'], 1, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))[:, 0]
  doubled = tf.reshape(tf.compat.v1.py_func(_doubled, [features['y']], tf.float32), [-1])
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'prediction': prediction,
                                                         'doubled': doubled})
  loss = tf.compat.v1.losses.mean_squared_error(labels, prediction)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'doubled': tf.compat.v1.metrics.mean(doubled),
        'batch_mean': tf.compat.v1.metrics.mean(
            tf.compat.v1.py_func(_batch_mean, [labels], tf.float64)),
        'mse': tf.compat.v1.metrics.mean_squared_error(labels, prediction),
    })
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _reference_input_fn():
  x, y = testlib.data(NUM_EXAMPLES, seed=5)
  return testlib.input_fn(x, y, BATCH)()


_INPUTS = {py_func_model_fn: _input_fn, testlib.v1_model_fn: _reference_input_fn}


@functools.lru_cache(maxsize=None)
def _trained_plain(model_fn):
  """The plain model_fn after one step on its input (shared by the device counts)."""
  plain = testlib.make_estimator(model_fn)
  plain.train(_INPUTS[model_fn], steps=1)
  return plain


@functools.lru_cache(maxsize=None)
def _plain_metrics(model_fn):
  return _trained_plain(model_fn).evaluate(_INPUTS[model_fn], name='plain')


@functools.lru_cache(maxsize=None)
def _plain_predictions(model_fn):
  return list(_trained_plain(model_fn).predict(_INPUTS[model_fn]))


def _towered(model_fn, num_devices, model_dir):
  return testlib.make_estimator(
      replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices)),
      num_cpus=num_devices, model_dir=model_dir)


def _shard_means(num_devices):
  """The non-empty shards' means of y, batch after batch, in input order."""
  _, y = _data()
  means = []
  for start in range(0, NUM_EXAMPLES, BATCH):
    batch = y[start:start + BATCH]
    q, r = divmod(len(batch), num_devices)
    sizes = [q + (k < r) for k in range(num_devices)]
    bounds = np.cumsum([0] + sizes)
    means += [batch[a:b].astype(np.float64).mean() for a, b in zip(bounds, bounds[1:]) if b > a]
  return means


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_py_func_metrics_evaluate_like_plain(num_devices):
  expected = _plain_metrics(py_func_model_fn)
  metrics = _towered(py_func_model_fn, num_devices,
                     _trained_plain(py_func_model_fn).model_dir).evaluate(
      _input_fn, name='towered')
  assert sorted(metrics) == sorted(expected)
  # A py_func of the batch's rows may mix them (row_dependence): the model_fn
  # evaluates on the whole batch, so even the metric of a per-batch scalar is plain's
  # (it was the mean of the non-empty shards' values before issue 33).
  for key in ('doubled', 'mse', 'loss', 'global_step', 'batch_mean'):
    testlib.assert_close(metrics[key], expected[key], err_msg=key)
  assert not np.isclose(expected['batch_mean'], np.mean(_shard_means(num_devices)))


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_predictions_in_order_like_plain(num_devices):
  expected = _plain_predictions(py_func_model_fn)
  predicted = list(_towered(py_func_model_fn, num_devices,
                            _trained_plain(py_func_model_fn).model_dir).predict(_input_fn))
  assert len(predicted) == len(expected) == NUM_EXAMPLES
  for key in ('prediction', 'doubled'):
    testlib.assert_close([p[key] for p in predicted], [p[key] for p in expected], err_msg=key)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_reference_model_metrics_equal_plain(num_devices):
  expected = _plain_metrics(testlib.v1_model_fn)
  metrics = _towered(testlib.v1_model_fn, num_devices,
                     _trained_plain(testlib.v1_model_fn).model_dir).evaluate(
                         _reference_input_fn, name='towered')
  assert sorted(metrics) == sorted(expected)
  for key in expected:
    testlib.assert_close(metrics[key], expected[key], err_msg=key)
