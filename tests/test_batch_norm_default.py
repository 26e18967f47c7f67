"""Batch norm by default: synchronised, and what is not synchronised is said.

A batch-norm model with the library's default settings trains on towers as
the plain model_fn on one device (every variable, Momentum slot and moving
statistic within 1e-5 after 1 and 3 steps): `sync_batch_norm` left unset is
on. Per-tower statistics are the explicit opt-out (`sync_batch_norm=False`),
which warns once per graph, naming the batch norms. With micro-batches and
the default, a batch norm built in TRAIN is an error that names the choice;
a model without batch norm trains with micro-batches as before, without a
word. Settings: make_plan, make_config and the flag (unset, --sync_batch_norm,
--nosync_batch_norm).
"""

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

import testlib
import estimator_towers as et
from estimator_towers.sync_points import batch_norm as batch_norm_sync

ModeKeys = tf.estimator.ModeKeys
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS
BATCH = 10


def _vectors(num: int):
  """Examples scaled and shifted by their position: shard statistics far from the batch's."""
  x, y = testlib.data(num)
  x = x * np.linspace(0.2, 3.0, num, dtype=np.float32)[:, None]
  return x + np.linspace(-2.0, 2.0, num, dtype=np.float32)[:, None], y


def _spec(mode, h, labels, extra_updates=()):
  logits = tf.compat.v1.layers.dense(
      h, testlib.NUM_CLASSES, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode != ModeKeys.TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.3, 0.9)
  with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS) + list(extra_updates)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def v1_layers_model_fn(features, labels, mode):
  """tf.compat.v1.layers.batch_normalization(training=True), its defaults, twice."""
  h = tf.compat.v1.layers.dense(
      features, 6, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  h = tf.compat.v1.layers.batch_normalization(h, training=mode == ModeKeys.TRAIN, name='bn_a')
  h = tf.compat.v1.layers.batch_normalization(tf.nn.tanh(h), training=mode == ModeKeys.TRAIN,
                                              name='bn_b')
  return _spec(mode, h, labels)


def keras_model_fn(features, labels, mode):
  """A Keras BatchNormalization with its defaults (its layer.updates)."""
  dense = tf.keras.layers.Dense(6, kernel_initializer=tf.keras.initializers.GlorotUniform(1))
  norm = tf.keras.layers.BatchNormalization(name='keras_bn')
  h = norm(dense(features), training=mode == ModeKeys.TRAIN)
  return _spec(mode, h, labels, norm.updates if mode == ModeKeys.TRAIN else ())


def no_batch_norm_model_fn(features, labels, mode):
  h = tf.compat.v1.layers.dense(
      features, 6, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  return _spec(mode, tf.nn.tanh(h), labels)


MODELS = {'v1_layers': v1_layers_model_fn, 'keras': keras_model_fn}


def _input_fn(batch: int = BATCH):
  x, y = _vectors(batch)
  return testlib.input_fn(x, y, batch, epochs=4)


def _towered_estimator(model_fn, num_devices: int = 2, **settings):
  return testlib.make_estimator(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices), **settings),
      num_cpus=num_devices)


# --- The default equals one device ---------------------------------------------

@pytest.mark.parametrize('name', sorted(MODELS))
def test_the_default_batch_norm_model_trains_as_plain_on_two_towers(name):
  model_fn = MODELS[name]
  reference = testlib.PlainTraining(model_fn, _input_fn())
  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(2))
  testlib.check_towered_training(model_fn, towered, 2, _input_fn(), reference, resume=False)
  assert any('moving_variance' in n for n in reference.continuous()[3])


def test_the_opt_out_differs_from_plain():
  """What the default test would see without synchronisation: it can fail."""
  reference = testlib.PlainTraining(v1_layers_model_fn, _input_fn())
  towered = _towered_estimator(v1_layers_model_fn, sync_batch_norm=False)
  towered.train(_input_fn(), steps=3)
  actual, expected = testlib.variables(towered), reference.continuous()[3]
  assert max(float(np.max(np.abs(actual[n] - expected[n]))) for n in expected
             if 'global_step' not in n) > 1e-3


# --- The opt-out says what it affects ----------------------------------------------

def _opt_out_warnings(found: list) -> list:
  return [w for w in found if 'sync_batch_norm=False' in w]


def test_the_opt_out_names_the_batch_norms_once_per_graph(monkeypatch):
  found = testlib.logged_warnings(monkeypatch)
  estimator = _towered_estimator(v1_layers_model_fn, num_devices=3, sync_batch_norm=False)
  estimator.train(_input_fn(), steps=2)
  warnings = _opt_out_warnings(found)
  assert len(warnings) == 1, warnings
  assert '2 batch norm(s)' in warnings[0] and "each tower's shard" in warnings[0], warnings[0]
  assert 'bn_a' in warnings[0] and 'bn_b' in warnings[0], warnings[0]
  assert 'Leave sync_batch_norm unset' in warnings[0], warnings[0]
  estimator.evaluate(_input_fn(), steps=1)   # EVAL uses the moving statistics: nothing to say
  assert len(_opt_out_warnings(found)) == 1
  estimator.train(_input_fn(), steps=1)      # a new TRAIN graph: said again, once
  assert len(_opt_out_warnings(found)) == 2


def test_the_opt_out_names_a_keras_batch_norm_per_micro_batch(monkeypatch):
  found = testlib.logged_warnings(monkeypatch)
  _towered_estimator(keras_model_fn, num_devices=1, sync_batch_norm=False,
                     micro_batches=2).train(_input_fn(), steps=1)
  warnings = _opt_out_warnings(found)
  assert len(warnings) == 1 and 'keras_bn' in warnings[0], warnings
  assert "each micro-batch's shard" in warnings[0], warnings[0]


@pytest.mark.parametrize('model_fn,settings', [
    (v1_layers_model_fn, {}),                                   # synchronised: nothing to say
    (no_batch_norm_model_fn, {'sync_batch_norm': False}),       # nothing affected
])
def test_nothing_is_said_when_nothing_is_per_tower(monkeypatch, model_fn, settings):
  found = testlib.logged_warnings(monkeypatch)
  _towered_estimator(model_fn, **settings).train(_input_fn(), steps=1)
  assert not [w for w in found if 'batch norm' in w], found


# --- Micro-batches: the default asks for a choice --------------------------------------

@pytest.mark.parametrize('name', sorted(MODELS))
def test_error_a_batch_norm_with_micro_batches_and_the_default(name):
  estimator = _towered_estimator(MODELS[name], num_devices=1, micro_batches=2)
  with pytest.raises(batch_norm_sync.BatchNormSyncError,
                     match=r"micro_batches=2: the global batch's statistics need every "
                           r".*Choose sync_batch_norm=False \(--nosync_batch_norm\): each "
                           r'micro-batch normalises with its own statistics'):
    estimator.train(_input_fn(), steps=1)


def test_a_model_without_batch_norm_trains_with_micro_batches_as_before(monkeypatch):
  found = testlib.logged_warnings(monkeypatch)
  reference = testlib.PlainTraining(no_batch_norm_model_fn, _input_fn())
  towered = _towered_estimator(no_batch_norm_model_fn, num_devices=2, micro_batches=2)
  towered.train(_input_fn(), steps=3)
  testlib.assert_variables_close(testlib.variables(towered), reference.continuous()[3])
  assert not [w for w in found if 'batch norm' in w], found


def test_the_choice_trains_a_batch_norm_with_micro_batches():
  estimator = _towered_estimator(v1_layers_model_fn, num_devices=2, micro_batches=2,
                                 sync_batch_norm=False)
  estimator.train(_input_fn(), steps=1)
  assert estimator.get_variable_value('global_step') == 1


# --- Settings ---------------------------------------------------------------------------

def test_make_plan_resolves_the_default():
  assert et.make_plan().sync_batch_norm is True
  assert et.make_plan(micro_batches=2).sync_batch_norm is None   # the choice is asked for
  assert et.make_plan(sync_batch_norm=False, micro_batches=2).sync_batch_norm is False
  assert et.make_config().plan.sync_batch_norm is True
  assert et.make_config(micro_batches=3).sync_batch_norm is None


def test_error_sync_batch_norm_true_with_micro_batches_names_both_fixes():
  with pytest.raises(ValueError, match=r'sync_batch_norm=True and micro_batches=2 cannot be '
                                       r'combined.*micro_batches=1.*sync_batch_norm=False'):
    et.make_plan(sync_batch_norm=True, micro_batches=2)


@pytest.mark.parametrize('value', [1, 'yes', 0.0])
def test_error_sync_batch_norm_that_is_not_a_bool_or_unset(value):
  with pytest.raises(ValueError, match=r'sync_batch_norm must be True, False or unset \(None\), '
                                       r'got .*sync_batch_norm=False'):
    et.make_plan(sync_batch_norm=value)
  with pytest.raises(ValueError, match=r'sync_batch_norm must be True, False or unset'):
    et.make_config(sync_batch_norm=value)


def test_error_a_plan_and_an_explicit_opt_out():
  with pytest.raises(ValueError, match=r'Give either plan or sync_batch_norm=False, not both'):
    et.replicate_model_fn(lambda features: None, plan=et.make_plan(), sync_batch_norm=False)


@pytest.mark.parametrize('argv,expected', [
    ([], True), (['--sync_batch_norm'], True), (['--nosync_batch_norm'], False)])
def test_the_flag_unset_is_the_default(argv, expected):
  flag_values = flags.FlagValues()
  et.define_flags(flag_values)
  flag_values(['prog'] + argv)
  assert flag_values['sync_batch_norm'].default is None
  assert et.config_from_flags(flag_values).plan.sync_batch_norm is expected


def test_the_flags_with_micro_batches():
  flag_values = flags.FlagValues()
  et.define_flags(flag_values)
  flag_values(['prog', '--micro_batches=2'])
  assert et.config_from_flags(flag_values).plan.sync_batch_norm is None
  flag_values = flags.FlagValues()
  et.define_flags(flag_values)
  with pytest.raises(flags.IllegalFlagValueError,
                     match=r'--sync_batch_norm and --micro_batches=2 cannot be combined'):
    flag_values(['prog', '--micro_batches=2', '--sync_batch_norm'])
