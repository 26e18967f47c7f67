"""The self-test's command line: its flags, their checks, and main.

`define_flags()` defines the flags (never at import) with validators, so
that a bad value stops the command at once with the rule, the value and the
fix, before TensorFlow runs anything: the device choice goes through the
library's own `make_config` (at most one of --num_gpus, --devices and
--num_cpu_devices; no more GPUs than are visible); the self-test's own flags
are checked here. With no device flag the towers are every visible GPU, or
two virtual CPU devices on a machine without GPUs. `main` makes the
MirroredStrategy before any session runs, then runs the checks (the speed
runs before the exactness runs, which turn op determinism on for the rest of
the process), prints the report in order and returns its exit status. With
--model_fn and --input_fn (together) it runs the own-model check instead of
the library's exactness and speed checks.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from absl import app
from absl import flags
import tensorflow as tf

import estimator_towers as et
from estimator_towers.base import spelling
from estimator_towers.placement import recommended
from estimator_towers.placement import strategies
from estimator_towers.selftest import environment
from estimator_towers.selftest import exactness
from estimator_towers.selftest import own_model
from estimator_towers.selftest import report
from estimator_towers.selftest import speed
from estimator_towers.selftest import user_code

_DEVICE_FLAGS = ('num_gpus', 'devices', 'num_cpu_devices')
# Speed defaults: (GPUs, CPUs). On CPUs the runs only show that they work.
_DEFAULTS = {'speed_steps': (100, 3), 'speed_warmup': (20, 1), 'speed_batch_size': (128, 16)}
_MINIMUM = {'speed_steps': 0, 'speed_warmup': 0, 'speed_batch_size': 1, 'steps': 1,
            'micro_batches': 1}


def define_flags(flag_values: flags.FlagValues | None = None) -> None:
  """Defines the self-test's flags and their validators on `flag_values` (default FLAGS)."""
  fv = flags.FLAGS if flag_values is None else flag_values
  flags.DEFINE_integer('num_gpus', None, 'Towers on GPUs /gpu:0 .. /gpu:N-1 (N >= 1).',
                       flag_values=fv)
  flags.DEFINE_list('devices', None, 'Explicit tower devices, e.g. /gpu:0,/gpu:2.',
                    flag_values=fv)
  flags.DEFINE_integer('num_cpu_devices', None,
                       'Towers on N virtual CPU devices (machines without GPUs). Without '
                       'any device flag: every visible GPU, or 2 virtual CPU devices.',
                       flag_values=fv)
  flags.DEFINE_enum('variable_strategy', None, sorted(strategies.STRATEGIES),
                    'Check this variable strategy only (default: every strategy in the '
                    'exactness check, the recommended one for the device count in the '
                    'speed check).', flag_values=fv)
  flags.DEFINE_string('json', None, 'Also write the report as JSON to this file.',
                      flag_values=fv)
  flags.DEFINE_integer('speed_steps', None,
                       'Timed steps per speed run (default 100 on GPUs, 3 on CPUs); 0 skips '
                       'the speed check.', flag_values=fv)
  flags.DEFINE_integer('speed_warmup', None, 'Untimed steps before them (default 20 on GPUs, '
                       '1 on CPUs).', flag_values=fv)
  flags.DEFINE_integer('speed_batch_size', None, 'Examples per device in the speed runs '
                       '(default 128 on GPUs, 16 on CPUs).', flag_values=fv)
  _define_own_model_flags(fv)
  for name, minimum in _MINIMUM.items():
    flags.register_validator(name, _at_least(name, minimum), flag_values=fv)
  flags.register_validator('json', _json_path, flag_values=fv)
  flags.register_multi_flags_validator(list(_DEVICE_FLAGS), _device_choice, flag_values=fv)
  flags.register_multi_flags_validator(['model_fn', 'input_fn', 'params'], _own_model,
                                       flag_values=fv)


def _define_own_model_flags(fv: flags.FlagValues) -> None:
  """The own-model check's flags: with --model_fn, it runs instead of the library's checks."""
  flags.DEFINE_string('model_fn', None, 'Check your own model_fn instead of the library\'s '
                      'models: module.path:function (with --input_fn).', flag_values=fv)
  flags.DEFINE_string('input_fn', None, 'The training input_fn for --model_fn: '
                      'module.path:function, giving global batches.', flag_values=fv)
  flags.DEFINE_string('params', None, 'The params dict for --model_fn and --input_fn, as a '
                      'JSON object.', flag_values=fv)
  flags.DEFINE_integer('steps', 3, 'Training steps of each --model_fn run.', flag_values=fv)
  flags.DEFINE_boolean('sync_batch_norm', None, 'The --model_fn runs with (or without) '
                       'synchronised batch norm (default: the library\'s).', flag_values=fv)
  flags.DEFINE_integer('micro_batches', 2, 'k in the --model_fn runs on 1 device x k and N '
                       'devices x k micro-batches (1: towers only).', flag_values=fv)


def _own_model(values: dict) -> bool:
  given = [f'--{k}' for k in ('model_fn', 'input_fn') if values.get(k)]
  if len(given) == 1:
    raise flags.ValidationError(
        f'--model_fn and --input_fn go together (the check trains your model on your '
        f'input), got {given[0]} alone. Give both, as module.path:function.')
  problems = [user_code.form_problem(k, values[k]) for k in ('model_fn', 'input_fn')
              if values.get(k)] + [user_code.params_problem(values.get('params'))]
  if values.get('params') is not None and not given:
    problems.append(f'--params={values["params"]} is for --model_fn and --input_fn. Give '
                    f'them too, or leave --params out.')
  if any(problems):
    raise flags.ValidationError(next(p for p in problems if p))
  return True


def _at_least(name: str, minimum: int):
  def check(value) -> bool:
    if value is not None and value < minimum:
      default = ' or 0 to skip the speed check' if name == 'speed_steps' else ''
      raise flags.ValidationError(
          f'--{name} must be at least {minimum}, got --{name}={value}. Leave it out for '
          f'the default{default}.')
    return True
  return check


def _json_path(value) -> bool:
  if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
    raise flags.ValidationError(
        f'--json={value}: the directory {os.path.dirname(os.path.abspath(value))} does not '
        f'exist. Create it, or name a file in an existing directory.')
  return True


def _device_settings(values: dict) -> dict:
  """The make_config settings of the device flags; none given: the GPUs, or 2 CPUs."""
  given = {k: values[k] for k in _DEVICE_FLAGS if values.get(k) is not None}
  if given:
    return given
  gpus = len(tf.config.list_physical_devices('GPU'))
  return {'num_gpus': gpus} if gpus else {'num_cpu_devices': 2}


def _device_choice(values: dict) -> bool:
  if values.get('num_gpus') == 0:
    raise flags.ValidationError(
        '--num_gpus=0 leaves no GPU to test. Use --num_gpus=N with N >= 1, or '
        '--num_cpu_devices=N for virtual CPU devices.')
  try:
    with spelling.flag_syntax():
      et.make_config(**_device_settings(values))
  except (TypeError, ValueError) as e:
    raise flags.ValidationError(str(e)) from e
  return True


def _speed_setting(fv: flags.FlagValues, name: str, gpus: bool) -> int:
  value = fv[name].value
  return _DEFAULTS[name][0 if gpus else 1] if value is None else value


def _speed_strategy(fv: flags.FlagValues, count: int, gpus: bool) -> str:
  if fv.variable_strategy:
    return fv.variable_strategy
  return recommended.choose('auto', ['/gpu:0' if gpus else '/cpu:0'] * count)[0]


class _NoDeprecations(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return 'deprecated' not in record.getMessage()


def _quiet_deprecations() -> None:
  """Warnings and errors on stderr, without TensorFlow's deprecation notices."""
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
  tf.get_logger().addFilter(_NoDeprecations())
  warnings.filterwarnings('ignore', message='.*is deprecated')


def main(argv, flag_values: flags.FlagValues | None = None) -> int:
  """Runs the checks, prints the report (and writes --json); 1 when a check FAILed."""
  del argv
  fv = flags.FLAGS if flag_values is None else flag_values
  _quiet_deprecations()
  settings = _device_settings({k: fv[k].value for k in _DEVICE_FLAGS})
  devices = tuple(et.make_config(**settings).plan.resolve())
  gpus = all(tf.DeviceSpec.from_string(d).device_type == 'GPU' for d in devices)
  timing = speed.Timing(batch_per_device=_speed_setting(fv, 'speed_batch_size', gpus),
                        warmup=_speed_setting(fv, 'speed_warmup', gpus),
                        steps=_speed_setting(fv, 'speed_steps', gpus))
  mirrored = None
  if timing.steps and len(devices) > 1 and not fv.model_fn:  # before any session runs
    try:
      mirrored = speed.make_mirrored(devices)
    except Exception as e:  # pylint: disable=broad-except  (reported by the speed check)
      mirrored = e
  note = ', '.join(f'{k}={v}' for k, v in settings.items())
  chosen = (fv.variable_strategy,) if fv.variable_strategy else tuple(strategies.STRATEGIES)

  def progress(name, check):
    print(f'estimator_towers.selftest: running the {name} check ...', file=sys.stderr, flush=True)
    return report.run_check(name, check)

  env = progress('environment', lambda: environment.check(devices, note))
  if fv.model_fn:
    results = [env, progress('own model', lambda: own_model.check_paths(
        fv.model_fn, fv.input_fn, fv.params, devices, fv.steps, fv.micro_batches,
        sync_batch_norm=fv.sync_batch_norm, variable_strategy=fv.variable_strategy))]
    return _finish(results, fv.json)
  timed = (progress('speed', lambda: speed.check(
      settings, devices, _speed_strategy(fv, len(devices), gpus), mirrored, timing))
           if timing.steps else report.Result('speed', report.INFO,
                                             ['skipped (--speed_steps=0)']))
  exact = progress('exactness', lambda: exactness.check(settings, devices, chosen))
  return _finish([env, exact, timed], fv.json)


def _finish(results: list, json_path: str | None) -> int:
  """Prints the report, writes --json, returns the exit status."""
  print(report.text(results), flush=True)
  if json_path:
    report.write_json(results, json_path)
  return report.exit_status(results)


def run(argv: list[str] | None = None) -> None:
  """`python -m estimator_towers.selftest`: defines the flags, parses argv, runs main."""
  define_flags()
  app.run(main, argv=argv)
