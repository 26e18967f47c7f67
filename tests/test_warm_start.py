"""Warm starts on towers and micro-batches equal the plain model_fn's.

A fine-tuning model_fn (BERT's pattern: an encoder, then
`tf.compat.v1.train.init_from_checkpoint(ckpt, assignment_map)`, then a new
head) is called once per built tower; a later tower's `init_from_checkpoint`
would replace the variables' initializers with restore ops of its own, which
wait for its micro-batch's input gates, so the session could not start
(FailedPreconditionError: the iterator not initialized, with micro-batches).
The variables keep tower 0's initializers (`towers/builder.py`). Each case
trains 2 steps from a pre-training checkpoint and is compared with the plain
model_fn (every variable and slot within 1e-5), on 2 towers, 2 micro-batches
and 2 x 2, features only (the label is a feature): `init_from_checkpoint` in
the model_fn, Estimator's `warm_start_from`, and a Scaffold's `init_fn`; and
BERT's own encoder (`bert_model`) fine-tuned from its pre-training checkpoint
with 2 micro-batches.
"""

from __future__ import annotations

import functools

import pytest
import tensorflow as tf

import bert_model
import testlib
import estimator_towers as et

LAYOUTS = {'2 towers': (2, 1), '1x2 micro-batches': (1, 2), '2x2': (2, 2)}
X, Y = testlib.data(48, seed=4)


def _input_fn():
  return tf.data.Dataset.from_tensor_slices({'x': X, 'label': Y}).repeat().batch(12)


def _encoder(features):
  return tf.compat.v1.layers.dense(
      features['x'], 8, tf.nn.tanh, name='encoder',
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))


def _train_spec(mode, logits, features, optimizer):
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(features['label'], logits)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _pretrain_fn(features, mode):
  logits = tf.compat.v1.layers.dense(_encoder(features), testlib.NUM_CLASSES, name='pre_head')
  return _train_spec(mode, logits, features,
                     tf.compat.v1.train.GradientDescentOptimizer(0.5))


@functools.lru_cache(maxsize=None)
def _pretrained(tmp_root: str) -> str:
  estimator = tf.estimator.Estimator(_pretrain_fn, config=testlib.run_config(
      1, model_dir=f'{tmp_root}/pretrained'))
  estimator.train(_input_fn, max_steps=3)
  return estimator.latest_checkpoint()


def _finetune_fn(how, checkpoint):
  def model_fn(features, mode):
    hidden = _encoder(features)
    if how == 'init_from_checkpoint':
      tf.compat.v1.train.init_from_checkpoint(checkpoint, {'encoder/': 'encoder/'})
    logits = tf.compat.v1.layers.dense(
        hidden, testlib.NUM_CLASSES, name='new_head',
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    spec = _train_spec(mode, logits, features, tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
    if how != 'scaffold init_fn':
      return spec
    saver = tf.compat.v1.train.Saver(
        {v.op.name: v for v in tf.compat.v1.global_variables() if v.op.name.startswith(
            'encoder/') and 'Momentum' not in v.op.name})
    return spec._replace(scaffold=tf.compat.v1.train.Scaffold(
        init_fn=lambda scaffold, session: saver.restore(session, checkpoint)))
  return model_fn


def _finetuned(model_fn, num_devices, model_dir, warm_start=None):
  estimator = tf.estimator.Estimator(model_fn, warm_start_from=warm_start, config=(
      testlib.stepwise_estimator(model_fn, num_devices, model_dir=model_dir).config))
  return testlib.train_and_read(estimator, _input_fn, at=(1, 2))


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
@pytest.mark.parametrize('how', ['init_from_checkpoint', 'warm_start_from', 'scaffold init_fn'])
def test_fine_tuning_from_a_checkpoint_equals_plain(how, layout, tmp_path_factory):
  root = str(tmp_path_factory.getbasetemp())
  checkpoint = _pretrained(root)
  warm = (tf.estimator.WarmStartSettings(checkpoint, vars_to_warm_start='encoder/.*')
          if how == 'warm_start_from' else None)
  plain = _finetuned(_finetune_fn(how, checkpoint), 1, str(tmp_path_factory.mktemp('p')), warm)
  num_devices, micro_batches = LAYOUTS[layout]
  towered = et.replicate_model_fn(_finetune_fn(how, checkpoint),
                                  devices=testlib.cpu_devices(num_devices),
                                  micro_batches=micro_batches)
  after = _finetuned(towered, num_devices, str(tmp_path_factory.mktemp('t')), warm)
  for values, expected in zip(after, plain):
    testlib.assert_variables_close(values, expected)


def _bert_classifier_fn(checkpoint):
  """BERT's fine-tuning pattern: its encoder, init_from_checkpoint, a new head (features
  only: the label is `next_sentence_labels`)."""
  modeling, _ = bert_model.modules()
  config = modeling.BertConfig(**bert_model.CONFIG)

  def model_fn(features, mode):
    bert = modeling.BertModel(config, is_training=True, input_ids=features['input_ids'],
                              input_mask=features['input_mask'],
                              token_type_ids=features['segment_ids'])
    assignment, _ = modeling.get_assignment_map_from_checkpoint(
        tf.compat.v1.trainable_variables(), checkpoint)
    tf.compat.v1.train.init_from_checkpoint(checkpoint, assignment)
    logits = tf.compat.v1.layers.dense(
        bert.get_pooled_output(), 2,
        kernel_initializer=tf.compat.v1.truncated_normal_initializer(0.0, 0.02, seed=1))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        features['next_sentence_labels'][:, 0], logits)
    train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def test_bert_fine_tuning_with_micro_batches_equals_plain(tmp_path):
  """BERT pre-trained 1 step (its own model_fn), then fine-tuned from that checkpoint with
  2 micro-batches on one device: equal to the plain fine-tuning model_fn."""
  pre = tf.estimator.Estimator(bert_model.model_fn(), config=testlib.run_config(
      1, model_dir=str(tmp_path / 'pre')), params={})
  pre.train(bert_model.input_fn(12), max_steps=1)
  checkpoint = pre.latest_checkpoint()

  def finetuned(model_fn, name):
    estimator = testlib.stepwise_estimator(model_fn, 1, model_dir=str(tmp_path / name))
    return testlib.train_and_read(estimator, bert_model.input_fn(12), at=(1, 2))

  plain = finetuned(_bert_classifier_fn(checkpoint), 'plain')
  towered = finetuned(et.replicate_model_fn(_bert_classifier_fn(checkpoint), devices=['/cpu:0'],
                                            micro_batches=2), 'micro')
  for values, expected in zip(towered, plain):
    testlib.assert_variables_close(values, expected)
