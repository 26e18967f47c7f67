"""TowersConfig / make_config / session_config / make_run_config.

References are built independently of the code under test: plans from
`make_plan` with the devices written out, ConfigProtos from their fields.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_estimator.python.estimator import run_config as run_config_lib

from estimator_towers import make_config
from estimator_towers import make_plan
from estimator_towers import make_run_config
from estimator_towers import session_config
from estimator_towers import TowersConfig
from estimator_towers.placement import devices as devices_lib
from estimator_towers.placement import strategies as placement


def test_defaults():
  config = make_config()
  assert config == TowersConfig()
  assert config.plan == make_plan()
  assert config.staging_depth == 1
  proto = session_config(config)
  assert dict(proto.device_count) == {}
  assert not proto.log_device_placement
  assert proto.gpu_options.per_process_gpu_memory_fraction == 0
  assert not proto.gpu_options.allow_growth
  assert proto.gpu_options.visible_device_list == ''
  assert proto.intra_op_parallelism_threads == proto.inter_op_parallelism_threads == 0
  # Soft placement and graph rewriting as in Estimator's default session config.
  default = run_config_lib.get_default_session_config()
  assert proto.allow_soft_placement == default.allow_soft_placement
  assert (proto.graph_options.rewrite_options.meta_optimizer_iterations
          == default.graph_options.rewrite_options.meta_optimizer_iterations)


def test_config_is_immutable():
  config = make_config(num_cpu_devices=2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.num_cpu_devices = 3


@pytest.mark.parametrize('n', [1, 2, 3])
def test_num_cpu_devices(n):
  config = make_config(num_cpu_devices=n, loss_reduction='sum', staging_depth=2,
                       micro_batches=n)
  expected = make_plan(devices=[f'/cpu:{i}' for i in range(n)],
                       loss_reduction='sum', staging_depth=2, micro_batches=n)
  assert config.plan == expected
  assert dict(session_config(config).device_count) == {'CPU': n}


def test_num_gpus(monkeypatch):
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: [f'/device:GPU:{i}' for i in range(4)])
  config = make_config(num_gpus=4, variable_strategy='cpu')
  assert config.plan == make_plan(num_gpus=4, variable_strategy='cpu')
  assert make_config(num_gpus=4).plan == make_plan(num_gpus=4)   # 'auto' both
  assert dict(session_config(config).device_count) == {}


def test_num_gpus_zero_is_the_cpu():
  config = make_config(num_gpus=0)
  assert config.plan == make_plan(num_gpus=0)
  assert config.plan.resolve() == ('/device:CPU:0',)
  assert dict(session_config(config).device_count) == {}


def test_missing_gpus_raise_at_make_config(monkeypatch):
  """Before a script creates anything; Python spelling from Python."""
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: [])
  with pytest.raises(ValueError, match=r'num_gpus=2 asks for 2 GPUs but 0 are visible.*'
                     r'num_gpus=0 to train on the CPU; num_cpu_devices=2 for 2 towers on '
                     r'virtual CPU devices; allow_cpu_fallback=True to run'):
    make_config(num_gpus=2)


def test_allow_cpu_fallback(monkeypatch):
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: ['/device:GPU:0'])
  config = make_config(num_gpus=3, allow_cpu_fallback=True)
  assert config.plan == make_plan(num_gpus=3, allow_cpu_fallback=True)
  assert config.plan.resolve() == ('/device:GPU:0', '/device:CPU:0', '/device:CPU:0')


@pytest.mark.parametrize('devices, cpus', [
    (['/cpu:0', '/cpu:2'], 3),
    (['/gpu:0', '/gpu:1'], None),
    (['/gpu:0', '/cpu:1'], 2),
    (['/job:worker/task:1/cpu:3', '/cpu:0'], 1),  # Remote CPUs are not local.
])
def test_devices(devices, cpus):
  config = make_config(devices=devices)
  assert config.plan == make_plan(devices=devices)
  assert config.devices == tuple(tf.DeviceSpec.from_string(d).to_string() for d in devices)
  expected = {} if cpus is None else {'CPU': cpus}
  assert dict(session_config(config).device_count) == expected


def test_session_config_fields():
  config = make_config(log_device_placement=True, allow_soft_placement=False,
                       gpu_memory_fraction=0.25, allow_growth=True,
                       visible_gpus=' 1, 0', intra_op_threads=3, inter_op_threads=5)
  proto = session_config(config)
  assert proto.log_device_placement and not proto.allow_soft_placement
  assert proto.gpu_options.per_process_gpu_memory_fraction == pytest.approx(0.25)
  assert proto.gpu_options.allow_growth
  assert proto.gpu_options.visible_device_list == '1,0'
  assert proto.intra_op_parallelism_threads == 3
  assert proto.inter_op_parallelism_threads == 5


def test_make_run_config(tmp_path):
  config = make_config(num_cpu_devices=2, intra_op_threads=1)
  run_config = make_run_config(config, model_dir=str(tmp_path), save_summary_steps=7)
  assert run_config.model_dir == str(tmp_path)
  assert run_config.save_summary_steps == 7
  assert run_config.session_config == session_config(config)


def test_strategy_added_later_is_accepted(monkeypatch):
  monkeypatch.setitem(placement.STRATEGIES, 'added_later', placement.CpuPlacement)
  config = make_config(num_cpu_devices=2, variable_strategy='added_later')
  assert config.plan.variable_strategy == 'added_later'


@pytest.mark.parametrize('value', [False, np.False_, True, np.True_])
def test_resume_input_reaches_the_plan(value):
  config = make_config(num_cpu_devices=2, resume_input=value)
  assert config.resume_input is bool(value)  # numpy's bool stored as Python's
  assert config.plan == make_plan(devices=['/cpu:0', '/cpu:1'], resume_input=bool(value))
  assert config.plan.resume_input is bool(value)
  assert make_config().plan.resume_input is True


# --- One test per error message ------------------------------------------------

def test_unknown_argument():
  with pytest.raises(TypeError, match=r"unknown argument\(s\) \['num_gpu'\]; the valid "
                     r"arguments are \['num_gpus', 'devices', 'num_cpu_devices'"):
    make_config(num_gpu=2)


@pytest.mark.parametrize('kwargs', [
    {'num_gpus': 2, 'num_cpu_devices': 2},
    {'devices': ['/cpu:0'], 'num_cpu_devices': 1},
    {'num_gpus': 1, 'devices': ['/gpu:0'], 'num_cpu_devices': 1},
])
def test_at_most_one_device_choice(kwargs):
  with pytest.raises(ValueError, match=r'Give at most one of num_gpus, devices and '
                     r'num_cpu_devices \(--num_gpus, --devices, --num_cpu_devices\), '
                     r'got ') as raised:
    make_config(**kwargs)
  for name, value in kwargs.items():
    assert f'{name}={value!r}' in str(raised.value)


@pytest.mark.parametrize('value', [0, -1, 1.5, True])
def test_num_cpu_devices_positive(value):
  with pytest.raises(ValueError,
                     match=f'num_cpu_devices must be a positive integer .*got {value!r}'):
    make_config(num_cpu_devices=value)


# make_plan's own checks surface at make_config time, with make_plan's messages.
@pytest.mark.parametrize('kwargs, message', [
    ({'num_gpus': -1}, r'num_gpus must be 0 \(train on the CPU\) or a positive integer'),
    ({'devices': '/cpu:0'}, 'devices must be a list of device strings'),
    ({'devices': []}, 'devices must name at least one device'),
    ({'devices': ['/cpu:0', '/device:CPU:0']}, 'Each tower needs its own device'),
    ({'devices': ['/nonsense:x:y']}, 'Cannot parse device string'),
    ({'variable_strategy': 'nowhere'}, "variable_strategy must be one of .*'nowhere'"),
    ({'loss_reduction': 'median'}, "loss_reduction must be one of .*'median'"),
    ({'staging_depth': -1}, 'staging_depth must be a non-negative integer'),
    ({'micro_batches': 0}, r'micro_batches must be a positive integer .* got 0\. Use '
     r'micro_batches=1 for none'),
])
def test_plan_errors_surface(kwargs, message):
  with pytest.raises(ValueError, match=message):
    make_config(**kwargs)


@pytest.mark.parametrize('name', ['log_device_placement', 'allow_soft_placement', 'allow_growth',
                                  'allow_cpu_fallback'])
def test_bool_fields(name):
  with pytest.raises(ValueError, match=f"{name} must be True or False .*--no{name}.*got 'yes'"):
    make_config(**{name: 'yes'})


@pytest.mark.parametrize('value', [1, 0, 'yes', None])
def test_resume_input_must_be_a_bool(value):
  with pytest.raises(ValueError, match=f'resume_input must be True or False, got {value!r}: use '
                     r'resume_input=True \(the default\) to save the position of a tf\.data '
                     r'input in every checkpoint.* or resume_input=False to read the input '
                     r'from its first element'):
    make_config(resume_input=value)


@pytest.mark.parametrize('name', ['intra_op_threads', 'inter_op_threads'])
@pytest.mark.parametrize('value', [-1, 2.0, True])
def test_thread_counts(name, value):
  with pytest.raises(ValueError, match=f'{name} must be a non-negative integer .*got {value!r}'):
    make_config(**{name: value})


@pytest.mark.parametrize('value', [-0.1, 1.5, True, 'half'])
def test_gpu_memory_fraction(value):
  with pytest.raises(ValueError, match=r'gpu_memory_fraction must be 0 .* or in \(0, 1\]'):
    make_config(gpu_memory_fraction=value)


@pytest.mark.parametrize('value', ['a', '0,0', '-1', '0,', 1])
def test_visible_gpus_format(value):
  with pytest.raises(ValueError, match='visible_gpus must be a comma-separated list of '
                     'distinct GPU indices'):
    make_config(visible_gpus=value)


@pytest.mark.parametrize('kwargs, asked', [
    ({'num_gpus': 3, 'visible_gpus': '0,1'}, r'num_gpus=3 needs 3 GPUs'),
    ({'devices': ['/gpu:0', '/gpu:2'], 'visible_gpus': '4,5'}, r'devices=.* needs 3 GPUs'),
])
def test_more_gpus_than_visible_gpus(kwargs, asked):
  with pytest.raises(ValueError, match=asked + ' but visible_gpus=.* only 2 .*--visible_gpus'):
    make_config(**kwargs)


@pytest.mark.parametrize('fn', [session_config, make_run_config])
def test_needs_towers_config(fn):
  with pytest.raises(TypeError, match=f'{fn.__name__} needs a TowersConfig'):
    fn({'num_gpus': 2})


def test_run_config_session_config_conflict():
  with pytest.raises(ValueError, match='builds session_config from the TowersConfig'):
    make_run_config(make_config(), session_config=tf.compat.v1.ConfigProto())


def test_every_make_plan_argument_is_a_make_config_argument():
  import inspect  # pylint: disable=g-import-not-at-top
  plan_only = set(inspect.signature(make_plan).parameters) - set(
      f.name for f in dataclasses.fields(TowersConfig))
  assert not plan_only, plan_only


def test_worker_timeout_from_make_config_reaches_the_plan():
  config = make_config(num_cpu_devices=2, variable_strategy='collective', worker_timeout_secs=9)
  assert config.plan.worker_timeout_secs == 9.0
  assert config.plan == make_plan(devices=['/cpu:0', '/cpu:1'], variable_strategy='collective',
                                  worker_timeout_secs=9)
