"""What a run says about its devices, on a machine without GPUs.

The machines here have no GPU; the tests that need "no GPU" say so with a
monkeypatched `visible_gpus`, so they mean the same on a GPU machine. The
reference for training is the plain model_fn on one device.
"""

import logging
import re

from absl import flags
import pytest
import tensorflow as tf

import testlib
from estimator_towers import config_from_flags
from estimator_towers import define_flags
from estimator_towers import make_config
from estimator_towers import make_plan
from estimator_towers import make_run_config
from estimator_towers import replicate_model_fn
from estimator_towers import staged_input_fn
from estimator_towers.base import logs
from estimator_towers.placement import devices as devices_lib

ModeKeys = tf.estimator.ModeKeys


@pytest.fixture
def no_gpus(monkeypatch):
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: [])
  monkeypatch.setattr(logs, '_warned', set())  # Each test sees its own warnings.


@pytest.fixture
def records(caplog):
  caplog.set_level(logging.INFO)
  return caplog


def messages(caplog, level: str) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelname == level]


def tower_logs(caplog) -> list[str]:
  return [m for m in messages(caplog, 'INFO') if m.startswith('estimator_towers:')]


def parsed(*args: str) -> flags.FlagValues:
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  flag_values(['prog', *args])
  return flag_values


def test_num_gpus_2_without_gpus_is_an_error_listing_devices_and_fixes(no_gpus):
  with pytest.raises(flags.IllegalFlagValueError) as raised:
    parsed('--num_gpus=2')
  message = str(raised.value)
  assert '--num_gpus=2 asks for 2 GPUs but 0 are visible' in message
  # The visible devices, by name.
  for device in tf.config.list_physical_devices():
    assert device.name in message
  for fix in ('--num_gpus=0', '--num_cpu_devices=2', '--allow_cpu_fallback'):
    assert fix in message
  # The same from Python, in Python syntax, also at graph construction.
  with pytest.raises(ValueError, match=r'num_gpus=2 asks for 2 GPUs .*allow_cpu_fallback=True'):
    make_config(num_gpus=2)
  towered = replicate_model_fn(testlib.v1_model_fn, num_gpus=2)
  x, y = testlib.data(4)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    with pytest.raises(ValueError, match=r'num_gpus=2 asks for 2 GPUs'):
      towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, testlib.run_config(1))


def test_cpu_fallback_warns_once_naming_the_cpu_and_logs_the_real_devices(
    no_gpus, records, tmp_path):
  config = config_from_flags(parsed('--num_gpus=2', '--allow_cpu_fallback'))
  estimator = tf.estimator.Estimator(
      replicate_model_fn(testlib.v1_model_fn, plan=config.plan),
      config=make_run_config(config, model_dir=str(tmp_path / 'towered'),
                             save_summary_steps=1000, log_step_count_steps=1000))
  x, y = testlib.data(7)
  fn = testlib.input_fn(x, y, 7)
  estimator.train(fn, steps=1)
  estimator.evaluate(fn)

  warnings = [m for m in messages(records, 'WARNING') if 'asks for' in m]
  assert len(warnings) == 1, warnings  # config, train graph, eval graph: one warning.
  assert '/device:CPU:0' in warnings[0] and '--allow_cpu_fallback is set' in warnings[0]
  # Once per graph, naming the devices the towers got; no GPU claimed.
  assert tower_logs(records) == [
      'estimator_towers: train graph: 2 tower(s) on /device:CPU:0, /device:CPU:0; '
      'variables on /device:CPU:0 (variable_strategy=cpu, chosen for towers on CPU devices: '
      'the host adds their gradients, loss_reduction=auto).',
      'estimator_towers: eval graph: 2 tower(s) on /device:CPU:0, /device:CPU:0; '
      'variables on /device:CPU:0 (variable_strategy=cpu, chosen for towers on CPU devices: '
      'the host adds their gradients, loss_reduction=auto).']

  plain = testlib.make_estimator(testlib.v1_model_fn, model_dir=str(tmp_path / 'plain'))
  plain.train(fn, steps=1)
  testlib.assert_variables_close(testlib.variables(estimator), testlib.variables(plain))


def test_fallback_with_some_gpus_keeps_them(monkeypatch):
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: ['/device:GPU:0'])
  monkeypatch.setattr(logs, '_warned', set())
  plan = make_plan(num_gpus=3, allow_cpu_fallback=True)
  assert plan.resolve() == ('/device:GPU:0', '/device:CPU:0', '/device:CPU:0')


@pytest.mark.parametrize('num_towers', [2, 3])
def test_placement_log_once_per_graph_not_per_call(records, num_towers):
  towered = replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(num_towers))
  x, _ = testlib.data(5)
  for _ in range(2):  # Two graphs.
    with tf.Graph().as_default():
      for _ in range(3):  # Three calls in one graph.
        towered(tf.constant(x), None, ModeKeys.PREDICT, None, None)
  devices = ', '.join(f'/device:CPU:{k}' for k in range(num_towers))
  expected = (f'estimator_towers: infer graph: {num_towers} tower(s) on {devices}; '
              f'variables on /device:CPU:0 (variable_strategy=cpu, chosen for towers on '
              f'CPU devices: the host adds their gradients, loss_reduction=auto).')
  assert tower_logs(records) == [expected, expected]


def test_num_gpus_zero_trains_on_the_cpu_like_plain(records, tmp_path):
  towered = replicate_model_fn(testlib.v1_model_fn, num_gpus=0)
  x, y = testlib.data(7)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, None)
  assert {op.device for op in graph.get_operations() if op.type == 'MatMul'} == {'/device:CPU:0'}
  assert re.match(r'estimator_towers: train graph: 1 tower\(s\) on /device:CPU:0;',
                  tower_logs(records)[0])

  fn = testlib.input_fn(x, y, 7)
  estimator = testlib.make_estimator(towered, model_dir=str(tmp_path / 'towered'))
  estimator.train(fn, steps=2)
  plain = testlib.make_estimator(testlib.v1_model_fn, model_dir=str(tmp_path / 'plain'))
  plain.train(fn, steps=2)
  testlib.assert_variables_close(testlib.variables(estimator), testlib.variables(plain))


def test_explicit_devices_naming_missing_gpus_warn_once(no_gpus, records):
  towered = replicate_model_fn(testlib.v1_model_fn, devices=['/gpu:0', '/gpu:1'])
  x, _ = testlib.data(4)
  for _ in range(2):
    with tf.Graph().as_default():
      towered(tf.constant(x), None, ModeKeys.PREDICT, None, None)
  warnings = [m for m in messages(records, 'WARNING') if 'not visible' in m]
  assert len(warnings) == 1
  assert warnings[0].startswith('Tower devices /device:GPU:0, /device:GPU:1 name GPUs '
                                'that are not visible here')


def test_cpu_fallback_with_staged_input(no_gpus, tmp_path):
  """Fallback towers share the CPU device; staged input still feeds each its shard."""
  plan = make_plan(num_gpus=2, allow_cpu_fallback=True)
  x, y = testlib.data(7)
  fn = testlib.input_fn(x, y, 7)
  estimator = testlib.make_estimator(replicate_model_fn(testlib.v1_model_fn, plan=plan),
                                     model_dir=str(tmp_path / 'towered'))
  estimator.train(staged_input_fn(fn, plan), steps=1)
  plain = testlib.make_estimator(testlib.v1_model_fn, model_dir=str(tmp_path / 'plain'))
  plain.train(fn, steps=1)
  testlib.assert_variables_close(testlib.variables(estimator), testlib.variables(plain))


def test_serving_graph_is_logged_as_the_plain_model_fn(records):
  towered = replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(2))
  with tf.Graph().as_default() as graph:
    features = tf.compat.v1.placeholder(tf.float32, [None, testlib.NUM_FEATURES])
    towered(features, None, ModeKeys.PREDICT, None, None)
  assert {op.device for op in graph.get_operations()} == {''}
  assert tower_logs(records) == ['estimator_towers: infer graph: the plain model_fn, without '
                                 'towers or device pins (a serving graph).']
