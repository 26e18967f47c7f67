"""Losses normalised by something other than the example count, against plain.

Padded sequences split their tokens unevenly across towers: a loss that divides
by the number of tokens (or by the sum of weights, or by the count of non-zero
weights) weighs tower k by its share of that denominator, not of the examples.
Every check compares the towered model_fn with the plain one run by a plain
Estimator on the same data: variables and Adam slots after 1 and 1 + 3 steps,
and the EVAL loss on one checkpoint, within |d| <= 1e-5 * max(1, |plain|).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import testlib
import estimator_towers as et

ModeKeys = tf.estimator.ModeKeys
VOCAB = 11
TIME = 6
BATCH = 8
# Tokens per example. Batch 1: with 3 towers the shards hold 17, 3 and 0
# tokens (tower 2's shard is all padding). Batch 2: uneven. Batch 3 (2
# examples): with 3 towers, 3 / 0 tokens and an empty shard.
LENGTHS = [6, 6, 5, 1, 2, 0, 0, 0,
           6, 5, 6, 4, 3, 6, 1, 1,
           3, 0]


def _data():
  rng = np.random.RandomState(7)
  n = len(LENGTHS)
  mask = (np.arange(TIME)[None, :] < np.array(LENGTHS)[:, None]).astype(np.float32)
  tokens = (rng.randint(1, VOCAB, size=(n, TIME)) * mask).astype(np.int32)
  targets = (rng.randint(0, VOCAB, size=(n, TIME)) * mask).astype(np.int32)
  # BERT's masked-LM weights: some of the real tokens (none in some examples).
  lm_weights = (mask * (rng.rand(n, TIME) < 0.5)).astype(np.float32)
  return {'tokens': tokens, 'lm_weights': lm_weights}, targets


def _input_fn():
  features, targets = _data()
  return tf.data.Dataset.from_tensor_slices((features, targets)).batch(BATCH)


def _logits(tokens):
  embedding = tf.compat.v1.get_variable(
      'embedding', [VOCAB, 8], initializer=tf.compat.v1.random_normal_initializer(seed=1))
  hidden = tf.nn.embedding_lookup(embedding, tokens)
  return tf.compat.v1.layers.dense(
      hidden, VOCAB, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=3))


def _xent(labels, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def _padded(labels, logits, mask, features):
  """tensorflow/models' Transformer: sum(xent * w) / sum(w), w the non-padding mask."""
  return tf.reduce_sum(_xent(labels, logits) * mask) / tf.reduce_sum(mask)


def _bert(labels, logits, mask, features):
  """BERT's masked-LM loss: sum(w * l) / (sum(w) + 1e-5)."""
  log_probs = tf.nn.log_softmax(logits, axis=-1)
  per_example_loss = -tf.reduce_sum(log_probs * tf.one_hot(labels, VOCAB), axis=-1)
  weights = features['lm_weights']
  numerator = tf.reduce_sum(weights * per_example_loss)
  denominator = tf.reduce_sum(weights) + 1e-5
  return numerator / denominator


def _v1_losses(labels, logits, mask, features):
  """The default reduction, SUM_BY_NONZERO_WEIGHTS."""
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits, weights=mask)


def _v1_weighted_mean(labels, logits, mask, features):
  """Reduction.MEAN: divides by the sum of the weights."""
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(
      labels, logits, weights=mask * 2.0, reduction=tf.compat.v1.losses.Reduction.MEAN)


def _keras(labels, logits, mask, features):
  """SUM_OVER_BATCH_SIZE divides by the element count: the example-count rule."""
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  return loss(labels, logits, sample_weight=mask)


def _per_example(labels, logits, mask, features):
  """Token losses summed, divided by the example count tf.shape(x)[0]."""
  examples = tf.cast(tf.shape(features['tokens'])[0], tf.float32)
  return tf.reduce_sum(_xent(labels, logits) * mask) / examples


def _token_count(mask):
  """sum(mask * mask) = the token count, computed by a matrix product (a MatMul)."""
  flat = tf.reshape(mask, [-1])
  return tf.tensordot(flat, flat, 1)


def _declared(labels, logits, mask, features):
  """A token count the library cannot recognise, declared with loss_denominator."""
  count = _token_count(mask)
  return tf.reduce_sum(_xent(labels, logits) * mask) / et.loss_denominator(count)


def _undeclared(labels, logits, mask, features):
  count = _token_count(mask)
  return tf.reduce_sum(_xent(labels, logits) * mask) / count


def _model_fn(loss_fn, features, labels, mode):
  tokens = features['tokens']
  mask = tf.cast(tf.not_equal(tokens, 0), tf.float32)
  logits = _logits(tokens)
  loss = loss_fn(labels, logits, mask, features)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  optimizer = tf.compat.v1.train.AdamOptimizer(0.1)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


LOSSES = {'padded': _padded, 'bert': _bert, 'v1_losses': _v1_losses,
          'v1_weighted_mean': _v1_weighted_mean, 'keras': _keras,
          'per_example': _per_example, 'declared': _declared}


def _assert_rule(actual: dict, expected: dict) -> None:
  """|d| <= 1e-5 * max(1, |plain|) for every variable and slot."""
  assert sorted(actual) == sorted(expected)
  for name, plain in expected.items():
    plain = np.asarray(plain, dtype=np.float64)
    d = np.abs(np.asarray(actual[name], dtype=np.float64) - plain)
    worst = float(np.max(d / np.maximum(1.0, np.abs(plain)), initial=0.0))
    assert worst <= 1e-5, f'{name}: {worst:.3g}'
    assert np.all(np.isfinite(actual[name])), name


class ReportedLoss(tf.compat.v1.train.SessionRunHook):
  """The loss each training step reports (what the Estimator logs and summarises)."""

  def __init__(self):
    self.values: list[float] = []
    self._loss = None

  def begin(self):
    summaries = [op for op in tf.compat.v1.get_default_graph().get_operations()
                 if op.type == 'ScalarSummary' and op.name == 'loss']
    assert len(summaries) == 1, summaries
    self._loss = summaries[0].inputs[1]  # the spec's loss, as the Estimator got it

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._loss)

  def after_run(self, run_context, run_values):
    self.values.append(float(run_values.results))


def _run(model_fn, num_cpus=1, model_dir=None):
  """Variables after 1 step and after 3 more (batches 1; 1, 2, 3), the
  estimator, and the loss each of the 4 steps reported."""
  est = testlib.make_estimator(model_fn, num_cpus=num_cpus, model_dir=model_dir)
  reported = ReportedLoss()
  est.train(_input_fn, steps=1, hooks=[reported])
  after_1 = testlib.variables(est)
  est.train(_input_fn, steps=3, hooks=[reported])
  return after_1, testlib.variables(est), est, reported.values


@functools.lru_cache(maxsize=None)
def _plain(name):
  return _run(functools.partial(_model_fn, LOSSES[name]))


@pytest.mark.parametrize('num_devices', [2, 3])
@pytest.mark.parametrize('name', sorted(LOSSES))
def test_training_and_eval_loss_equal_plain(name, num_devices):
  plain_1, plain_4, plain, plain_losses = _plain(name)
  assert plain_4['global_step'] == 4
  towered_fn = et.replicate_model_fn(functools.partial(_model_fn, LOSSES[name]),
                                     devices=testlib.cpu_devices(num_devices))
  towered_1, towered_4, _, towered_losses = _run(towered_fn, num_devices)
  _assert_rule(towered_1, plain_1)
  _assert_rule(towered_4, plain_4)
  # The loss each training step reports (logged, summarised).
  assert len(towered_losses) == len(plain_losses) == 4
  testlib.assert_close(towered_losses, plain_losses, err_msg='reported training loss')
  # EVAL on the plain checkpoint, over the same three batches.
  towered = testlib.make_estimator(towered_fn, num_cpus=num_devices,
                                   model_dir=plain.model_dir)
  expected = plain.evaluate(_input_fn, name='plain')['loss']
  actual = towered.evaluate(_input_fn, name='towered')['loss']
  assert abs(actual - expected) <= 1e-5 * max(1.0, abs(expected)), (actual, expected)


def test_undeclared_denominator_falls_back_to_examples():
  """Without loss_denominator, the same loss is weighted by examples (with a
  warning), so tower 2's all-padding shard, 0 / 0, makes the loss NaN."""
  towered_fn = et.replicate_model_fn(functools.partial(_model_fn, _undeclared),
                                     devices=testlib.cpu_devices(3))
  with pytest.raises(tf.compat.v1.train.NanLossDuringTrainingError):
    _run(towered_fn, 3)


def test_loss_denominator_outside_towers_is_the_tensor_itself():
  with tf.Graph().as_default():
    count = tf.constant(3.0)
    assert et.loss_denominator(count) is count


def test_loss_denominator_needs_a_scalar():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r'loss_denominator\(d\) takes the scalar Tensor'):
      et.loss_denominator(tf.ones([2]))


@pytest.mark.parametrize('variable_strategy,staging_depth',
                         [('gpu', 0), ('replicated', 0), ('cpu', 1)])
def test_padded_tokens_with_other_strategies_and_staged_input(variable_strategy,
                                                              staging_depth):
  plain_1, plain_4, _, _ = _plain('padded')
  plan = et.make_plan(devices=testlib.cpu_devices(3), variable_strategy=variable_strategy,
                      staging_depth=staging_depth)
  towered_fn = et.replicate_model_fn(functools.partial(_model_fn, _padded), plan=plan)
  est = testlib.make_estimator(towered_fn, num_cpus=3)
  input_fn = et.staged_input_fn(_input_fn, plan) if staging_depth else _input_fn
  est.train(input_fn, steps=1)
  _assert_rule(testlib.variables(est), plain_1)
  est.train(input_fn, steps=3)
  _assert_rule(testlib.variables(est), plain_4)


def test_error_micro_batches_with_a_normalised_loss():
  """Each micro-batch's gradient would need the denominator of the micro-batches after it."""
  model_fn = functools.partial(_model_fn, _padded)
  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(2), micro_batches=2)
  with pytest.raises(ValueError, match=r'micro_batches > 1 cannot train a loss divided by a '
                                       r'denominator of its own batch.*Use micro_batches=1'):
    _run(towered, num_cpus=2)
