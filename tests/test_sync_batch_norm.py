"""Issue 14: sync_batch_norm: batch-norm models train on N towers exactly as on one.

The reference is always the plain model_fn run by a plain Estimator on the same
global batches, from explicitly seeded initializers (the same starting
variables). Towered with `sync_batch_norm=True` (the default's resolved value),
every variable (weights, Momentum slots, moving mean and variance) equals plain
within 1e-5 after 1 and 3 steps; with `sync_batch_norm=False` the same models
differ, so these tests can fail. The
shards' examples are scaled differently, so shard statistics are far from the
global batch's.
"""

import functools
import os
import tempfile
import sys

import numpy as np
import pytest
import tensorflow as tf

import testlib
import estimator_towers as et
from estimator_towers.sync_points import batch_norm as batch_norm_sync

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'examples', 'cifar10'))
import model as cifar_model  # pylint: disable=g-import-not-at-top,wrong-import-position

ModeKeys = tf.estimator.ModeKeys
NUM_TOWERS = 3
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS


def _images(num: int, size: int = 8) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.RandomState(0)
  x = rng.randn(num, size, size, 3).astype(np.float32)
  x *= np.linspace(0.2, 3.0, num, dtype=np.float32)[:, None, None, None]
  x += np.linspace(-2.0, 2.0, num, dtype=np.float32)[:, None, None, None]
  return x, rng.randint(0, 3, size=num).astype(np.int32)


def _vectors(num: int) -> tuple[np.ndarray, np.ndarray]:
  x, y = testlib.data(num)
  return x * np.linspace(0.2, 3.0, num, dtype=np.float32)[:, None] + 1.0, y


def _train_spec(mode, loss, extra_updates=()):
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.3, 0.9)
  with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS) + list(extra_updates)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _head(h, labels, mode):
  logits = tf.compat.v1.layers.dense(
      h, 3, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)


def resnet_model_fn(features, labels, mode, params):
  """The example's ResNet (tf.compat.v1.layers fused batch norm), depth 8."""
  params = {'resnet_depth': 8, 'num_classes': 3, 'learning_rate': 0.1, 'batch_size': 128,
            'log_every_n_steps': 1000, **(params or {})}
  return cifar_model.model_fn(features, labels, mode, params)


def keras_fused_model_fn(features, labels, mode, params):
  """A convolution and a fused Keras BatchNormalization (its layer.updates)."""
  training = mode == ModeKeys.TRAIN
  conv = tf.keras.layers.Conv2D(4, 3, kernel_initializer=tf.keras.initializers.GlorotUniform(1))
  norm = tf.keras.layers.BatchNormalization(momentum=0.8, fused=True)
  h = tf.nn.relu(norm(conv(features), training=training))
  loss = _head(tf.reduce_mean(h, [1, 2]), labels, mode)
  return _train_spec(mode, loss, norm.updates if training else ())


def direct_fused_model_fn(features, labels, mode, params):
  """tf.compat.v1.nn.fused_batch_norm called directly, tf_slim style."""
  return _direct_fused(features, labels, mode, 'NHWC')


def direct_fused_nchw_model_fn(features, labels, mode, params):
  """The same with channels first (GPU models' layout): the channel axis is 1."""
  return _direct_fused(features, labels, mode, 'NCHW')


def _direct_fused(features, labels, mode, data_format):
  training = mode == ModeKeys.TRAIN
  h = tf.compat.v1.layers.conv2d(
      features, 4, 3, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  if data_format == 'NCHW':
    h = tf.transpose(h, [0, 3, 1, 2])
  ones, zeros = tf.compat.v1.ones_initializer(), tf.compat.v1.zeros_initializer()
  scale = tf.compat.v1.get_variable('gamma', [4], initializer=ones)
  offset = tf.compat.v1.get_variable('beta', [4], initializer=zeros)
  moving_mean = tf.compat.v1.get_variable('moving_mean', [4], initializer=zeros, trainable=False)
  moving_var = tf.compat.v1.get_variable('moving_variance', [4], initializer=ones,
                                         trainable=False)
  if training:
    h, mean, variance = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True,
                                                         data_format=data_format)
    tf.compat.v1.add_to_collection(UPDATE_OPS, moving_mean.assign(0.9 * moving_mean + 0.1 * mean))
    tf.compat.v1.add_to_collection(UPDATE_OPS,
                                   moving_var.assign(0.9 * moving_var + 0.1 * variance))
  else:
    h, _, _ = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, moving_mean, moving_var,
                                               is_training=False, data_format=data_format)
  if data_format == 'NCHW':
    h = tf.transpose(h, [0, 2, 3, 1])
  loss = _head(tf.reduce_mean(tf.nn.relu(h), [1, 2]), labels, mode)
  return _train_spec(mode, loss)


def layer_norm_model_fn(features, labels, mode, params):
  """Keras LayerNormalization (per-example statistics; fused kernel) and tf.nn.moments."""
  dense = tf.keras.layers.Dense(6, kernel_initializer=tf.keras.initializers.GlorotUniform(1))
  h = tf.keras.layers.LayerNormalization()(dense(features))
  mean, variance = tf.nn.moments(h, axes=[1], keepdims=True)  # per example, hand-written
  h = (h - mean) * tf.math.rsqrt(variance + 1e-3)
  return _train_spec(mode, _head(tf.nn.tanh(h), labels, mode))


# name: (model_fn, data, params)
MODELS = {
    'resnet': (resnet_model_fn, _images, None),
    'keras': (testlib.keras_model_fn, _vectors, {'learning_rate': 0.5}),
    'keras_fused': (keras_fused_model_fn, _images, None),
    'direct_fused': (direct_fused_model_fn, _images, None),
    'direct_fused_nchw': (direct_fused_nchw_model_fn, _images, None),
}
_references = {}


def _case(name: str, batch: int, static: bool):
  model_fn, make_data, params = MODELS[name] if name in MODELS else (
      layer_norm_model_fn, _vectors, None)
  x, y = make_data(batch)
  input_fn = testlib.input_fn(x, y, batch, static_batch=static, epochs=4)
  key = (name, batch)
  if key not in _references:
    _references[key] = testlib.PlainTraining(model_fn, input_fn, params=params)
  return model_fn, input_fn, params, _references[key]


def _relative_difference(actual: dict, expected: dict) -> float:
  return max(float(np.max(np.abs(actual[n] - expected[n]) / np.maximum(1.0, np.abs(expected[n]))))
             for n in expected if np.asarray(expected[n]).dtype.kind == 'f')


def _towered(model_fn, num_towers=NUM_TOWERS, **kwargs):
  return et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_towers), **kwargs)


@pytest.mark.parametrize('batch,static', [(10, False), (2, False), (2, True)])
@pytest.mark.parametrize('name', sorted(MODELS))
def test_synchronised_training_equals_plain(name, batch, static):
  """Batch 10 (4/3/3) and 2 (1/1/0: empty at run time, or a tower not built)."""
  model_fn, input_fn, params, reference = _case(name, batch, static)
  testlib.check_towered_training(
      model_fn, _towered(model_fn, sync_batch_norm=True), NUM_TOWERS, input_fn, reference,
      params=params, resume=name == 'keras' and batch == 10)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_without_sync_the_same_models_differ(name):
  model_fn, input_fn, params, reference = _case(name, 10, False)
  towered = testlib.make_estimator(_towered(model_fn, sync_batch_norm=False), num_cpus=NUM_TOWERS,
                                   params=params)
  towered.train(input_fn, steps=1)
  assert _relative_difference(testlib.variables(towered), reference.continuous()[1]) > 1e-3


@pytest.mark.parametrize('sync', [False, True])
def test_layer_norm_is_exact_with_and_without_sync(sync):
  model_fn, input_fn, params, reference = _case('layer_norm', 10, False)
  testlib.check_towered_training(model_fn, _towered(model_fn, sync_batch_norm=sync), NUM_TOWERS,
                                 input_fn, reference, params=params, resume=False)


def _keras_model_to_estimator():
  """model_to_estimator's model_fn (a Keras model with BatchNormalization) and its warm start."""
  inputs = tf.keras.Input(shape=(testlib.NUM_FEATURES,), name='x')
  hidden = tf.keras.layers.Dense(6, kernel_initializer=tf.keras.initializers.GlorotUniform(4))(
      inputs)
  hidden = tf.keras.layers.BatchNormalization(momentum=0.8)(hidden)
  outputs = tf.keras.layers.Dense(
      3, kernel_initializer=tf.keras.initializers.GlorotUniform(5))(tf.nn.relu(hidden))
  model = tf.keras.Model(inputs, outputs)
  model.compile(optimizer=tf.keras.optimizers.legacy.SGD(0.3, momentum=0.9),
                loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  est = tf.keras.estimator.model_to_estimator(keras_model=model, config=testlib.run_config(1))
  return est.model_fn, est._warm_start_settings  # pylint: disable=protected-access


def _keras_vectors_input_fn():
  x, y = _vectors(10)
  return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).repeat(4).batch(10)


def _run_warm_started(fn, num_cpus, warm_start):
  """Variables after steps 1 and 3 of `fn` warm-started from the Keras model's values."""
  config = testlib.run_config(num_cpus, save_checkpoints_steps=1, keep_checkpoint_max=0)
  est = tf.estimator.Estimator(fn, model_dir=tempfile.mkdtemp(prefix='et_'),
                               config=config, warm_start_from=warm_start)
  return testlib.train_and_read(est, _keras_vectors_input_fn)


@functools.lru_cache(maxsize=None)
def _keras_model_to_estimator_and_plain():
  """model_to_estimator's model_fn, its warm start, and the plain run of that model_fn
  (shared by both sync settings, which decorate the same model_fn)."""
  model_fn, warm_start = _keras_model_to_estimator()
  return model_fn, warm_start, _run_warm_started(model_fn, 1, warm_start)


@pytest.mark.parametrize('sync', [True, False])
def test_model_to_estimator(sync):
  model_fn, warm_start, plain = _keras_model_to_estimator_and_plain()
  towered = _run_warm_started(_towered(model_fn, sync_batch_norm=sync), NUM_TOWERS, warm_start)
  assert any('moving_variance' in name for name in plain[1])
  if sync:
    testlib.assert_variables_close(towered[0], plain[0])
    testlib.assert_variables_close(towered[1], plain[1])
  else:
    assert _relative_difference(towered[0], plain[0]) > 1e-3


@pytest.mark.parametrize('strategy', ['gpu', 'replicated'])
def test_every_variable_strategy(strategy):
  model_fn, input_fn, params, reference = _case('keras_fused', 10, False)
  testlib.check_towered_training(
      model_fn, _towered(model_fn, sync_batch_norm=True, variable_strategy=strategy),
      NUM_TOWERS, input_fn, reference, params=params, resume=False)


@pytest.mark.parametrize('num_towers', [2, 4])
def test_staged_input(num_towers):
  model_fn, input_fn, params, reference = _case('resnet', 10, False)
  plan = et.make_plan(devices=testlib.cpu_devices(num_towers), sync_batch_norm=True)
  towered = testlib.make_estimator(et.replicate_model_fn(model_fn, plan=plan),
                                   num_cpus=num_towers, params=params)
  towered.train(et.staged_input_fn(input_fn, plan), steps=1)
  testlib.assert_variables_close(testlib.variables(towered), reference.continuous()[1])


def test_eval_and_predict_use_moving_statistics_as_plain():
  model_fn, input_fn, params, _ = _case('keras_fused', 10, False)
  plain = testlib.make_estimator(model_fn, params=params)
  plain.train(input_fn, steps=2)
  towered = testlib.make_estimator(_towered(model_fn, sync_batch_norm=True), num_cpus=NUM_TOWERS,
                                   model_dir=plain.model_dir, params=params)
  expected, actual = plain.evaluate(input_fn, steps=1), towered.evaluate(input_fn, steps=1)
  np.testing.assert_allclose(actual['loss'], expected['loss'], rtol=1e-5)


# --- The gradient with respect to the input -----------------------------------

def _input_gradient_model_fn(fused: bool, batch: int):
  """Records d loss / d (batch norm's input) of every example in a variable.

  The batch norm's input is a convolution plus `probe[id]`, a zero variable
  row per example, so the gradient with respect to the probe is the gradient
  with respect to the batch norm's input, example by example: the whole-batch
  gradient of the towers (every shard's rows, the statistics' terms included)
  against plain's. Only the other variables are trained.
  """
  def model_fn(features, labels, mode):
    h = tf.compat.v1.layers.conv2d(
        features['x'], 4, 3, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
    probe = tf.compat.v1.get_variable('probe', [batch, 6, 6, 4],
                                      initializer=tf.compat.v1.zeros_initializer())
    h = h + tf.gather(probe, features['id'])
    if fused:
      h = tf.compat.v1.layers.batch_normalization(h, training=True, fused=True)
    else:  # tf.nn.moments
      h = tf.keras.layers.BatchNormalization(fused=False)(h, training=True)
    loss = _head(tf.reduce_mean(tf.nn.relu(h), [1, 2]), labels, mode)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    grads = optimizer.compute_gradients(loss)
    recorded = tf.compat.v1.get_variable('input_gradient', [batch, 6, 6, 4], trainable=False,
                                         initializer=tf.compat.v1.zeros_initializer())
    record = recorded.assign(tf.convert_to_tensor(dict((v, g) for g, v in grads)[probe]))
    train_op = tf.group(record, optimizer.apply_gradients(
        [(g, v) for g, v in grads if v is not probe], tf.compat.v1.train.get_global_step()))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


@pytest.mark.parametrize('batch', [10, 2])
@pytest.mark.parametrize('fused', [True, False])
def test_input_gradient_equals_plain(fused, batch):
  """Batch 10 (shards 4/3/3) and 2 (1/1/0: an empty shard at run time)."""
  x, y = _images(batch)

  def input_fn():
    features = {'x': x, 'id': np.arange(batch, dtype=np.int32)}
    return tf.data.Dataset.from_tensor_slices((features, y)).batch(batch)

  model_fn = _input_gradient_model_fn(fused, batch)
  runs = [('plain', model_fn, 1),
          ('synced', _towered(model_fn, sync_batch_norm=True), NUM_TOWERS)]
  if batch > NUM_TOWERS:  # the test can fail: per-shard statistics give other gradients
    runs.append(('unsynced', _towered(model_fn, sync_batch_norm=False), NUM_TOWERS))
  gradients = {}
  for name, fn, num_cpus in runs:
    estimator = testlib.make_estimator(fn, num_cpus=num_cpus)
    estimator.train(input_fn, steps=1)
    gradients[name] = estimator.get_variable_value('input_gradient')
  expected = gradients['plain']
  scale = float(np.max(np.abs(expected)))
  assert scale > 1e-3
  np.testing.assert_allclose(gradients['synced'], expected, rtol=0, atol=1e-5 * scale)
  if 'unsynced' in gradients:
    assert np.max(np.abs(gradients['unsynced'] - expected)) > 1e-2 * scale


# --- Errors -------------------------------------------------------------------

def _keras_bn_model_fn(**options):
  def model_fn(features, labels, mode):
    norm = tf.keras.layers.BatchNormalization(**options)
    h = norm(tf.keras.layers.Dense(4)(features), training=mode == ModeKeys.TRAIN)
    return _train_spec(mode, _head(h, labels, mode))
  return model_fn


@pytest.mark.parametrize('option,value', [
    ('renorm', True), ('virtual_batch_size', 2),
    ('adjustment', lambda shape: (tf.ones([1]), tf.zeros([1])))])
def test_error_unsyncable_batch_norm_option(option, value):
  x, y = _vectors(12)
  towered = _towered(_keras_bn_model_fn(**{option: value}), sync_batch_norm=True)
  with pytest.raises(batch_norm_sync.BatchNormSyncError,
                     match=f'{option}=.*cannot be synchronised.*Remove {option}'):
    testlib.make_estimator(towered, num_cpus=NUM_TOWERS).train(
        testlib.input_fn(x, y, 12, static_batch=True), steps=1)


def test_unsyncable_options_are_fine_without_sync():
  x, y = _vectors(12)
  towered = _towered(_keras_bn_model_fn(virtual_batch_size=2), sync_batch_norm=False)
  testlib.make_estimator(towered, num_cpus=NUM_TOWERS).train(
      testlib.input_fn(x, y, 12, static_batch=True), steps=1)


def test_error_towers_sharing_a_device():
  """CPU fallback puts the missing GPU towers on one CPU: no collective can run there."""
  x, y = _vectors(10)
  plan = et.make_plan(num_gpus=2, allow_cpu_fallback=True, sync_batch_norm=True)
  with pytest.raises(batch_norm_sync.BatchNormSyncError,  # fixes: arguments, not flags
                     match=r"its own device.* replicate_model_fn\(devices=\['/cpu:0', '/cpu:1'\]\)"
                           r".*make_config\(num_cpu_devices=2\).*sync_batch_norm=False"):
    testlib.make_estimator(et.replicate_model_fn(testlib.keras_model_fn, plan=plan)).train(
        testlib.input_fn(x, y, 10), steps=1)


def test_error_towers_building_different_batch_norms():
  def model_fn(features, labels, mode):
    h = tf.keras.layers.Dense(4, kernel_initializer=tf.keras.initializers.GlorotUniform(1))(
        features)
    if et.current_tower().index == 0:  # a hand-written batch norm in tower 0 only
      mean, variance = tf.nn.moments(h, axes=[0])
      h = (h - mean) * tf.math.rsqrt(variance + 1e-3)
    return _train_spec(mode, _head(h, labels, mode))
  x, y = _vectors(10)
  with pytest.raises(batch_norm_sync.BatchNormSyncError, match='same batch norms'):
    testlib.make_estimator(_towered(model_fn, sync_batch_norm=True), num_cpus=NUM_TOWERS).train(
        testlib.input_fn(x, y, 10), steps=1)


def test_error_tower_rebuilt():
  """A spec loss the gradients were not asked of makes the library rebuild towers."""
  def model_fn(features, labels, mode):
    h = tf.keras.layers.BatchNormalization()(tf.keras.layers.Dense(4)(features), training=True)
    loss = _head(h, labels, mode)
    spec = _train_spec(mode, loss)
    return spec._replace(loss=tf.identity(loss) + tf.reduce_mean(features) * 0.0)
  x, y = _vectors(10)
  with pytest.raises(batch_norm_sync.BatchNormSyncError, match='built again'):
    testlib.make_estimator(_towered(model_fn, sync_batch_norm=True), num_cpus=NUM_TOWERS).train(
        testlib.input_fn(x, y, 10), steps=1)


def test_error_sync_batch_norm_not_a_bool():
  with pytest.raises(ValueError, match=r'sync_batch_norm must be True, False or unset'):
    et.make_plan(devices=['/cpu:0'], sync_batch_norm='yes')


def test_error_gradient_of_a_copied_graph():
  """The gradient lives with the graph the towers were built in: a copy says so."""
  x, y = _images(6)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    spec = _towered(direct_fused_model_fn, sync_batch_norm=True)(
        tf.constant(x), tf.constant(y), ModeKeys.TRAIN, {})
  with tf.Graph().as_default() as copy:
    tf.import_graph_def(graph.as_graph_def(), name='')
    with pytest.raises(LookupError, match='built in another graph .* Differentiate that graph'):
      tf.gradients(copy.get_tensor_by_name(spec.loss.name), [copy.get_tensor_by_name('gamma:0')])


def test_error_sync_batch_norm_with_micro_batches():
  with pytest.raises(ValueError, match=r'sync_batch_norm=True and micro_batches=2 cannot be '
                                       r'combined.*Use one of the two'):
    et.make_plan(devices=testlib.cpu_devices(2), sync_batch_norm=True, micro_batches=2)


def test_a_later_towers_value_takes_its_slot_of_the_join():
  """The join is built when tower 0 joins; towers 1 and 2 fill their slots when they join."""
  from estimator_towers.sync_points import join as sync_points  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    exchange = sync_points.Exchange([0, 1, 2])
    values = [tf.constant([float(k + 1)]) for k in range(3)]
    result = exchange.join(0, values[0], lambda table: table * 10.0)
    assert exchange.join(2, values[2], None) is result
    exchange.join(1, values[1], None)
    exchange.finish()  # every slot filled: no placeholder
    with tf.compat.v1.Session() as session:
      np.testing.assert_array_equal(session.run(result), [[10.0], [20.0], [30.0]])


def test_error_a_tower_that_never_joined_fails_the_step_by_name():
  from estimator_towers.sync_points import join as sync_points  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    exchange = sync_points.Exchange([0, 1])
    result = exchange.join(0, tf.constant([1.0]), lambda table: table * 10.0)
    exchange.finish()
    exchange.finish()  # once is enough
    assert [op.type for op in tf.compat.v1.get_default_graph().get_operations()].count(
        'Placeholder') == 1
    with tf.compat.v1.Session() as session:
      with pytest.raises(tf.errors.InvalidArgumentError, match='tower_1_statistics'):
        session.run(result)


def _threads() -> int:
  with open('/proc/self/status', encoding='utf-8') as status:
    return int(next(line for line in status if line.startswith('Threads:')).split()[1])


def test_training_does_not_accumulate_threads():
  """A collective with a timeout keeps a sleeping thread per call (TF 2.15): none is set."""
  model_fn, _, params, _ = _case('keras_fused', 10, False)
  x, y = _images(10)
  towered = testlib.make_estimator(_towered(model_fn, sync_batch_norm=True), num_cpus=NUM_TOWERS,
                                   params=params)
  towered.train(testlib.input_fn(x, y, 10, epochs=2), steps=2)  # process-wide pools started
  before = _threads()
  towered.train(testlib.input_fn(x, y, 10, epochs=40), steps=40)  # 40 steps x 12 collectives
  assert _threads() - before < 100


def _dropout_norm_model_fn(features, labels, mode, params):
  """Dropout (keyed draws: values declared rows) before a fused batch norm."""
  training = mode == ModeKeys.TRAIN
  h = tf.compat.v1.layers.conv2d(
      features, 4, 3, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  h = tf.compat.v1.layers.dropout(h, 0.3, training=training)
  h = tf.compat.v1.layers.batch_normalization(h, training=training, fused=True)
  loss = _head(tf.reduce_mean(tf.nn.relu(h), [1, 2]), labels, mode)
  return _train_spec(mode, loss, tf.compat.v1.get_collection(UPDATE_OPS))


def _readings(monkeypatch, model_fn, every_part: bool) -> list:
  """The row reader's readings while a synced model is built on 3 towers (tower 0's);
  with `every_part`, behind a join's table every tower's part is followed, as before the
  tables' parts were recorded by tower (`base.tower_parts`)."""
  from estimator_towers.base import tower_parts  # pylint: disable=g-import-not-at-top
  from estimator_towers.rows import row_dependence  # pylint: disable=g-import-not-at-top
  readings, read = [], row_dependence.read

  def spy(*args):
    readings.append(read(*args))
    return readings[-1]
  with monkeypatch.context() as patch:
    patch.setattr(row_dependence, 'read', spy)
    if every_part:
      patch.setattr(tower_parts, 'others', lambda graph, names: None)
    x, y = _images(6)
    with tf.Graph().as_default():
      tf.compat.v1.train.create_global_step()
      _towered(model_fn)(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, {})
  return readings


@pytest.mark.parametrize('model_fn', [resnet_model_fn, _dropout_norm_model_fn])
def test_tower_zeros_readings_follow_only_its_own_part_of_a_join(model_fn, monkeypatch):
  """Read back from tower 0's loss, a join's table leads to every tower's statistics and, behind
  them, every tower's forward pass: the reader follows tower 0's part only (the others are other
  shards' values) and reads every tensor it reads as when it followed them all."""
  own, every = _readings(monkeypatch, model_fn, False), _readings(monkeypatch, model_fn, True)
  assert len(own) == len(every) > 0
  others = ('tower_1/', 'tower_2/')
  assert any(op.name.startswith(others) for reading in every for op in reading.order)
  for mine, theirs in zip(own, every):
    assert not [op.name for op in mine.order if op.name.startswith(others)]
    assert mine.kinds == {name: theirs.kinds[name] for name in mine.kinds}
    assert [m.op.name for m in mine.mixing] == [m.op.name for m in theirs.mixing]
    assert len(mine.order) < len(theirs.order)
