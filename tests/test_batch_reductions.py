"""Reductions over the batch that no sum of the shards' statistics gives.

A max, a min, an arg-max, a product, `reduce_all` / `reduce_any` over the
batch axis, a logsumexp over the batch (a Max, a StopGradient, Exp, Sum, Log)
and a sort (`TopKV2`) are mixing ops (`rows/statistics.py`): a loss that
reads them trains through its head on the whole batch (`whole_batch_head`,
with micro-batches on a first pass's rows: `cached_gradients`), exactly as
the plain model_fn on the whole batch, without a warning. Sums, means and
`L2Loss` over the batch stay statistics (`loss_algebra` rebuilds them).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import cross_example_models as patterns
import testlib
import estimator_towers as et

ModeKeys = tf.estimator.ModeKeys
NUM_EXAMPLES, BATCH = 22, 10   # batches of 10, 10, 2: on 3 towers 4/3/3, then 1/1/0


def _xent(x, y):
  hidden = tf.nn.tanh(patterns.dense(x, 8, 'hidden'))
  logits = patterns.dense(hidden, 3, 'logits')
  return logits, tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)


def reduce_max(x, y):
  _, xent = _xent(x, y)
  return tf.reduce_mean(xent) + 0.5 * tf.reduce_max(xent)


def reduce_min(x, y):
  _, xent = _xent(x, y)
  return tf.reduce_mean(xent) + 0.5 * tf.reduce_min(xent)


def argmax_rows(x, y):
  """The cross-entropy of the example whose first logit is the batch's largest."""
  logits, xent = _xent(x, y)
  return tf.reduce_mean(xent) + 0.5 * tf.gather(xent, tf.argmax(logits[:, 0]))


def logsumexp(x, y):
  _, xent = _xent(x, y)
  return tf.reduce_mean(xent) + 0.5 * tf.reduce_logsumexp(xent)


def reduce_prod(x, y):
  _, xent = _xent(x, y)
  return tf.reduce_mean(xent) + 0.5 * tf.reduce_prod(1.0 + 0.1 * xent)


def reduce_any(x, y):
  """A weight that is 2 where any example of the batch has a cross-entropy over 1.2."""
  _, xent = _xent(x, y)
  return tf.reduce_mean(xent) * (1.0 + tf.cast(tf.reduce_any(xent > 1.2), tf.float32))


def reduce_all(x, y):
  _, xent = _xent(x, y)
  return tf.reduce_mean(xent) * (1.0 + tf.cast(tf.reduce_all(xent > 0.6), tf.float32))


def sort(x, y):
  """The mean of the batch's two largest cross-entropies, from a sort of the batch."""
  _, xent = _xent(x, y)
  return tf.reduce_mean(xent) + 0.5 * tf.reduce_mean(tf.sort(xent, direction='DESCENDING')[:2])


REDUCTIONS = {f.__name__: f for f in (reduce_max, reduce_min, argmax_rows, logsumexp)}
OTHERS = {f.__name__: f for f in (reduce_prod, reduce_any, reduce_all, sort)}


def _model_fn(loss_fn, features, labels, mode):
  if labels is None:   # features a Tensor, no labels
    features, labels = {'x': features}, tf.cast(features[:, 0] > 0, tf.int32)
  loss = loss_fn(features['x'], labels)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _input_fn(labels=True):
  rng = np.random.RandomState(3)
  x = rng.randn(NUM_EXAMPLES, patterns.F).astype(np.float32)
  y = (np.arange(NUM_EXAMPLES) % 3).astype(np.int32)
  if not labels:
    return lambda: tf.data.Dataset.from_tensor_slices(x).batch(BATCH)
  return lambda: tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(BATCH)


def _loss_fn(name):
  return {**REDUCTIONS, **OTHERS}[name]


@functools.lru_cache(maxsize=None)
def _plain(name, labels=True):
  model_fn = functools.partial(_model_fn, _loss_fn(name))
  return tuple(testlib.plain_train_and_read(model_fn, _input_fn(labels)))


def _towered(name, num_devices, micro_batches, labels=True):
  model_fn = et.replicate_model_fn(functools.partial(_model_fn, _loss_fn(name)),
                                   devices=testlib.cpu_devices(num_devices),
                                   micro_batches=micro_batches)
  est = testlib.stepwise_estimator(model_fn, num_cpus=num_devices)
  return tuple(testlib.train_and_read(est, _input_fn(labels)))


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


def _assert_as_plain(name, num_devices, micro_batches, warnings, labels=True):
  plain_1, plain_3 = _plain(name, labels)
  towered_1, towered_3 = _towered(name, num_devices, micro_batches, labels)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not warnings, warnings


LAYOUTS = {'3 towers': (3, 1), '1x2': (1, 2), '2x2': (2, 2)}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
@pytest.mark.parametrize('name', sorted(REDUCTIONS))
def test_a_reduction_over_the_batch_trains_as_plain(name, layout, warnings):
  """3 towers (4/3/3, then 1/1/0: an empty shard), 1 x 2 and 2 x 2 micro-batches, Momentum."""
  _assert_as_plain(name, *LAYOUTS[layout], warnings)


@pytest.mark.parametrize('name,layout', [(name, '3 towers') for name in sorted(OTHERS)]
                         + [('reduce_any', '1x2')])
def test_other_reductions_over_the_batch_train_as_plain(name, layout, warnings):
  """A product, a logical or / and (whose comparison, read by the head, has no gradient), a
  sort."""
  _assert_as_plain(name, *LAYOUTS[layout], warnings)


@pytest.mark.parametrize('name', ['reduce_max', 'logsumexp'])
def test_three_micro_batches_and_features_a_tensor_labels_none(name, warnings):
  _assert_as_plain(name, 1, 3, warnings, labels=False)


# --- How the row reader reads them ----------------------------------------------

def _kinds(make):
  """(the kind of `make(x)`, the mixing ops' descriptions) on a shard x of [None, 3]."""
  from estimator_towers.rows import row_dependence as rd  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 3])
    out = make(x)
    found = rd.classify([out], [x])
    return found.kind(out).tag, [m.describe() for m in found.mixing]


@pytest.mark.parametrize('make,op,what', [
    (lambda x: tf.reduce_max(x, 0), 'Max', 'a max'),
    (lambda x: tf.reduce_max(x), 'Max', 'a max'),
    (lambda x: tf.reduce_min(x, 0), 'Min', 'a min'),
    (lambda x: tf.argmax(x, 0), 'ArgMax', 'an arg-max'),
    (lambda x: tf.argmin(x[:, 0]), 'ArgMin', 'an arg-min'),
    (lambda x: tf.reduce_prod(x, 0), 'Prod', 'a product'),
    (lambda x: tf.reduce_any(x > 0, 0), 'Any', 'a logical or'),
    (lambda x: tf.reduce_all(x > 0), 'All', 'a logical and'),
    (lambda x: tf.reduce_logsumexp(x, 0), 'Max', 'a max'),
    (lambda x: tf.reduce_max(tf.transpose(x), 1), 'Max', 'a max'),   # columns
])
def test_reductions_over_the_batch_that_are_not_sums_mix(make, op, what):
  tag, mixing = _kinds(make)
  assert tag == 'mixed'
  assert mixing[0].startswith(f'{op} op ') and mixing[0].endswith(
      f"({what} over the batch, which no sum of the shards' statistics gives)"), mixing


@pytest.mark.parametrize('make,tag', [
    (lambda x: tf.reduce_sum(x, 0), 'statistic'),
    (lambda x: tf.reduce_mean(x), 'statistic'),
    (tf.nn.l2_loss, 'statistic'),
    (lambda x: tf.nn.moments(x, [0])[1], 'statistic'),   # a batch norm's
    (lambda x: tf.reduce_max(x, 1), 'rows'),
    (lambda x: tf.argmax(x, 1), 'rows'),
    (lambda x: tf.reduce_logsumexp(x, 1), 'rows'),
    (lambda x: tf.reduce_max(tf.stack([tf.reduce_mean(x), tf.reduce_sum(x)])), 'statistic'),
])
def test_sums_and_reductions_within_rows_do_not_mix(make, tag):
  assert _kinds(make) == (tag, [])
