"""What a towered run writes for TensorBoard: examples/sec, per-tower scalars, global means.

References: the plain model_fn run on each tower's shard alone (its loss at
step 0 is that tower's loss), the plain model_fn on the whole batch (its batch
accuracy is the global one), the sharding rule written out, and Estimator's
own global_step/sec (examples/sec is the batch size times that).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import global_mean
from estimator_towers import replicate_model_fn
from estimator_towers import ThroughputHook
from estimator_towers.reporting import tower_summaries as summaries_lib
from estimator_towers.towers import tower_context

ModeKeys = tf.estimator.ModeKeys
BATCH = 7


def accuracy_model_fn(features, labels, mode, params):
  """testlib.v1_model_fn's network; TRAIN also reports the batch accuracy."""
  if mode != ModeKeys.TRAIN:
    return testlib.v1_model_fn(features, labels, mode, params)
  hidden = tf.compat.v1.layers.dense(
      features, 4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  logits = tf.compat.v1.layers.dense(
      hidden, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=3))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  correct = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.float32)
  accuracy = tf.reduce_mean(correct)
  tf.compat.v1.summary.scalar('shard_accuracy', accuracy)  # Tower 0's shard only.
  global_mean('train_accuracy', accuracy)
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(testlib.LEARNING_RATE)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def first(values: dict[int, float]) -> float:
  """The value of the first step's summary (computed with the initial variables)."""
  return values[min(values)]


def train(model_fn, x, y, model_dir, num_cpus=1, steps=1, hooks=None, every=1,
          static_batch=False):
  estimator = testlib.make_estimator(model_fn, num_cpus=num_cpus, model_dir=model_dir,
                                     save_summary_steps=every, log_step_count_steps=every)
  hooks = [h(estimator) for h in hooks or []]
  estimator.train(testlib.input_fn(x, y, len(x), static_batch=static_batch, epochs=steps),
                  steps=steps, hooks=hooks)
  return testlib.summary_values(model_dir)


# Neither 2 nor 3 divides the batch of 7; the batch size is known in the graph
# (the hook adds nothing to a step) or only when the step runs (fetched).
@pytest.mark.parametrize('num_towers, static_batch', [(2, False), (3, True)])
def test_events_hold_examples_per_sec_and_per_tower_scalars(tmp_path, num_towers, static_batch,
                                                           caplog):
  caplog.set_level(logging.INFO)
  x, y = testlib.data(BATCH)
  towered = replicate_model_fn(accuracy_model_fn, devices=testlib.cpu_devices(num_towers))
  steps = 6
  events = train(towered, x, y, str(tmp_path / 'towered'), num_towers, steps=steps,
                 hooks=[lambda est: ThroughputHook(est.config, max_steps=steps)],
                 static_batch=static_batch)

  # Shard sizes: B // N, plus one for the first B % N towers.
  sizes = [BATCH // num_towers + (k < BATCH % num_towers) for k in range(num_towers)]
  offsets = np.cumsum([0] + sizes)
  for k in range(num_towers):
    assert set(events[f'towers/{k}/shard_size'].values()) == {sizes[k]}
    # Tower k's loss at step 0 is the plain model's loss on shard k alone.
    shard = slice(offsets[k], offsets[k + 1])
    plain = train(accuracy_model_fn, x[shard], y[shard], str(tmp_path / f'plain{k}'))
    testlib.assert_close(first(events[f'towers/{k}/loss']), first(plain['loss']),
                         err_msg=f'towers/{k}/loss')

  # The accuracy over the global batch, not tower 0's shard.
  whole = train(accuracy_model_fn, x, y, str(tmp_path / 'plain'))
  testlib.assert_close(first(events['train_accuracy']), first(whole['shard_accuracy']),
                       err_msg='train_accuracy')
  testlib.assert_close(first(events['loss']), first(whole['loss']), err_msg='loss')

  # examples/sec = global batch x steps/sec, measured at Estimator's cadence.
  rates = events['examples_per_sec']
  assert len(rates) >= 3 and all(r > 0 for r in rates.values())
  step_rates = events['global_step/sec']
  common = sorted(set(rates) & set(step_rates))
  ratio = np.median([rates[s] / step_rates[s] for s in common])
  assert BATCH / 2 < ratio < BATCH * 2, (rates, step_rates)
  logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith('examples/sec')]
  assert logged and f'of {steps}, ETA 0:00:0' in logged[-1], logged
  assert '7.0 examples/step' in logged[-1]


def test_global_mean_in_a_plain_model_fn_is_the_value():
  with tf.Graph().as_default() as graph:
    value = tf.constant(0.25)
    name = global_mean('acc', value)
    with tf.compat.v1.Session() as session:
      assert session.run(graph.get_tensor_by_name(name)) == 0.25
    tags = [t.op.name for t in graph.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)]
    assert tags == ['acc']


def test_global_mean_weights_towers_by_shard_size_and_skips_empty_shards():
  with tf.Graph().as_default() as graph:
    names = set()
    for k, value in enumerate([0.5, 1.0, float('nan')]):  # Tower 2's shard is empty.
      with tower_context.entering(k, 3, f'/cpu:{k}', k == 0):
        names.add(global_mean('acc', tf.constant(value)))
    summaries_lib.tower_summaries([tf.constant(1.0), tf.constant(2.0), tf.constant(3.0)],
                                  [3, tf.constant(1), 0])
    (name,) = names
    with tf.compat.v1.Session() as session:
      assert session.run(graph.get_tensor_by_name(name)) == pytest.approx((3 * 0.5 + 1.0) / 4)


def test_global_mean_errors():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"global_mean\('acc', value\) needs a scalar"):
      global_mean('acc', tf.zeros([3]))
    with tower_context.entering(0, 2, '/cpu:0', True):
      global_mean('acc', tf.constant(1.0))
      with pytest.raises(ValueError, match=r"global_mean\('acc', \.\.\.\) was called twice "
                         r'for tower 0'):
        global_mean('acc', tf.constant(1.0))


def test_tower_summaries_needs_one_size_per_loss():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match='one loss and one size per tower, got 2 losses and 1'):
      summaries_lib.tower_summaries([tf.constant(1.0), None], [3])


def test_throughput_hook_needs_a_towered_model_fn(tmp_path):
  x, y = testlib.data(4)
  with pytest.raises(ValueError, match='ThroughputHook counts the examples of a towered '
                     'model_fn, but this graph has none'):
    train(testlib.v1_model_fn, x, y, str(tmp_path), hooks=[lambda est: ThroughputHook(est.config)])


def test_throughput_hook_arguments():
  with pytest.raises(TypeError, match="ThroughputHook needs the Estimator's RunConfig"):
    ThroughputHook('/tmp/model')
  with pytest.raises(ValueError, match='max_steps must be a positive integer or None, got 0'):
    ThroughputHook(tf.estimator.RunConfig(), max_steps=0)


def _accuracy_and_loss(features, labels):
  logits = tf.compat.v1.layers.dense(
      features, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  correct = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.float32)
  return tf.reduce_mean(correct), loss


def test_global_mean_after_the_optimizer_call_is_an_error():
  def model_fn(features, labels, mode):
    accuracy, loss = _accuracy_and_loss(features, labels)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_global_step())
    global_mean('acc', accuracy)  # Towers other than tower 0 stop before this.
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(2))
  x, y = testlib.data(7)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    with pytest.raises(ValueError, match=r"global_mean\('acc', \.\.\.\) was called by "
                       r'tower\(s\) \[0\] but not by tower\(s\) \[1\].*call global_mean '
                       r'before the optimizer call'):
      towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, None)


def test_global_mean_of_a_tower_built_twice(tmp_path):
  """The reported loss is made after the gradient request, so each other tower
  is built a second time; its global_mean value is taken once."""
  def model_fn(features, labels, mode):
    accuracy, loss = _accuracy_and_loss(features, labels)
    tf.compat.v1.summary.scalar('shard_accuracy', accuracy)
    global_mean('train_accuracy', accuracy)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss + 0.0, train_op=train_op)

  x, y = testlib.data(BATCH)
  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(3))
  events = train(towered, x, y, str(tmp_path / 'towered'), 3)
  whole = train(model_fn, x, y, str(tmp_path / 'plain'))
  testlib.assert_close(first(events['train_accuracy']), first(whole['shard_accuracy']),
                       err_msg='train_accuracy')
