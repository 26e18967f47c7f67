"""current_tower(): what a model_fn learns about the tower it is built for.

The reference for each tower's device is the device TensorFlow gave the ops
the model_fn created in that call.
"""

import pytest
import tensorflow as tf

import testlib
from estimator_towers import current_tower
from estimator_towers import replicate_model_fn
from estimator_towers import TowerContext
from estimator_towers.towers import tower_context

ModeKeys = tf.estimator.ModeKeys


def recording_model_fn(seen: list):
  """testlib.v1_model_fn that records current_tower() and its ops' device."""
  def model_fn(features, labels, mode, params):
    marker = tf.identity(features, name='marker')
    seen.append((current_tower(), marker.device))
    return testlib.v1_model_fn(features, labels, mode, params)
  return model_fn


@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT])
@pytest.mark.parametrize('num_towers', [1, 2, 3])  # 2 and 3 do not divide 7.
def test_each_tower_sees_its_index_and_device(mode, num_towers):
  seen = []
  towered = replicate_model_fn(recording_model_fn(seen), devices=testlib.cpu_devices(num_towers))
  x, y = testlib.data(7)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    towered(tf.constant(x), None if mode == ModeKeys.PREDICT else tf.constant(y),
            mode, None, testlib.run_config(num_towers))
  assert [context.index for context, _ in seen] == list(range(num_towers))
  for k, (context, op_device) in enumerate(seen):
    assert context == TowerContext(index=k, num_towers=num_towers,
                                   device=f'/device:CPU:{k}', primary=k == 0)
    assert op_device == context.device
  assert current_tower() == tower_context.OUTSIDE


def test_three_towers_in_a_training_run_and_the_plain_model_fn(tmp_path):
  seen = []
  towered = replicate_model_fn(recording_model_fn(seen), devices=testlib.cpu_devices(3))
  x, y = testlib.data(8)
  fn = testlib.input_fn(x, y, 8)
  estimator = testlib.make_estimator(towered, num_cpus=3, model_dir=str(tmp_path / 't'))
  estimator.train(fn, steps=1)
  assert [(c.index, c.num_towers, c.device, c.primary) for c, _ in seen] == [
      (0, 3, '/device:CPU:0', True), (1, 3, '/device:CPU:1', False),
      (2, 3, '/device:CPU:2', False)]

  # A plain model_fn, and anything outside towers, gets the one-device answer.
  plain_seen = []
  plain = testlib.make_estimator(recording_model_fn(plain_seen), model_dir=str(tmp_path / 'p'))
  plain.train(fn, steps=1)
  assert [c for c, _ in plain_seen] == [TowerContext(0, 1, None, True)]
  testlib.assert_variables_close(testlib.variables(estimator), testlib.variables(plain))


def test_nested_towers_restore_the_outer_one():
  with tower_context.entering(0, 3, '/device:GPU:0', True):
    with tower_context.entering(2, 3, '/device:GPU:2', False):
      assert current_tower().index == 2
    assert current_tower() == TowerContext(0, 3, '/device:GPU:0', True)
  assert current_tower() == tower_context.OUTSIDE
