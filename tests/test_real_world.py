"""Issue 7: model_fns written as users write them train on N towers as on one device.

Each model_fn below follows a pattern found in widely used code (BERT's
optimizer, global-norm clipping between compute_gradients and apply_gradients,
dynamic loss scaling, SyncReplicasOptimizer, Keras' model_to_estimator, Adam
under a variable_scope, a gradient penalty, Keras legacy optimizers with a tape,
export outputs with scalar entries, TPUEstimatorSpec). The reference is always
the plain model_fn trained as a plain Estimator trains it (testlib.PlainTraining)
on the same data; every model starts from explicitly seeded initializers
(op-level seeds would change with towering). Training checks
(testlib.check_towered_training): variables and optimizer slots within 1e-5
after 1 and 3 steps with exactly the plain checkpoint names, global_step +1
per step, a second train() call, and a checkpoint resumed plain -> towered ->
plain. Batch 7 over 3 (and 2) virtual CPU devices, with soft placement off
(testlib's ConfigProto).
"""

import functools
import os
import tempfile
import time

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn

ModeKeys = tf.estimator.ModeKeys
BATCH = 7
DEVICE_COUNTS = [3, 2]
NORM_COLLECTION = 'test_global_norm'  # model_fns put the unclipped global norm here


def _glorot(seed):
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _logits(features):
  """A small relu MLP; inputs scaled so that gradients are large (norm >> 1)."""
  x = features['x'] if isinstance(features, dict) else features
  hidden = tf.compat.v1.layers.dense(10.0 * x, 6, activation=tf.nn.relu, name='hidden',
                                     kernel_initializer=_glorot(31))
  return tf.compat.v1.layers.dense(
      hidden, testlib.NUM_CLASSES, name='logits', kernel_initializer=_glorot(32),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=33))


def _loss(labels, logits):
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)


def _train_input_fn():
  x, y = testlib.data(2 * BATCH)
  return testlib.input_fn(x, y, BATCH, epochs=2)


def _towered(model_fn, num_devices):
  return replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices))


@functools.lru_cache(maxsize=None)
def _reference(model_fn):
  return testlib.PlainTraining(model_fn, _train_input_fn())


def _check(model_fn, num_devices):
  """Towered training equals plain (testlib.check_towered_training); the
  plain -> towered -> plain resume is checked with 3 devices only (time)."""
  testlib.check_towered_training(model_fn, _towered(model_fn, num_devices), num_devices,
                                 _train_input_fn(), _reference(model_fn),
                                 resume=num_devices == 3)


def _initial_global_norm(model_fn) -> float:
  """The unclipped global gradient norm of the plain model_fn's first step."""
  x, y = testlib.data(BATCH)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    model_fn(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None)
    (norm,) = tf.compat.v1.get_collection(NORM_COLLECTION)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return float(session.run(norm))


# --- 1. BERT's optimization.py (testlib.AdamWeightDecayOptimizer) ---------------------

def bert_style_model_fn(features, labels, mode, params):
  loss = _loss(labels, _logits(features))
  global_step = tf.compat.v1.train.get_or_create_global_step()
  learning_rate = tf.compat.v1.train.polynomial_decay(
      0.05, global_step, 10, end_learning_rate=0.0, power=1.0, cycle=False)
  optimizer = testlib.AdamWeightDecayOptimizer(learning_rate)
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.gradients(loss, tvars)
  grads, norm = tf.clip_by_global_norm(grads, clip_norm=1.0)
  tf.compat.v1.add_to_collection(NORM_COLLECTION, norm)
  train_op = optimizer.apply_gradients(zip(grads, tvars), global_step=global_step)
  # BERT's own lines (`new_global_step = global_step + 1` beside the update)
  # race with the learning rate's read of global_step, on one device too:
  # nothing orders the read before the assign, so a loaded machine sometimes
  # trains a step at the next step's rate (seen once in CI, plain or towered:
  # 1.6e-2 after 3 steps). The increment waits for the update here, so that
  # plain is well defined and the comparison means something.
  with tf.control_dependencies([train_op]):
    new_global_step = global_step + 1
  train_op = tf.group(train_op, [global_step.assign(new_global_step)])
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_bert_style_optimizer_with_tf_gradients_clipping_and_manual_global_step(num_devices):
  assert _initial_global_norm(bert_style_model_fn) > 10.0  # clipping is active
  assert any(n.endswith('/adam_m') for n in _reference(bert_style_model_fn).after[1])
  _check(bert_style_model_fn, num_devices)


# --- 2. compute_gradients -> clip_by_global_norm -> apply_gradients ----------------

def clipped_momentum_model_fn(features, labels, mode, params):
  loss = _loss(labels, _logits(features))
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  grads, tvars = zip(*optimizer.compute_gradients(loss))
  clipped, norm = tf.clip_by_global_norm(grads, 1.0)
  tf.compat.v1.add_to_collection(NORM_COLLECTION, norm)
  train_op = optimizer.apply_gradients(
      zip(clipped, tvars), global_step=tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_compute_gradients_global_norm_clipping_apply_gradients(num_devices):
  assert _initial_global_norm(clipped_momentum_model_fn) > 10.0
  assert any(n.endswith('/Momentum') for n in _reference(clipped_momentum_model_fn).after[1])
  _check(clipped_momentum_model_fn, num_devices)


# --- 3. Dynamic loss scaling ---------------------------------------------------------

OVERFLOW_INDEX = 4  # in shard 1 for 2 and for 3 towers (shards 3+2+2, 4+3)
LOSS_SCALE_VARS = ('current_loss_scale', 'good_steps')


def _weighted_loss(features, labels):
  """Sample-weighted loss: a weight of 1e36 keeps the loss finite (~1e35, so
  Estimator's NaN check passes) while the scaled loss (x 2**15) overflows."""
  logits = _logits(features)
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits,
                                                          weights=features['w'])


def loss_scale_model_fn(features, labels, mode, params):
  loss = _weighted_loss(features, labels)
  optimizer = tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer(
      tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), 'dynamic')
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def graph_rewrite_model_fn(features, labels, mode, params):
  loss = _weighted_loss(features, labels)
  # Returns a MixedPrecisionLossScaleOptimizer and turns the grappler rewrite on
  # for sessions created from now on (the test turns it off again).
  optimizer = tf.compat.v1.train.experimental.enable_mixed_precision_graph_rewrite(
      tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), 'dynamic')
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _weighted_input_fn(overflow_in_first_batch=False):
  x, y = testlib.data(2 * BATCH)
  w = np.ones([2 * BATCH], np.float32)
  if overflow_in_first_batch:
    w[OVERFLOW_INDEX] = 1e36

  def fn():
    ds = tf.data.Dataset.from_tensor_slices(({'x': x, 'w': w}, y)).repeat(2)
    return ds.batch(BATCH)
  return fn


@functools.lru_cache(maxsize=None)
def _loss_scale_reference(model_fn):
  return testlib.PlainTraining(model_fn, _weighted_input_fn())


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_dynamic_loss_scale_optimizer(num_devices):
  reference = _loss_scale_reference(loss_scale_model_fn)
  assert set(LOSS_SCALE_VARS) <= set(reference.after[1]), sorted(reference.after[1])
  testlib.check_towered_training(
      loss_scale_model_fn, _towered(loss_scale_model_fn, num_devices), num_devices,
      _weighted_input_fn(), reference, resume=num_devices == 3)


def test_mixed_precision_graph_rewrite_on_cpu():
  """On CPU the grappler pass runs but changes nothing ("No (suitable) GPUs
  detected, skipping auto_mixed_precision graph optimizer"): what remains is
  the loss-scale optimizer it returns, so plain equals test_dynamic_loss_scale's
  plain. Steps 1 and 3 of one train() call; that optimizer's checkpoints and
  resumes are test_dynamic_loss_scale_optimizer's."""
  try:
    reference = _loss_scale_reference(graph_rewrite_model_fn)
    testlib.assert_variables_close(
        reference.continuous()[3], _loss_scale_reference(loss_scale_model_fn).continuous()[3])
    testlib.check_towered_training(
        graph_rewrite_model_fn, _towered(graph_rewrite_model_fn, 3), 3,
        _weighted_input_fn(), reference, resume=False)
  finally:
    tf.compat.v1.train.experimental.disable_mixed_precision_graph_rewrite()


def _record_overflow_run(model_fn, num_devices=1):
  """States after session start and after each step of train(steps=1) on
  [overflowing batch, good batch]: the skipped step does not advance
  global_step, so train(steps=1) runs two steps."""
  recorder = testlib.StateRecorder()
  est = testlib.make_estimator(model_fn, num_cpus=num_devices)
  est.train(_weighted_input_fn(overflow_in_first_batch=True), steps=1, hooks=[recorder])
  return recorder.states, testlib.variables(est)


@functools.lru_cache(maxsize=None)
def _plain_overflow_run():
  return _record_overflow_run(loss_scale_model_fn)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_overflow_in_one_tower_skips_the_step_as_plain(num_devices):
  plain_states, plain_final = _plain_overflow_run()
  # The plain reference: start, skipped step, trained step.
  assert len(plain_states) == 3
  start, skipped, trained = plain_states
  assert skipped['current_loss_scale'] == start['current_loss_scale'] / 2
  assert skipped['global_step'] == 0 and trained['global_step'] == 1
  for name, value in start.items():
    if name not in LOSS_SCALE_VARS:
      np.testing.assert_array_equal(skipped[name], value, err_msg=name)
  assert not np.allclose(trained['logits/kernel'], start['logits/kernel'])

  towered_states, towered_final = _record_overflow_run(
      _towered(loss_scale_model_fn, num_devices), num_devices)
  def trace(states):
    return [(int(s['global_step']), float(s['current_loss_scale'])) for s in states]
  assert len(towered_states) == len(plain_states), (
      f'(global_step, loss scale) at start and after each run: towered '
      f'{trace(towered_states)}, plain {trace(plain_states)}')
  for step, (towered, plain) in enumerate(zip(towered_states, plain_states)):
    for name in plain:
      testlib.assert_close(towered[name], plain[name], err_msg=f'{name} after run {step}')
  testlib.assert_variables_close(towered_final, plain_final)


# --- 4. SyncReplicasOptimizer ----------------------------------------------------------

def sync_replicas_model_fn(features, labels, mode, params):
  loss = _loss(labels, _logits(features))
  optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
      tf.compat.v1.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=1,
      total_num_replicas=1)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  # num_tokens=0: each step waits for its own update (the default, one initial
  # token, lets the second step race the first update and be dropped as stale).
  hook = optimizer.make_session_run_hook(is_chief=True, num_tokens=0)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    training_hooks=[hook])


def _timeout_estimator(model_fn, num_cpus):
  """Blocking ops fail after 2 s instead of hanging. Even the plain model_fn
  needs this: after the last step the chief's queue-runner thread stays blocked
  in take_grad, and closing the session would wait Estimator's 120 s grace
  period for it."""
  config = testlib.run_config(num_cpus)
  config.session_config.operation_timeout_in_ms = 2000
  return tf.estimator.Estimator(model_fn, model_dir=tempfile.mkdtemp(prefix='et_'),
                                config=config)


@pytest.mark.timeout(120)
def test_sync_replicas_optimizer_one_update_per_step():
  """The towers' whole-batch gradient goes through the SyncReplicasOptimizer the
  model_fn built, once per step, as on one device: train() completes (never a
  hang: steps must finish, the whole call within 60 s) and equals plain."""
  x, y = testlib.data(2 * BATCH)
  fn = testlib.input_fn(x, y, BATCH, epochs=2)
  plain = _timeout_estimator(sync_replicas_model_fn, 1)
  plain.train(fn, steps=2)
  assert testlib.variables(plain)['global_step'] == 2

  towered = _timeout_estimator(_towered(sync_replicas_model_fn, 3), 3)
  start = time.monotonic()
  towered.train(fn, steps=2)
  elapsed = time.monotonic() - start
  testlib.assert_variables_close(testlib.variables(towered), testlib.variables(plain))
  assert elapsed < 60, f'train() took {elapsed:.0f} s'


# --- 5. tf.keras.estimator.model_to_estimator ----------------------------------------

def _keras_estimator_model_fn():
  """model_to_estimator's model_fn and its warm start (the Keras weights)."""
  inputs = tf.keras.Input(shape=(testlib.NUM_FEATURES,), name='x')
  hidden = tf.keras.layers.Dense(
      6, activation='relu', kernel_initializer=tf.keras.initializers.GlorotUniform(seed=41))(
          inputs)
  outputs = tf.keras.layers.Dense(
      testlib.NUM_CLASSES, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=42),
      name='logits')(hidden)
  model = tf.keras.Model(inputs, outputs)
  model.compile(optimizer=tf.keras.optimizers.legacy.Adam(0.05),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  est = tf.keras.estimator.model_to_estimator(keras_model=model, config=testlib.run_config(1))
  return est.model_fn, est._warm_start_settings  # pylint: disable=protected-access


def test_keras_model_to_estimator():
  model_fn, warm_start = _keras_estimator_model_fn()
  x, y = testlib.data(2 * BATCH)

  def fn():
    return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).repeat(2).batch(BATCH)

  def make(model_fn, num_cpus=1, model_dir=None):
    return tf.estimator.Estimator(
        model_fn, model_dir=model_dir or tempfile.mkdtemp(prefix='et_'),
        config=testlib.run_config(num_cpus), warm_start_from=warm_start)

  plain = make(model_fn)
  plain.train(fn, steps=1)
  after_1 = testlib.variables(plain)
  assert any('optimizer' in n.lower() or 'adam' in n.lower() for n in after_1), sorted(after_1)
  plain.train(fn, steps=2)
  after_3 = testlib.variables(plain)
  plain.train(fn, steps=1)
  after_4 = testlib.variables(plain)

  towered_fn = _towered(model_fn, 3)
  towered = make(towered_fn, num_cpus=3)
  towered.train(fn, steps=1)  # its optimizer variables must be in the checkpoint
  testlib.assert_variables_close(testlib.variables(towered), after_1)
  towered.train(fn, steps=2)  # a second train() restores every variable
  testlib.assert_variables_close(testlib.variables(towered), after_3)
  # Resume plain -> towered -> plain.
  mixed = make(model_fn)
  mixed.train(fn, steps=1)
  make(towered_fn, num_cpus=3, model_dir=mixed.model_dir).train(fn, steps=2)
  testlib.assert_variables_close(testlib.variables(mixed), after_3)
  mixed.train(fn, steps=1)
  testlib.assert_variables_close(testlib.variables(mixed), after_4)
  # Evaluate and predict on one checkpoint equal the plain model_fn's.
  towered_eval = make(towered_fn, num_cpus=3, model_dir=plain.model_dir)
  metrics = towered_eval.evaluate(fn, steps=2, name='towered')
  expected = plain.evaluate(fn, steps=2)
  assert sorted(metrics) == sorted(expected)
  for key in expected:
    testlib.assert_close(metrics[key], expected[key], err_msg=key)
  testlib.assert_close(testlib.predictions(towered_eval, fn, 'logits'),
                       testlib.predictions(plain, fn, 'logits'), err_msg='logits')


# --- 6. minimize inside a variable_scope ------------------------------------------------

def scoped_adam_model_fn(features, labels, mode, params):
  with tf.compat.v1.variable_scope('model'):
    loss = _loss(labels, _logits(features))
    train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(
        loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_adam_minimize_inside_a_variable_scope(num_devices):
  names = set(_reference(scoped_adam_model_fn).after[1])
  # Plain TF doubles the scope in slot names (the slot's scope is opened inside
  # the current one); towered checkpoints must keep exactly these names.
  assert 'model/model/hidden/kernel/Adam' in names and 'model/beta1_power' in names, sorted(names)
  _check(scoped_adam_model_fn, num_devices)


# --- 7. Gradient penalty (WGAN-GP) ------------------------------------------------------

def gradient_penalty_model_fn(features, labels, mode, params):
  """A critic with a penalty on its gradient with respect to its inputs.

  The penalty's tf.gradients(out, x) is part of the model: per example, so per
  tower. Interpolates are deterministic (a random epsilon would change with
  towering).
  """
  real = features
  fake = tf.reverse(features, [1]) * 0.5

  def critic(x):
    with tf.compat.v1.variable_scope('critic', reuse=tf.compat.v1.AUTO_REUSE):
      hidden = tf.compat.v1.layers.dense(x, 6, activation=tf.nn.tanh, name='hidden',
                                         kernel_initializer=_glorot(51))
      return tf.compat.v1.layers.dense(hidden, 1, name='out', kernel_initializer=_glorot(52))

  epsilon = tf.linspace(0.1, 0.9, testlib.NUM_FEATURES)
  interpolates = epsilon * real + (1.0 - epsilon) * fake
  (input_grads,) = tf.gradients(critic(interpolates), [interpolates])
  slopes = tf.sqrt(tf.reduce_sum(tf.square(input_grads), axis=1) + 1e-8)
  penalty = tf.reduce_mean(tf.square(slopes - 1.0))
  loss = tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real)) + 10.0 * penalty
  train_op = tf.compat.v1.train.AdamOptimizer(0.01, beta1=0.5).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_gradient_penalty_with_respect_to_inputs(num_devices):
  _check(gradient_penalty_model_fn, num_devices)


# --- 8. Keras legacy optimizers: minimize with a tape, get_updates -----------------------

def _keras_layers():
  return [tf.keras.layers.Dense(6, activation='relu', name='hidden',
                                kernel_initializer=tf.keras.initializers.GlorotUniform(seed=61)),
          tf.keras.layers.Dense(testlib.NUM_CLASSES, name='logits',
                                kernel_initializer=tf.keras.initializers.GlorotUniform(seed=62))]


def _keras_loss(labels, logits):
  return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True))


def keras_tape_model_fn(features, labels, mode, params):
  hidden, head = _keras_layers()
  with tf.GradientTape() as tape:
    loss = _keras_loss(labels, head(hidden(10.0 * features)))
  optimizer = tf.keras.optimizers.legacy.Adam(0.01)
  variables = hidden.trainable_weights + head.trainable_weights
  update = optimizer.minimize(loss, variables, tape=tape)
  step = tf.compat.v1.train.get_global_step()
  return tf.estimator.EstimatorSpec(mode, loss=loss,
                                    train_op=tf.group(update, step.assign_add(1)))


def keras_get_updates_model_fn(features, labels, mode, params):
  hidden, head = _keras_layers()
  loss = _keras_loss(labels, head(hidden(10.0 * features)))
  optimizer = tf.keras.optimizers.legacy.RMSprop(0.01, momentum=0.5)
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  updates = optimizer.get_updates(loss, hidden.trainable_weights + head.trainable_weights)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(updates))


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_keras_legacy_minimize_with_tensor_loss_and_tape(num_devices):
  _check(keras_tape_model_fn, num_devices)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_keras_legacy_get_updates(num_devices):
  _check(keras_get_updates_model_fn, num_devices)


# --- 9. Export outputs with scalar entries ------------------------------------------------

def scalar_export_model_fn(features, labels, mode, params):
  x = features['x']
  logits = _logits(x)
  probabilities = tf.nn.softmax(logits)
  if mode == ModeKeys.PREDICT:
    version = tf.constant(7, tf.int64)
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits}, export_outputs={
        'serving_default': tf.estimator.export.PredictOutput(
            {'logits': logits, 'model_version': version}),
        'classify': tf.estimator.export.ClassificationOutput(
            scores=probabilities, classes=tf.constant('class_names_v1')),
    })
  loss = _loss(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _export_output_tensors(spec):
  """{signature/key: tensor} of a PREDICT spec's export outputs."""
  tensors = {}
  for key, output in spec.export_outputs.items():
    if isinstance(output, tf.estimator.export.PredictOutput):
      tensors.update({f'{key}/{k}': v for k, v in output.outputs.items()})
    else:
      tensors.update({f'{key}/scores': output.scores, f'{key}/classes': output.classes})
  return tensors


def _evaluate_export_outputs(model_fn, num_devices):
  x, _ = testlib.data(BATCH)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    spec = model_fn({'x': tf.constant(x)}, None, ModeKeys.PREDICT, None,
                    testlib.run_config(num_devices))
    tensors = _export_output_tensors(spec)
    shapes = {k: t.shape.as_list() for k, t in tensors.items()}
    with tf.compat.v1.Session(config=testlib.run_config(num_devices).session_config) as s:
      s.run(tf.compat.v1.global_variables_initializer())
      return shapes, s.run(tensors)


@pytest.mark.parametrize('num_devices', DEVICE_COUNTS)
def test_export_outputs_with_scalar_entries(num_devices):
  def plain_fn(features, labels, mode, params, config):
    return scalar_export_model_fn(features, labels, mode, params)

  plain_shapes, plain_values = _evaluate_export_outputs(plain_fn, 1)
  assert plain_shapes['serving_default/model_version'] == []
  shapes, values = _evaluate_export_outputs(_towered(scalar_export_model_fn, num_devices),
                                            num_devices)
  assert sorted(values) == sorted(plain_values)
  for key, value in plain_values.items():
    assert shapes[key] == plain_shapes[key] or (
        plain_shapes[key][0] == BATCH and shapes[key][0] is None), (key, shapes[key])
    if np.asarray(value).dtype.kind in 'SUO':
      np.testing.assert_array_equal(values[key], value, err_msg=key)
    else:
      testlib.assert_close(values[key], value, err_msg=key)

  # Through Estimator: predict() and export_saved_model() work and serve as plain.
  x, y = testlib.data(BATCH)
  fn = lambda: tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(BATCH)
  towered = testlib.make_estimator(_towered(scalar_export_model_fn, num_devices),
                                   num_cpus=num_devices)
  towered.train(fn, steps=1)
  plain = testlib.make_estimator(scalar_export_model_fn, model_dir=towered.model_dir)
  testlib.assert_close(testlib.predictions(towered, fn), testlib.predictions(plain, fn),
                       err_msg='logits')
  # A parsing receiver (serialized tf.Examples), so that the classify signature
  # is valid and exported, not skipped.
  receiver = tf.estimator.export.build_parsing_serving_input_receiver_fn(
      {'x': tf.io.FixedLenFeature([testlib.NUM_FEATURES], tf.float32)})
  examples = tf.constant([tf.train.Example(features=tf.train.Features(feature={
      'x': tf.train.Feature(float_list=tf.train.FloatList(value=row))})).SerializeToString()
                          for row in x])
  served = {}
  for name, est in (('towered', towered), ('plain', plain)):
    export_dir = est.export_saved_model(os.path.join(towered.model_dir, name), receiver)
    signatures = tf.saved_model.load(export_dir).signatures
    served[name] = {
        key: f(**{arg: examples for arg in f.structured_input_signature[1]})
        for key, f in signatures.items()}
  assert sorted(served['plain']) == ['classify', 'serving_default'], sorted(served['plain'])
  assert sorted(served['towered']) == sorted(served['plain'])
  for signature, outputs in served['plain'].items():
    assert sorted(served['towered'][signature]) == sorted(outputs)
    for key, value in outputs.items():
      if value.dtype == tf.string:
        np.testing.assert_array_equal(served['towered'][signature][key].numpy(), value.numpy())
      else:
        testlib.assert_close(served['towered'][signature][key].numpy(), value.numpy(),
                             err_msg=f'{signature}/{key}')


# --- 10. TPUEstimatorSpec under a plain Estimator ----------------------------------------

def tpu_spec_model_fn(features, labels, mode, params):
  """As BERT's run_classifier builds it for TPUEstimator(use_tpu=False)."""
  logits = _logits(features)
  probabilities = tf.nn.softmax(logits)
  TPUEstimatorSpec = tf.compat.v1.estimator.tpu.TPUEstimatorSpec  # pylint: disable=invalid-name
  if mode == ModeKeys.PREDICT:
    return TPUEstimatorSpec(mode, predictions={'probabilities': probabilities})
  per_example_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  loss = tf.reduce_mean(per_example_loss)
  if mode == ModeKeys.EVAL:
    def metric_fn(per_example_loss, labels, logits):
      predictions = tf.argmax(logits, axis=-1, output_type=tf.int32)
      return {'eval_accuracy': tf.compat.v1.metrics.accuracy(labels, predictions),
              'eval_loss': tf.compat.v1.metrics.mean(per_example_loss)}
    return TPUEstimatorSpec(mode, loss=loss,
                            eval_metrics=(metric_fn, [per_example_loss, labels, logits]))
  train_op = tf.compat.v1.train.AdamOptimizer(0.01).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return TPUEstimatorSpec(mode, loss=loss, train_op=train_op,
                          scaffold_fn=lambda: tf.compat.v1.train.Scaffold())


def tpu_spec_as_estimator_spec_model_fn(features, labels, mode, params):
  return tpu_spec_model_fn(features, labels, mode, params).as_estimator_spec()


def test_tpu_estimator_spec_under_a_plain_estimator():
  testlib.check_towered_training(
      tpu_spec_as_estimator_spec_model_fn, _towered(tpu_spec_model_fn, 3), 3,
      _train_input_fn(), _reference(tpu_spec_as_estimator_spec_model_fn))
  x, y = testlib.data(BATCH)
  fn = testlib.input_fn(x, y, BATCH)
  plain = testlib.make_estimator(tpu_spec_as_estimator_spec_model_fn)
  plain.train(fn, steps=1)
  towered = testlib.make_estimator(_towered(tpu_spec_model_fn, 3), num_cpus=3,
                                   model_dir=plain.model_dir)
  metrics = towered.evaluate(fn, name='towered')
  expected = plain.evaluate(fn)
  assert sorted(metrics) == sorted(expected)
  for key in expected:
    testlib.assert_close(metrics[key], expected[key], err_msg=key)
  testlib.assert_close(testlib.predictions(towered, fn, 'probabilities'),
                       testlib.predictions(plain, fn, 'probabilities'), err_msg='probabilities')


# --- The same patterns with micro-batches (see also test_micro_batches.py) ---------------

@pytest.mark.parametrize('model_fn', [bert_style_model_fn, gradient_penalty_model_fn,
                                      keras_tape_model_fn, keras_get_updates_model_fn,
                                      scoped_adam_model_fn], ids=lambda fn: fn.__name__)
def test_with_micro_batches(model_fn):
  """2 devices x 2 micro-batches: the same update as the plain model_fn."""
  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(2), micro_batches=2)
  testlib.check_towered_training(model_fn, towered, 2, _train_input_fn(), _reference(model_fn),
                                 resume=False)
