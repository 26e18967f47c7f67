"""define_flags / config_from_flags, on fresh FlagValues (never the global FLAGS).

Includes one run: a config from flags trains a towered Estimator on two
virtual CPU devices, compared with the plain model_fn's step. Bad values fail
while absl parses argv, with messages in flag syntax.
"""

import dataclasses
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
from estimator_towers import session_config
from estimator_towers import TowersConfig
from estimator_towers.inputs import staging
from estimator_towers.placement import devices as devices_lib
from estimator_towers.placement import strategies as placement
from estimator_towers.settings import config as config_lib
from estimator_towers.settings import plan as plan_lib


def fake_gpus(monkeypatch, count: int) -> None:
  """Pretend `count` GPUs are visible (the machines here have none)."""
  monkeypatch.setattr(devices_lib, 'visible_gpus',
                      lambda: [f'/device:GPU:{i}' for i in range(count)])


def parsed(*args: str) -> flags.FlagValues:
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  flag_values(['prog', *args])
  return flag_values


def test_define_flags_twice_and_one_flag_per_field():
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  define_flags(flag_values)
  fields = {f.name for f in dataclasses.fields(TowersConfig)}
  assert fields <= set(flag_values)
  assert set(flag_values) - fields == set()


def test_define_flags_defaults_to_absl_flags(monkeypatch):
  fresh = flags.FlagValues()
  monkeypatch.setattr(flags, 'FLAGS', fresh)
  define_flags()
  fresh(['prog', '--num_cpu_devices=3'])
  assert config_from_flags() == make_config(num_cpu_devices=3)


def test_flag_defaults_equal_make_config_defaults():
  assert config_from_flags(parsed()) == make_config()


def test_strategy_choices_come_from_strategies():
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  assert sorted(flag_values['variable_strategy'].parser.enum_values) == sorted(
      ['auto', *placement.STRATEGIES])
  assert flag_values['variable_strategy'].default == 'auto'
  with pytest.raises(flags.IllegalFlagValueError):
    flag_values(['prog', '--variable_strategy=nowhere'])


def test_all_flags():
  config = config_from_flags(parsed(
      '--num_cpu_devices=3', '--variable_strategy=cpu', '--staging_depth=2',
      '--loss_reduction=sum', '--log_device_placement', '--noallow_soft_placement',
      '--gpu_memory_fraction=0.5', '--allow_growth', '--visible_gpus=1,0',
      '--intra_op_threads=2', '--inter_op_threads=4', '--micro_batches=3'))
  assert config.plan == make_plan(devices=['/cpu:0', '/cpu:1', '/cpu:2'],
                                  variable_strategy='cpu', loss_reduction='sum',
                                  staging_depth=2, micro_batches=3)
  proto = session_config(config)
  assert dict(proto.device_count) == {'CPU': 3}
  assert proto.log_device_placement and not proto.allow_soft_placement
  assert proto.gpu_options.per_process_gpu_memory_fraction == pytest.approx(0.5)
  assert proto.gpu_options.allow_growth
  assert proto.gpu_options.visible_device_list == '1,0'
  assert proto.intra_op_parallelism_threads == 2
  assert proto.inter_op_parallelism_threads == 4


def test_devices_flag():
  config = config_from_flags(parsed('--devices=/cpu:0,/cpu:1'))
  assert config.plan == make_plan(devices=['/cpu:0', '/cpu:1'])
  assert dict(session_config(config).device_count) == {'CPU': 2}


def test_num_gpus_flag(monkeypatch):
  fake_gpus(monkeypatch, 4)
  config = config_from_flags(parsed('--num_gpus=2', '--visible_gpus=2,3'))
  assert config.plan == make_plan(num_gpus=2)
  proto = session_config(config)
  assert proto.gpu_options.visible_device_list == '2,3'
  assert dict(proto.device_count) == {}


# --- Errors: checked while absl parses argv, in flag syntax ---------------------

@pytest.mark.parametrize('args, message', [
    (['--num_gpus=2', '--num_cpu_devices=2'],
     r'Give at most one of --num_gpus, --devices and --num_cpu_devices, got '
     r'--num_gpus=2 and --num_cpu_devices=2\.'),
    (['--num_cpu_devices=0'],
     r'--num_cpu_devices must be a positive integer .*got --num_cpu_devices=0\. '
     r'Use --num_cpu_devices=2 .* or --num_gpus=0 to train on the CPU'),
    (['--num_gpus=-1'],
     r'--num_gpus must be 0 \(train on the CPU\) or a positive integer .*got --num_gpus=-1'),
    (['--devices='], r'--devices must name at least one device; got --devices=\. '
     r'Pass e\.g\. --devices=/gpu:0,/gpu:1'),
    (['--devices=/cpu:0,/device:CPU:0'],
     r'Remove the duplicate from --devices=/cpu:0,/device:CPU:0'),
    (['--staging_depth=-1'], r'--staging_depth must be a non-negative integer .*got --staging_depth=-1'),
    (['--micro_batches=0'], r'--micro_batches must be a positive integer .*got '
     r'--micro_batches=0\. Use --micro_batches=1 for none'),
    (['--gpu_memory_fraction=1.5'],
     r'--gpu_memory_fraction must be 0 .* or in \(0, 1\] .*got --gpu_memory_fraction=1\.5'),
    (['--visible_gpus=first'],
     r'--visible_gpus must be a comma-separated list .*got --visible_gpus=first'),
    (['--num_gpus=2', '--visible_gpus=0'],
     r'--num_gpus=2 needs 2 GPUs but --visible_gpus=0 shows the session only 1'),
    (['--intra_op_threads=-1'],
     r'--intra_op_threads must be a non-negative integer .*got --intra_op_threads=-1'),
    (['--worker_timeout_secs=0'],
     r'--worker_timeout_secs must be a positive number of seconds .*got '
     r'--worker_timeout_secs=0\.0\. The default is 120'),
])
def test_flag_errors_at_parse_time_in_flag_syntax(args, message):
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  with pytest.raises(flags.IllegalFlagValueError, match=message) as raised:
    flag_values(['prog', *args])
  # No Python spelling (num_gpus=2, devices=[...]) in the advice.
  assert not re.search(r"(?<![-\w])(num_gpus|num_cpu_devices|devices)=[\[\d]",
                       str(raised.value).split(': ', 1)[1]), str(raised.value)


@pytest.mark.parametrize('args, expected', [([], True), (['--resume_input'], True),
                                            (['--noresume_input'], False)])
def test_resume_input_flag_reaches_the_plan(args, expected):
  config = config_from_flags(parsed('--num_cpu_devices=2', *args))
  assert config.resume_input is expected
  assert config.plan == make_plan(devices=['/cpu:0', '/cpu:1'], resume_input=expected)
  assert config.plan.resume_input is expected


def test_resume_input_not_a_bool_in_flag_syntax():
  """A value set after parsing (validators bypassed): the fix names both flags."""
  flag_values = parsed()
  flag_values['resume_input'].value = 1
  with pytest.raises(ValueError, match=r'--resume_input must be True or False, got '
                     r'--resume_input=1: use --resume_input \(the default\) .* or '
                     r'--noresume_input to read the input from its first element'):
    config_from_flags(flag_values)


def test_config_from_flags_errors_in_flag_syntax():
  """Values set after parsing (validators bypassed) are checked again."""
  flag_values = parsed()
  flag_values['num_cpu_devices'].value = 0
  with pytest.raises(ValueError, match='got --num_cpu_devices=0'):
    config_from_flags(flag_values)


def test_missing_gpus_are_an_error_at_parse_time_naming_the_fixes(monkeypatch):
  fake_gpus(monkeypatch, 1)
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  with pytest.raises(flags.IllegalFlagValueError,
                     match=r'--num_gpus=3 asks for 3 GPUs but 1 is visible') as raised:
    flag_values(['prog', '--num_gpus=3'])
  named = set(re.findall(r'--(\w+)', str(raised.value)))
  assert {'num_gpus', 'num_cpu_devices', 'allow_cpu_fallback'} <= named
  assert named <= set(flag_values)
  for fix in ('--num_gpus=1', '--num_gpus=0', '--num_cpu_devices=3', '--allow_cpu_fallback'):
    assert fix in str(raised.value)


def test_num_gpus_zero_trains_on_the_cpu():
  config = config_from_flags(parsed('--num_gpus=0'))
  assert config.plan.resolve() == ('/device:CPU:0',)


def test_allow_cpu_fallback_flag(monkeypatch):
  fake_gpus(monkeypatch, 0)
  config = config_from_flags(parsed('--num_gpus=2', '--allow_cpu_fallback'))
  assert config.allow_cpu_fallback and config.plan.allow_cpu_fallback
  assert config.plan.resolve() == ('/device:CPU:0', '/device:CPU:0')


# --- Help ------------------------------------------------------------------------

def test_flags_are_key_flags_of_the_calling_module():
  """A script's --help lists the key flags of its module: ours must be among them."""
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  key = {f.name for f in flag_values.get_key_flags_for_module(__name__)}
  assert set(config_lib.FIELDS) <= key
  assert '--num_gpus' in flag_values.module_help(__name__)


def test_help_texts_describe_every_choice():
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  for name in config_lib.FIELDS:
    assert len(flag_values[name].help) > 30, name
  for name, values in (('variable_strategy', ['auto', *placement.STRATEGIES]),
                       ('staging_backend', staging.BACKENDS),
                       ('loss_reduction', plan_lib.LOSS_REDUCTIONS)):
    if name != 'staging_backend':  # A string flag: removed values get their own message.
      assert sorted(flag_values[name].parser.enum_values) == sorted(values)
    for value in values:
      assert f'{value}: ' in flag_values[name].help, (name, value)
  assert 'host CPU' in flag_values['variable_strategy'].help
  assert '0 trains on the CPU' in flag_values['num_gpus'].help


def test_config_from_flags_needs_define_flags():
  flag_values = flags.FlagValues()
  flags.DEFINE_integer('num_gpus', None, 'someone else\'s flag', flag_values=flag_values)
  flag_values(['prog'])
  with pytest.raises(ValueError, match=r"config_from_flags needs the flags of define_flags\(\), "
                     r"but \['devices', 'num_cpu_devices'"):
    config_from_flags(flag_values)


# --- Running: the three-line script on two virtual CPU devices -----------------

def test_train_step_from_flags_matches_plain(tmp_path):
  batch = 7  # Not divisible by 2.
  x, y = testlib.data(batch)
  fn = testlib.input_fn(x, y, batch)

  # Without soft placement, /cpu:1 must exist: the session config creates it.
  config = config_from_flags(parsed('--num_cpu_devices=2', '--noallow_soft_placement',
                                    '--intra_op_threads=1', '--inter_op_threads=2'))
  estimator = tf.estimator.Estimator(
      replicate_model_fn(testlib.v1_model_fn, plan=config.plan),
      config=make_run_config(config, model_dir=str(tmp_path / 'towered'),
                             save_summary_steps=1000, log_step_count_steps=1000))
  estimator.train(fn, steps=1)

  plain = testlib.make_estimator(testlib.v1_model_fn, model_dir=str(tmp_path / 'plain'))
  plain.train(fn, steps=1)
  testlib.assert_variables_close(testlib.variables(estimator), testlib.variables(plain))


def test_staging_backend_flag_reaches_the_plan():
  config = config_from_flags(parsed('--staging_backend=staging_area', '--num_cpu_devices=2'))
  assert config.plan.staging_backend == 'staging_area'
  assert config_from_flags(parsed('--num_cpu_devices=2')).plan.staging_backend == 'staging_area'


def test_removed_staging_backend_flag_value():
  # Any string parses as a value; the flag's validator explains why this one is gone.
  with pytest.raises(flags.IllegalFlagValueError,
                     match="--staging_backend='multi_device_iterator' is no longer "
                           "available.*Use --staging_backend='staging_area'"):
    parsed('--staging_backend=multi_device_iterator', '--num_cpu_devices=2')


def test_worker_timeout_flag_reaches_the_plan():
  config = config_from_flags(parsed('--num_cpu_devices=2', '--worker_timeout_secs=7.5'))
  assert config.worker_timeout_secs == 7.5
  assert config.plan == make_plan(devices=['/cpu:0', '/cpu:1'], worker_timeout_secs=7.5)
