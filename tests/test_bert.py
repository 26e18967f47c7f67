"""google-research BERT's pre-training model_fn on towers: data-parallel and exact.

BERT (`bert-tensorflow`'s `run_pretraining.model_fn_builder`, tiny:
`bert_model.py`) reads its encoder's einsums (`rows/einsum.py`), its
reshapes of [n, T, d] to [n * T, d] and back with the batch size from
`tf.shape` or static, its attention mask (`tf.ones([n, T, 1])` times the
reshaped input mask) and `gather_indexes` (positions plus `range(n) * T`
into the flat sequence: each example's own tokens, `rows/flat.py`) as
per-example: the row reader finds no mixing op, every device runs the whole
model on its own rows (about the plain graph's heavy ops each), and
training with BERT's own AdamWeightDecay (gradients clipped by their global
norm) equals one device on the whole batch: with BERT's default dropout (0.1
on the hidden layers, embeddings and attention probabilities; keyed draws, so
the reference is the model_fn decorated for one device) on towers,
micro-batches and both, and without dropout the plain model_fn itself, with
the batch size static (`drop_remainder=True`). The runs are `EstimatorGraph`s
(one graph and session, as Estimator builds and drives them), read after each
step.
"""

import collections
import functools

import numpy as np
import pytest
import tensorflow as tf

import bert_model
import estimator_graph
import heavy_ops
import test_random_restart
import testlib
import estimator_towers as et
from estimator_towers.rows import row_dependence as rd

BATCH = 12
LAYOUTS = {'3 towers': (3, 1), '1x2 micro-batches': (1, 2), '2x2': (2, 2)}


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


@pytest.mark.parametrize('static', [False, True])
def test_the_row_reader_finds_no_mixing_op(static):
  """Tower 0's loss read on a shard of 4 examples (its batch size unknown or static)."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    features = {name: tf.compat.v1.placeholder(tf.as_dtype(value.dtype),
                                               [4 if static else None] + list(value.shape[1:]),
                                               name=name)
                for name, value in bert_model.features(4).items()}
    spec = bert_model.model_fn()(features, None, tf.estimator.ModeKeys.TRAIN, {})
    found = rd.classify([spec.loss], tf.nest.flatten(features))
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(spec.loss).tag == rd.STAT
  picked = graph.get_tensor_by_name('GatherV2:0')   # gather_indexes' tokens
  assert found.kind(picked) == rd.Kind(rd.FLAT, per=bert_model.MAX_PREDICTIONS)


def test_every_tower_runs_the_whole_model(warnings):
  """3 towers: each device holds about the plain graph's heavy ops (before: 123/23/23 of 63),
  with BERT's dropout, whose draws are keyed on every tower; and BERT's
  `global_step.assign(global_step + 1)`, in no order with the forward pass, waits for the
  reads of the step that key the draws (else a step could draw with the next step's key)."""
  features = bert_model.features(BATCH)
  plain = heavy_ops.train_graph(bert_model.model_fn(dropout=True), features, None)
  towered = heavy_ops.train_graph(
      et.replicate_model_fn(bert_model.model_fn(dropout=True), devices=testlib.cpu_devices(3)),
      features, None)
  share = heavy_ops.least_share(towered, plain, 3)
  assert share >= 0.9, (share, heavy_ops.per_device(towered), heavy_ops.total(plain))
  assert not warnings, warnings
  test_random_restart.assert_the_step_is_read_before_written(towered)


def test_the_other_towers_backward_passes_are_copies():
  """BERT's loss (masked-LM ratio of sums plus the next-sentence mean): each shard's statistic
  of the mean is built by the library after the towers' copies, and is matched to tower 0's
  op by op, so towers 1 and 2 copy tower 0's backward pass (its gradient ops under
  `tower_<k>/`) instead of running TensorFlow's gradient code again per tower (before: under
  `gradients_<n>/`, half of the model_fn's construction time at N = 8)."""
  graph = heavy_ops.train_graph(
      et.replicate_model_fn(bert_model.model_fn(), devices=testlib.cpu_devices(3)),
      bert_model.features(BATCH), None)
  scopes = collections.Counter(op.name.split('/')[0] for op in heavy_ops.run_by_a_step(graph)
                                if '_grad/' in op.name)
  assert scopes['gradients'] > 100, scopes   # tower 0's backward pass, as a step needs it
  assert scopes['tower_1'] == scopes['tower_2'] == scopes['gradients'], scopes


def _without_global_step(values):
  """The variables but the global step (checked on its own: 0, 1, 2)."""
  return {name: value for name, value in values.items() if name != 'global_step'}


def _trained(model_fn, num_devices=1, static_batch=False):
  """Every global variable after steps 1 and 2 of one run (an EstimatorGraph)."""
  def input_fn():
    return bert_model.input_fn(BATCH, static_batch)().take(2)
  graph = estimator_graph.EstimatorGraph(model_fn, input_fn, tf.estimator.ModeKeys.TRAIN,
                                         num_cpus=num_devices)
  recorder = testlib.StateRecorder()
  graph.hooks.append(recorder)
  try:
    assert graph.run() == 2
  finally:
    graph.close()
  assert [values['global_step'] for values in recorder.states] == [0, 1, 2]
  return [_without_global_step(values) for values in recorder.states[1:]]


@functools.lru_cache(maxsize=None)
def _one_device(dropout, static_batch):
  """BERT decorated for one device (with dropout: the reference of keyed draws), or plain."""
  model_fn = bert_model.model_fn(dropout=dropout)
  return _trained(et.replicate_model_fn(model_fn, devices=['/cpu:0']) if dropout else model_fn,
                  static_batch=static_batch)


def _check_towered(num_devices, micro_batches, dropout, static_batch, warnings):
  towered = et.replicate_model_fn(bert_model.model_fn(dropout=dropout),
                                  devices=testlib.cpu_devices(num_devices),
                                  micro_batches=micro_batches)
  after = _trained(towered, num_devices, static_batch)
  for values, expected in zip(after, _one_device(dropout, static_batch)):
    assert any(name.endswith('/adam_v') for name in expected), sorted(expected)
    testlib.assert_variables_close(values, expected)
  assert not warnings, warnings


@pytest.mark.parametrize('layout', ['3 towers', '2x2'])  # 2x2 has micro-batches
def test_towers_with_dropout_train_equal_to_one_device(layout, warnings):
  """BERT's default dropout: every variable and AdamWeightDecay slot (m, v) within 1e-5 of
  the model_fn decorated for one device after steps 1 and 2."""
  num_devices, micro_batches = LAYOUTS[layout]
  _check_towered(num_devices, micro_batches, True, False, warnings)


def test_a_static_batch_trains_equal_to_plain(warnings):
  """drop_remainder=True: each shard's batch size (4) is static, and so are BERT's sizes;
  without dropout, equal to the plain model_fn."""
  _check_towered(3, 1, False, True, warnings)


def _in_batch_model_fn(features, labels, mode, params):
  """BERT's gather_indexes, then an in-batch softmax over the picked tokens (a head)."""
  _, run_pretraining = bert_model.modules()
  w = tf.compat.v1.get_variable('w', [8, 8],
                                initializer=tf.compat.v1.initializers.glorot_uniform(seed=1))
  hidden = tf.tanh(tf.einsum('btd,de->bte', features['x'], w))
  picked = run_pretraining.gather_indexes(hidden, features['positions'])
  similarities = tf.matmul(picked, picked, transpose_b=True)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      tf.range(tf.shape(picked)[0]), similarities))
  train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_a_head_after_gather_indexes_trains_equal_to_plain():
  """The picked tokens (flat, 2 per example) are the head's frontier: gathered from the towers
  in example order, the in-batch softmax on the whole batch's (before: the offsets' add was
  the mixing op and the flat sequence was read as rows, 12 of its 72 rows gathered)."""
  rng = np.random.RandomState(0)
  data = {'x': rng.randn(BATCH, bert_model.SEQ, 8).astype(np.float32),
          'positions': rng.randint(0, bert_model.SEQ, size=(BATCH, 2)).astype(np.int32)}

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(data).repeat().batch(BATCH)
  plain = testlib.plain_train_and_read(_in_batch_model_fn, input_fn, at=(1, 2))
  towered = testlib.train_and_read(testlib.stepwise_estimator(
      et.replicate_model_fn(_in_batch_model_fn, devices=testlib.cpu_devices(3)), num_cpus=3),
      input_fn, at=(1, 2))
  for values, expected in zip(towered, plain):
    testlib.assert_variables_close(values, expected)
