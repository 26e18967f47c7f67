"""Hooks and summaries a model_fn builds read the whole batch's values, as on one device.

A model_fn's hooks and summaries are built on tower 0 and would read its
shard's values (`reporting/whole_batch_views.py`). Each case trains the same
model_fn plain on one device and on 2 towers, 2 micro-batches and 2 x 2, with a
summary every step, and compares, at every step: the summaries read back from
the event files (Estimator's loss, the model_fn's loss, an accuracy, a max
over the batch, a count of correct predictions, the number of examples, a
histogram of the logits, an image of each example's inputs: its PNG bytes),
the loss a user's hook fetched, what a LoggingTensorHook logged (the loss and
the accuracy) and Estimator's own step log (`loss = ..., step = ...`);
features only (the label a feature) and with labels. A summary of a value
the library cannot rebuild (a median by a sort across the batch) keeps tower
0's and warns once, naming it. In EVAL, an evaluation hook fetching the loss
gets each batch's whole loss.
"""

from __future__ import annotations

import glob
import logging
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import testlib
import estimator_towers as et

LAYOUTS = {'2 towers': (2, 1), '1x2 micro-batches': (1, 2), '2x2': (2, 2)}
STEPS = 3
X, Y = testlib.data(12 * STEPS, seed=6)


class _Fetches(tf.compat.v1.train.SessionRunHook):
  """A user's hook: records the loss it fetches at every step."""

  def __init__(self, loss):
    self.loss, self.values = loss, []

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs({'loss': self.loss})

  def after_run(self, run_context, run_values):
    self.values.append(run_values.results['loss'])


def _model_fn(fetches, median=False):
  def model_fn(features, labels, mode):
    labels = features['label'] if labels is None else labels
    logits = tf.compat.v1.layers.dense(
        features['x'], testlib.NUM_CLASSES,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=labels.dtype), labels),
                      tf.float32)
    accuracy = tf.reduce_mean(correct)
    tf.compat.v1.summary.scalar('my_loss', loss)
    tf.compat.v1.summary.scalar('accuracy', accuracy)
    tf.compat.v1.summary.scalar('max_logit', tf.reduce_max(logits))
    tf.compat.v1.summary.scalar('correct', tf.reduce_sum(correct))   # a sum: a count
    tf.compat.v1.summary.scalar('examples', tf.cast(tf.size(labels), tf.float32))
    tf.compat.v1.summary.histogram('logits', logits)
    tf.compat.v1.summary.image(
        'inputs', tf.reshape(features['x'], [-1, 1, testlib.NUM_FEATURES, 1]), max_outputs=12)
    if median:
      tf.compat.v1.summary.scalar('median_logit', tf.sort(tf.reshape(logits, [-1]))[
          tf.size(logits) // 2])
    hooks = [_Fetches(loss), tf.compat.v1.train.LoggingTensorHook(
        {'hooked_loss': loss, 'hooked_accuracy': accuracy}, every_n_iter=1)]
    fetches.append(hooks[0])
    if mode == tf.estimator.ModeKeys.EVAL:
      return tf.estimator.EstimatorSpec(mode, loss=loss, evaluation_hooks=hooks[:1])
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      training_hooks=hooks)
  return model_fn


def _input_fn(features_only):
  def input_fn():
    if features_only:
      return tf.data.Dataset.from_tensor_slices({'x': X, 'label': Y}).batch(12)
    return tf.data.Dataset.from_tensor_slices(({'x': X}, Y)).batch(12)
  return input_fn


def _events(model_dir):
  """{tag: [value per step]}: scalars, (sum, count, min, max) of histograms, images' bytes."""
  found = {}
  for path in sorted(glob.glob(os.path.join(model_dir, 'events.out.tfevents.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.HasField('histo'):
          h = value.histo
          found.setdefault(value.tag, {})[event.step] = (h.sum, h.num, h.min, h.max)
        elif value.HasField('simple_value'):
          found.setdefault(value.tag, {})[event.step] = value.simple_value
        elif value.HasField('image'):
          found.setdefault(value.tag, {})[event.step] = value.image.encoded_image_string
  return {tag: [steps[s] for s in sorted(steps)] for tag, steps in found.items()}


def _logged(records):
  """[[hooked_loss, hooked_accuracy] per step], [Estimator's step log's loss per step]."""
  lines = [r.getMessage() for r in records if 'hooked_loss' in r.getMessage()]
  steps = [float(v) for r in records
           for v in re.findall(r'^loss = ([-\d.e]+), step = \d+', r.getMessage())]
  return ([[float(v) for v in re.findall(r'hooked_\w+ = ([-\d.e]+)', line)] for line in lines],
          steps)


def _train(model_fn, num_devices, tmp_path, name, features_only, caplog):
  model_dir = str(tmp_path / name)
  caplog.clear()
  estimator = tf.estimator.Estimator(model_fn, config=testlib.run_config(
      num_devices, model_dir=model_dir, save_summary_steps=1, log_step_count_steps=1))
  with caplog.at_level(logging.INFO, logger='tensorflow'):
    estimator.train(_input_fn(features_only), max_steps=STEPS)
  return _events(model_dir), _logged(caplog.records)


@pytest.mark.parametrize('features_only', [True, False], ids=['features only', 'labels'])
@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_hooks_and_summaries_see_one_device_s_values(layout, features_only, tmp_path, caplog):
  plain_fetches, towered_fetches = [], []
  plain, plain_logged = _train(_model_fn(plain_fetches), 1, tmp_path, 'plain', features_only,
                               caplog)
  num_devices, micro_batches = LAYOUTS[layout]
  towered_fn = et.replicate_model_fn(_model_fn(towered_fetches),
                                     devices=testlib.cpu_devices(num_devices),
                                     micro_batches=micro_batches)
  towered, towered_logged = _train(towered_fn, num_devices, tmp_path, 'towered',
                                   features_only, caplog)
  for tag in ('loss', 'my_loss', 'accuracy', 'max_logit', 'correct', 'examples', 'logits'):
    assert len(plain[tag]) == STEPS, (tag, plain[tag])
    testlib.assert_close(np.array(towered[tag], np.float64), np.array(plain[tag], np.float64),
                         err_msg=tag)
  images = sorted(tag for tag in plain if tag.startswith('inputs/image/'))
  assert len(images) == 12 and sorted(t for t in towered if t.startswith('inputs/')) == images
  for tag in images:
    assert towered[tag] == plain[tag], tag   # the same PNG bytes at every step
  testlib.assert_close(np.array(towered_fetches[0].values), np.array(plain_fetches[0].values))
  for mine, theirs in zip(towered_logged, plain_logged):   # hooked values, the step log
    assert len(theirs) == STEPS, plain_logged
    testlib.assert_close(np.array(mine), np.array(theirs), tol=1e-4)  # printed


def test_a_value_that_cannot_be_rebuilt_warns_once_naming_it(tmp_path):
  warnings = []
  from estimator_towers.base import logs
  original = logs.warning_once
  try:
    logs.warning_once = lambda message, key=None: warnings.append(message) or True
    towered = et.replicate_model_fn(_model_fn([], median=True), devices=testlib.cpu_devices(2))
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      towered({'x': tf.constant(X[:12]), 'label': tf.constant(Y[:12])}, None,
              tf.estimator.ModeKeys.TRAIN, None, testlib.run_config(2))
  finally:
    logs.warning_once = original
  named = [w for w in warnings if 'median_logit' in w]
  assert len(named) == 1, warnings
  assert 'cannot rebuild for the whole batch' in named[0] and "tower 0's value" in named[0]
  assert not [w for w in warnings if 'whole batch' in w and 'median' not in w], warnings


def test_an_evaluation_hook_gets_each_batch_s_whole_loss(tmp_path):
  def evaluated(model_fn, num_devices, name):
    estimator = tf.estimator.Estimator(model_fn, config=testlib.run_config(
        num_devices, model_dir=str(tmp_path / name)))
    estimator.train(_input_fn(True), max_steps=1)
    return estimator.evaluate(_input_fn(True))

  plain_fetches, towered_fetches = [], []
  evaluated(_model_fn(plain_fetches), 1, 'plain')
  evaluated(et.replicate_model_fn(_model_fn(towered_fetches), devices=testlib.cpu_devices(2)),
            2, 'towered')
  plain_eval = [f for f in plain_fetches if f.values][-1].values
  towered_eval = [f for f in towered_fetches if f.values][-1].values
  assert len(plain_eval) == STEPS, plain_eval
  testlib.assert_close(np.array(towered_eval), np.array(plain_eval))
