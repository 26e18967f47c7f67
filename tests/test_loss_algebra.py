"""Every loss of the batch's statistics trains as on one device (loss_algebra).

Padded sequences split their tokens unevenly across shards: a loss that divides
by the number of tokens (or by a sum of weights, or by a count of non-zero
weights), or adds several such terms, or a regulariser, is rebuilt on the whole
batch's statistics. Every check compares the towered model_fn with the plain
one trained as a plain Estimator trains it (testlib.plain_train_and_read) on the
same data: variables and optimizer slots
after 1 and 3 steps (one train() call), the loss each step reports, and the EVAL loss on one
checkpoint, within |d| <= 1e-5 * max(1, |plain|). Shards: 3 towers, 3
micro-batches on one device, 2 devices x 2 micro-batches; each layout has a
shard that is all padding.
"""

import functools
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import testlib
import estimator_towers as et
from estimator_towers.base import logs
from estimator_towers.loss import micro_batch_seeds as seeds

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


def _features_only_input_fn():
  """As BERT's pre-training input_fn: the targets are features, labels are None."""
  features, targets = _data()
  return tf.data.Dataset.from_tensor_slices(dict(features, masked_lm_ids=targets)).batch(BATCH)


def _logits(tokens):
  embedding = tf.compat.v1.get_variable(
      'embedding', [VOCAB, 8], initializer=tf.compat.v1.random_normal_initializer(seed=1))
  hidden = tf.nn.embedding_lookup(embedding, tokens)
  # The regulariser counts only where a loss takes it (get_total_loss).
  return tf.compat.v1.layers.dense(
      hidden, VOCAB, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=3),
      kernel_regularizer=lambda w: 0.05 * tf.nn.l2_loss(w))


def _xent(labels, logits):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)


def _ratio(values, weights):
  return tf.reduce_sum(values * weights) / tf.reduce_sum(weights)


def _padded(labels, logits, mask, features):
  """tensorflow/models' Transformer: sum(xent * w) / sum(w), w the non-padding mask."""
  return _ratio(_xent(labels, logits), mask)


def _bert(labels, logits, mask, features):
  """BERT's masked-LM loss: sum(w * l) / (sum(w) + 1e-5)."""
  log_probs = tf.nn.log_softmax(logits, axis=-1)
  per_example_loss = -tf.reduce_sum(log_probs * tf.one_hot(labels, VOCAB), axis=-1)
  weights = features['lm_weights']
  numerator = tf.reduce_sum(weights * per_example_loss)
  denominator = tf.reduce_sum(weights) + 1e-5
  return numerator / denominator


def _bert_pretraining(labels, logits, mask, features):
  """BERT's run_pretraining total loss: the masked-LM ratio plus a next-sentence mean."""
  nsp_logits = tf.compat.v1.layers.dense(
      tf.reduce_mean(logits, axis=1), 2, name='next_sentence',
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=4))
  nsp_labels = tf.math.floormod(features['tokens'][:, 0], 2)
  log_probs = tf.nn.log_softmax(nsp_logits, axis=-1)
  nsp = tf.reduce_mean(-tf.reduce_sum(tf.one_hot(nsp_labels, 2) * log_probs, axis=-1))
  return _bert(labels, logits, mask, features) + nsp


def _two_ratios(labels, logits, mask, features):
  """Multi-task: two token ratios over different masks (one with BERT's + 1e-5)."""
  xent = _xent(labels, logits)
  weights = features['lm_weights']
  second = tf.reduce_sum(xent * weights) / (tf.reduce_sum(weights) + 1e-5)
  return _ratio(xent, mask) + 0.5 * second


def _total_loss(labels, logits, mask, features):
  """The Estimator pattern: a weighted tf.compat.v1.losses loss + a kernel_regularizer."""
  tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits, weights=mask)
  return tf.compat.v1.losses.get_total_loss()


def _ratio_plus_mean(labels, logits, mask, features):
  """0.7 * a token ratio + 0.3 * reduce_mean over every position."""
  xent = _xent(labels, logits)
  return 0.7 * _ratio(xent, mask) + 0.3 * tf.reduce_mean(xent)


def _z_loss(labels, logits, mask, features):
  """T5-style: the token ratio + c * sum(w * logz^2) / sum(w)."""
  log_z = tf.reduce_logsumexp(logits, axis=-1)
  return _ratio(_xent(labels, logits), mask) + 1e-2 * _ratio(tf.square(log_z), mask)


def _weighted_mean_plus_mean(labels, logits, mask, features):
  """compute_weighted_loss(reduction=MEAN) (a DivNoNan by sum(w)) + a per-example mean."""
  xent = _xent(labels, logits)
  weighted = tf.compat.v1.losses.compute_weighted_loss(
      xent, weights=mask, reduction=tf.compat.v1.losses.Reduction.MEAN)
  return weighted + tf.reduce_mean(tf.reduce_sum(xent, axis=1))


def _mean_plus_l2(labels, logits, mask, features):
  """A mean plus an L2 penalty: the example-count rule is exact, and nothing warns."""
  penalty = 1e-2 * tf.add_n([tf.nn.l2_loss(v) for v in tf.compat.v1.trainable_variables()])
  return tf.reduce_mean(_xent(labels, logits)) + penalty


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


def _max_loss(labels, logits, mask, features):
  """The worst example's loss: a max over the batch, which no sum of shards gives (its head
  runs on the whole batch: `whole_batch_head`)."""
  return tf.reduce_max(tf.reduce_sum(_xent(labels, logits) * mask, axis=1))


def _max_of_ratios(labels, logits, mask, features):
  """The larger of two token ratios: a max of statistics (rebuilt), not over the batch."""
  xent = _xent(labels, logits)
  weights = features['lm_weights']
  second = tf.reduce_sum(xent * weights) / (tf.reduce_sum(weights) + 1e-5)
  return tf.reduce_max(tf.stack([_ratio(xent, mask), 2.0 * second]))


def _adam(loss):
  # epsilon 1e-6 (BERT's): with TensorFlow's default 1e-8, Adam's first step
  # maps a gradient component that nearly cancels (8e-7, from terms of 1e-3:
  # two_ratios' embedding[5, 7]) through a slope of 2.4e4, so the float32
  # rounding of the sum's order (9e-10) moved that weight by 2.3e-5.
  optimizer = tf.compat.v1.train.AdamOptimizer(0.1, epsilon=1e-6)
  return optimizer.minimize(loss, tf.compat.v1.train.get_global_step())


def _bert_optimizer(loss):
  """BERT's optimization.py: tf.gradients, active global-norm clipping, AdamWeightDecay."""
  global_step = tf.compat.v1.train.get_global_step()
  tvars = tf.compat.v1.trainable_variables()
  grads = [tf.convert_to_tensor(g) for g in tf.gradients(loss, tvars)]  # BERT's tf.multiply does
  grads, _ = tf.clip_by_global_norm(grads, clip_norm=0.1)
  train_op = testlib.AdamWeightDecayOptimizer(0.05).apply_gradients(zip(grads, tvars))
  return tf.group(train_op, global_step.assign(global_step + 1))


def _model_fn(loss_fn, features, labels, mode, optimizer=_adam):
  if labels is None:  # BERT's pre-training: the targets come as a feature
    labels = features['masked_lm_ids']
  tokens = features['tokens']
  mask = tf.cast(tf.not_equal(tokens, 0), tf.float32)
  logits = _logits(tokens)
  loss = loss_fn(labels, logits, mask, features)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer(loss))


# name -> (loss, optimizer)
LOSSES = {
    'padded': (_padded, _adam),
    'bert': (_bert, _adam),
    'bert_pretraining': (_bert_pretraining, _bert_optimizer),
    'two_ratios': (_two_ratios, _adam),
    'total_loss': (_total_loss, _adam),
    'ratio_plus_mean': (_ratio_plus_mean, _adam),
    'z_loss': (_z_loss, _adam),
    'weighted_mean_plus_mean': (_weighted_mean_plus_mean, _adam),
    'mean_plus_l2': (_mean_plus_l2, _adam),
    'v1_losses': (_v1_losses, _adam),
    'v1_weighted_mean': (_v1_weighted_mean, _adam),
    'keras': (_keras, _adam),
    'per_example': (_per_example, _adam),
    'declared': (_declared, _adam),
    # a max over the batch: its head on the whole batch (was the towers' maxes, and a warning)
    'max_over_the_batch': (_max_loss, _adam),
    'max_of_ratios': (_max_of_ratios, _adam),
}
# Fed features only (labels None), as BERT's run_pretraining feeds them.
FEATURES_ONLY = ('bert_pretraining',)


def _input_of(name):
  return _features_only_input_fn if name in FEATURES_ONLY else _input_fn


# The patterns of several terms, trained on every layout.
TERMS = ('padded', 'bert_pretraining', 'two_ratios', 'total_loss', 'ratio_plus_mean',
         'z_loss', 'weighted_mean_plus_mean', 'max_over_the_batch')
# Shards of batch 1 (lengths 6 6 5 | 1 2 0 | 0 0, and 6 6 | 5 1 | 2 0 | 0 0):
# each layout has a shard that is all padding.
LAYOUTS = {
    '3_towers': dict(devices=testlib.cpu_devices(3)),
    'micro_batches_3': dict(devices=['/cpu:0'], micro_batches=3),
    '2_devices_x_2_micro_batches': dict(devices=testlib.cpu_devices(2), micro_batches=2),
}


def _plain_model_fn(name):
  loss_fn, optimizer = LOSSES[name]
  return functools.partial(_model_fn, loss_fn, optimizer=optimizer)


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


def _run(model_fn, num_cpus=1, model_dir=None, input_fn=_input_fn):
  """Variables after step 1 and step 3 of one train() call (batches 1, 2, 3),
  the estimator, and the loss each of the 3 steps reported."""
  est = testlib.stepwise_estimator(model_fn, num_cpus=num_cpus, model_dir=model_dir)
  reported = ReportedLoss()
  after_1, after_3 = testlib.train_and_read(est, input_fn, hooks=[reported])
  return after_1, after_3, est, reported.values


def _run_plain(model_fn, input_fn=_input_fn):
  """`_run` of a plain model_fn (testlib.plain_train_and_read: no Estimator trains it);
  the estimator: a plain one on its checkpoints (the latest: step 3)."""
  model_dir = tempfile.mkdtemp(prefix='et_')
  reported = ReportedLoss()
  after_1, after_3 = testlib.plain_train_and_read(model_fn, input_fn, hooks=[reported],
                                                  model_dir=model_dir)
  return after_1, after_3, testlib.make_estimator(model_fn, model_dir=model_dir), reported.values


@functools.lru_cache(maxsize=None)
def _plain(name):
  return _run_plain(_plain_model_fn(name), input_fn=_input_of(name))


@functools.lru_cache(maxsize=None)
def _plain_eval_loss(name):
  """The plain model_fn's EVAL loss on its checkpoint of step 3, the three batches."""
  return _plain(name)[2].evaluate(_input_of(name), name='plain')['loss']


def _check_like_plain(name, num_cpus, **settings):
  plain_1, plain_3, plain, plain_losses = _plain(name)
  assert plain_3['global_step'] == 3
  towered_fn = et.replicate_model_fn(_plain_model_fn(name), **settings)
  towered_1, towered_3, _, towered_losses = _run(towered_fn, num_cpus, input_fn=_input_of(name))
  _assert_rule(towered_1, plain_1)
  _assert_rule(towered_3, plain_3)
  # The loss each training step reports (logged, summarised).
  assert len(towered_losses) == len(plain_losses) == 3
  testlib.assert_close(towered_losses, plain_losses, err_msg='reported training loss')
  # EVAL on the plain checkpoint, over the same three batches.
  towered = testlib.make_estimator(towered_fn, num_cpus=num_cpus, model_dir=plain.model_dir)
  expected = _plain_eval_loss(name)
  actual = towered.evaluate(_input_of(name), name='towered')['loss']
  assert abs(actual - expected) <= 1e-5 * max(1.0, abs(expected)), (actual, expected)


@pytest.fixture
def warnings(monkeypatch):
  """The warnings logged while the test runs (each test sees its own)."""
  monkeypatch.setattr(logs, '_warned', set())
  found = []
  monkeypatch.setattr(logs, 'warning', lambda fmt, *a: found.append(fmt % a))
  return found


def _algebra_warnings(found):
  return [w for w in found if 'loss algebra' in w or 'built no matching' in w]


@pytest.mark.parametrize('name', sorted(set(LOSSES) - set(TERMS)))
def test_single_terms_on_towers_equal_plain(name, warnings):
  """3 towers: tokens 17/3/0 (an all-padding shard), then uneven, then an empty shard. (2
  towers, 18/2 tokens and 3/0, split them unevenly the same way: the several terms' 2 x 2
  layout runs on 2 devices.)"""
  _check_like_plain(name, 3, devices=testlib.cpu_devices(3))
  assert not _algebra_warnings(warnings)


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
@pytest.mark.parametrize('name', TERMS)
def test_losses_of_several_terms_equal_plain(name, layout, warnings):
  """Every pattern on towers, micro-batches and both; no warning: each is rebuilt exactly."""
  settings = LAYOUTS[layout]
  _check_like_plain(name, len(settings['devices']), **settings)
  assert not _algebra_warnings(warnings)


def test_bert_clipping_is_active():
  """The global norm BERT's optimizer clips to 0.1 is larger than that at the start."""
  with tf.Graph().as_default():
    features, labels = tf.compat.v1.data.make_one_shot_iterator(_input_fn()).get_next()
    loss = _model_fn(_bert_pretraining, features, labels, ModeKeys.EVAL).loss
    norm = tf.linalg.global_norm(tf.gradients(loss, tf.compat.v1.trainable_variables()))
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      assert session.run(norm) > 0.5


def test_undeclared_denominator_warns_once_naming_the_op(warnings):
  """Without loss_denominator, the MatMul count is not recognised: one warning that
  names it, and the example-count rule, so tower 2's all-padding shard, 0 / 0,
  makes the loss NaN."""
  towered_fn = et.replicate_model_fn(functools.partial(_model_fn, _undeclared, optimizer=_adam),
                                     devices=testlib.cpu_devices(3))
  with pytest.raises(tf.compat.v1.train.NanLossDuringTrainingError):
    _run(towered_fn, 3)
  found = _algebra_warnings(warnings)
  assert len(found) == 1, found
  assert "MatMul op 'Tensordot/MatMul'" in found[0], found[0]
  assert 'weighted by their share of the examples instead' in found[0]
  assert "loss_reduction='exact'" in found[0]


def test_loss_reduction_exact_makes_the_warning_an_error():
  towered_fn = et.replicate_model_fn(functools.partial(_model_fn, _undeclared, optimizer=_adam),
                                     devices=testlib.cpu_devices(2), loss_reduction='exact')
  with pytest.raises(ValueError, match=r"computed from MatMul op 'Tensordot/MatMul'.*"
                                       r"loss_reduction='exact' makes this an error"):
    testlib.make_estimator(towered_fn, num_cpus=2).train(_input_fn, steps=1)


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
  plain_1, plain_3, _, _ = _plain('padded')
  plan = et.make_plan(devices=testlib.cpu_devices(3), variable_strategy=variable_strategy,
                      staging_depth=staging_depth)
  towered_fn = et.replicate_model_fn(_plain_model_fn('padded'), plan=plan)
  est = testlib.stepwise_estimator(towered_fn, num_cpus=3)
  input_fn = et.staged_input_fn(_input_fn, plan) if staging_depth else _input_fn
  towered_1, towered_3 = testlib.train_and_read(est, input_fn)
  _assert_rule(towered_1, plain_1)
  _assert_rule(towered_3, plain_3)


def _self_normalised(labels, logits, mask, features):
  """Divides by a sum of trained values: its gradient needs the whole batch's sum."""
  xent = _xent(labels, logits)
  return tf.reduce_sum(xent * mask) / tf.reduce_sum(tf.sqrt(xent) * mask)


def test_error_micro_batches_with_a_normaliser_of_trained_values():
  towered = et.replicate_model_fn(functools.partial(_model_fn, _self_normalised, optimizer=_adam),
                                  devices=testlib.cpu_devices(2), micro_batches=2)
  with pytest.raises(ValueError, match=r'micro_batches > 1 cannot train the loss .* exactly: '
                                       r'its gradient with respect to the statistic'):
    _run(towered, num_cpus=2)


def test_self_normalised_loss_on_towers_equals_plain():
  """The same loss on towers alone is exact (one backward pass through the whole loss)."""
  plain_1, _, _, _ = _run_plain(functools.partial(_model_fn, _self_normalised, optimizer=_adam))
  towered = et.replicate_model_fn(functools.partial(_model_fn, _self_normalised, optimizer=_adam),
                                  devices=testlib.cpu_devices(3))
  towered_1, _, _, _ = _run(towered, num_cpus=3)
  _assert_rule(towered_1, plain_1)


def _random_normaliser(labels, logits, mask, features):
  """A normaliser made from the inputs through a random op."""
  noise = tf.random.stateless_uniform(tf.shape(mask), seed=[1, 2])
  keep = tf.cast(noise < 2.0, tf.float32) * mask     # always the mask, but stateful-free
  count = tf.reduce_sum(keep * tf.random.uniform(tf.shape(mask), 1.0, 1.0 + 1e-9))
  return tf.reduce_sum(_xent(labels, logits) * mask) / count


def test_error_micro_batches_with_a_stateful_normaliser():
  """Drawn per shard, a random op is stateful (keyed draws are not)."""
  towered = et.replicate_model_fn(functools.partial(_model_fn, _random_normaliser, optimizer=_adam),
                                  devices=['/cpu:0'], micro_batches=2, random_draws='per_shard')
  with pytest.raises(ValueError, match=r'micro_batches > 1: the loss .* through the stateful '
                                       r'op .*RandomUniform'):
    _run(towered, num_cpus=1)


def _masked_mean(labels, logits, mask, features):
  """The mean over real tokens by tf.boolean_mask: its count is not per example."""
  return tf.reduce_mean(tf.boolean_mask(_xent(labels, logits), mask > 0))


def test_masked_mean_on_towers_equals_plain():
  plain_1, _, _, _ = _run_plain(functools.partial(_model_fn, _masked_mean, optimizer=_adam))
  towered = et.replicate_model_fn(functools.partial(_model_fn, _masked_mean, optimizer=_adam),
                                  devices=testlib.cpu_devices(3))
  towered_1, _, _, _ = _run(towered, num_cpus=3)
  _assert_rule(towered_1, plain_1)


def test_error_micro_batches_with_a_count_of_value_dependent_rows():
  towered = et.replicate_model_fn(functools.partial(_model_fn, _masked_mean, optimizer=_adam),
                                  devices=['/cpu:0'], micro_batches=2)
  with pytest.raises(ValueError, match=r'micro_batches > 1 cannot train the loss .* exactly: '
                                       r'it divides by the element count of .*whose rows '
                                       r'depend on values'):
    _run(towered, num_cpus=1)


def test_run_time_check_of_a_count_not_proportional_to_examples(monkeypatch):
  """Where the graph does not show it (here: the Where check patched out), the
  step fails instead of training with a wrong count."""
  monkeypatch.setattr(seeds, '_check_per_example', lambda expression: None)
  towered = et.replicate_model_fn(functools.partial(_model_fn, _masked_mean, optimizer=_adam),
                                  devices=['/cpu:0'], micro_batches=2)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r'with micro_batches > 1 the whole batch.*counts are not '
                           r'proportional to their examples'):
    _run(towered, num_cpus=1)


def _branching(labels, logits, mask, features):
  """Tower 0's normaliser is a sum; the other towers' a sum plus 0 (another op)."""
  count = tf.reduce_sum(mask)
  if et.current_tower().index > 0:
    count = count + 0.0
  return tf.reduce_sum(_xent(labels, logits) * mask) / tf.maximum(count, 1.0)


def test_a_shard_without_the_statistic_warns(warnings):
  towered_fn = et.replicate_model_fn(functools.partial(_model_fn, _branching, optimizer=_adam),
                                     devices=testlib.cpu_devices(2))
  testlib.make_estimator(towered_fn, num_cpus=2).train(_input_fn, steps=1)
  found = _algebra_warnings(warnings)
  assert len(found) == 1, found
  assert 'but shard 1 built no matching tensor' in found[0], found[0]
