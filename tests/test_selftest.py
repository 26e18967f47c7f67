"""The self-test (`python -m estimator_towers.selftest`): its report, its FAIL, its flags.

Two real runs in fresh processes, started together (graph building is mostly
one core each): the command line on 2 virtual CPU devices, which must PASS
with exit status 0 and a JSON report (without the speed check's ResNet-20
runs, which CI runs from the installed wheel; the speed report is checked
with stand-in timings); and the same command with a deliberate
fault, put in through the Python API (tower 1's per-example losses scaled
by 1.01 through `current_tower()`, so its gradient is too), which must
print FAIL with the worst variable and exit with status 1. The flags' checks
and a crashing check are tried in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import flags
import numpy as np
import pytest

from estimator_towers.selftest import cli
from estimator_towers.selftest import report
from estimator_towers.selftest import speed
from estimator_towers.selftest import exactness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAULT = """
import sys
import tensorflow as tf
import estimator_towers as et
from estimator_towers.selftest import cli, exactness

def faulty_model_fn(features, labels, mode):
  per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels, exactness.network(features, mode))
  # Tower 1's examples count 1.01 times: its gradient is scaled.
  per_example *= tf.constant(1.01 if et.current_tower().index == 1 else 1.0)
  return exactness.train_spec(mode, exactness.ratio_loss(per_example, features['weight']))

exactness.model_fn = faulty_model_fn
cli.run(sys.argv)
"""


def _start(args: list[str], directory: str) -> subprocess.Popen:
  env = dict(os.environ, CUDA_VISIBLE_DEVICES='', TF_CPP_MIN_LOG_LEVEL='2', TMPDIR=directory,
             PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
  return subprocess.Popen([sys.executable, *args], cwd=directory, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope='module')
def runs():
  """{'pass': ..., 'fault': ...}: (exit status, stdout, stderr, the JSON report)."""
  directory = tempfile.mkdtemp(prefix='et_selftest_test_')
  started = {
      # The speed check's ResNet-20 runs cost most of a minute here: CI runs them from the
      # wheel (.ci/run); its report is checked below with stand-in timings.
      'pass': _start(['-m', 'estimator_towers.selftest', '--num_cpu_devices=2',
                      '--speed_steps=0', '--json=pass.json'], directory),
      'fault': _start(['-c', FAULT, '--num_cpu_devices=2', '--variable_strategy=cpu',
                       '--speed_steps=0', '--json=fault.json'], directory),
  }
  done = {}
  for name, process in started.items():
    out, err = process.communicate(timeout=240)
    path = os.path.join(directory, f'{name}.json')
    found = json.load(open(path, encoding='utf-8')) if os.path.exists(path) else None
    done[name] = (process.returncode, out, err, found)
  return done


def test_the_command_line_passes_on_two_virtual_cpus(runs):
  status, out, err, found = runs['pass']
  assert status == 0, out + err[-3000:]
  lines = out.splitlines()
  assert lines[-1] == '== result: PASS =='
  for section in ('environment (INFO', 'exactness (PASS', 'speed (INFO'):
    assert any(line.startswith(f'== {section}') for line in lines), out
  assert any(line.startswith('TensorFlow 2.15') for line in lines), out
  assert 'towers: /device:CPU:0, /device:CPU:1 (num_cpu_devices=2)' in lines, out
  for strategy in ('cpu', 'gpu', 'replicated', 'collective (ring)'):
    assert any(line.startswith(f'PASS  {strategy} ') for line in lines), out
  assert 'skipped (--speed_steps=0)' in lines, out
  assert found['status'] == 'PASS'
  checks = {c['name']: c for c in found['checks']}
  assert list(checks) == ['environment', 'exactness', 'speed']
  assert checks['environment']['data']['towers'] == ['/device:CPU:0', '/device:CPU:1']
  *exact, grid = checks['exactness']['data']['runs']
  assert [r['variable_strategy'] for r in exact] == ['cpu', 'gpu', 'replicated', 'collective']
  assert all(r['status'] == 'PASS' and r['max_difference'] <= 1e-5 for r in exact), exact
  assert f'PASS  {"fixed grid (shards=2)":28s} bit-identical to one device on the grid' in lines, out
  assert grid['status'] == 'PASS' and grid['differing'] == [] and grid['max_difference'] == 0


def test_the_speed_report_gives_each_run_its_rate_and_scaling(monkeypatch):
  """The speed check's lines and JSON, its runs timed by stand-ins (1 device: 10 steps/sec;
  2 devices: 8, 6 and a crash): examples/sec, scaling efficiency against one device."""
  def crash():
    raise RuntimeError('no NCCL')
  stand_ins = [('towered, 1 device', 1, lambda: 10.0), ('towered, 2 devices', 2, lambda: 8.0),
               ('staged', 2, lambda: 6.0), ('MirroredStrategy', 2, crash)]
  monkeypatch.setattr(speed, 'runs', lambda *args: stand_ins)
  result = speed.check({}, ('/cpu:0', '/cpu:1'), 'cpu', None, speed.Timing(4, 1, 3))
  assert result.status == report.FAIL
  runs = result.data['runs']
  assert [r.get('examples_per_sec') for r in runs] == [40.0, 64.0, 48.0, None]
  assert [r.get('scaling_efficiency') for r in runs] == [None, 0.8, 0.6, None]
  assert runs[3]['error'] == 'RuntimeError: no NCCL'
  assert any(line.startswith('NOTE  CPU figures say nothing about GPUs') for line in result.lines)
  assert sum('steps/sec' in line for line in result.lines) == 3, result.lines
  assert result.lines[-1] == 'FAIL  MirroredStrategy: crashed: RuntimeError: no NCCL'


def test_a_faulty_tower_fails_the_exactness_check_and_the_exit_status(runs):
  status, out, err, found = runs['fault']
  assert status == 1, out + err[-3000:]
  lines = out.splitlines()
  assert lines[-1] == '== result: FAIL (failed: exactness) ==', out
  (row,) = [line for line in lines if line.startswith('FAIL  cpu ')]
  assert 'max difference' in row and ' at ' in row, row
  assert 'skipped (--speed_steps=0)' in lines
  run, _ = next(c for c in found['checks'] if c['name'] == 'exactness')['data']['runs']
  assert found['status'] == 'FAIL' and run['status'] == 'FAIL'
  assert run['max_difference'] > 1e-5, run


def test_the_fixed_grid_row_fails_when_a_variable_is_not_bit_identical(monkeypatch):
  """One ulp in one variable of the towered run (stand-in trainings): FAIL, naming it."""
  trained = iter([{'w': np.float32([1.0, 2.0]), 'b': np.float32(3.0)},
                  {'w': np.float32([1.0, np.nextafter(np.float32(2.0), np.float32(3.0))]),
                   'b': np.float32(3.0)}])
  monkeypatch.setattr(exactness, '_trained', lambda *args: next(trained))
  line, run = exactness.grid_run({'num_cpu_devices': 2}, ('/cpu:0', '/cpu:1'), None)
  assert line.startswith(f'FAIL  {"fixed grid (shards=2)":28s} not bit-identical to one '
                         "device on the grid: 1 variable(s) differ (['w'])"), line
  assert run['status'] == 'FAIL' and run['differing'] == ['w'] and run['variable'] == 'w'


def test_a_crashing_check_is_its_fail_and_the_others_still_report():
  def crash():
    raise RuntimeError('no kernel for this device')
  results = [report.run_check('environment', lambda: report.Result('environment', lines=['ok'])),
             report.run_check('speed', crash)]
  assert results[1].status == report.FAIL
  assert results[1].lines == ['FAIL  the check crashed: RuntimeError: no kernel for this device']
  assert 'Traceback' in results[1].error
  text = report.text(results)
  assert '== environment (INFO, 0 s) ==\nok' in text
  assert text.endswith('== result: FAIL (failed: speed) ==')
  assert report.exit_status(results) == 1
  assert report.exit_status(results[:1]) == 0


def _parse(*args: str) -> str:
  """The message of the flags' error for `args`."""
  flag_values = flags.FlagValues()
  cli.define_flags(flag_values)
  with pytest.raises(flags.Error) as raised:
    flag_values(['selftest', *args])
  return str(raised.value)


def test_error_more_than_one_device_flag():
  assert 'Give at most one of --num_gpus, --devices and --num_cpu_devices, got ' \
         '--num_gpus=1 and --num_cpu_devices=2' in _parse('--num_gpus=1', '--num_cpu_devices=2')


def test_error_num_gpus_zero():
  assert '--num_gpus=0 leaves no GPU to test. Use --num_gpus=N with N >= 1' in _parse(
      '--num_gpus=0')


def test_error_more_gpus_than_visible():
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if tf.config.list_physical_devices('GPU'):
    pytest.skip('this machine has GPUs')
  message = _parse('--num_gpus=2')
  assert '--num_gpus=2' in message and '0 are visible' in message, message


def test_error_num_cpu_devices_not_positive():
  assert '--num_cpu_devices must be a positive integer (the number of towers), got ' \
         '--num_cpu_devices=0' in _parse('--num_cpu_devices=0')


@pytest.mark.parametrize('flag, value, minimum, extra', [
    ('speed_steps', -1, 0, ' or 0 to skip the speed check'),
    ('speed_warmup', -1, 0, ''),
    ('speed_batch_size', 0, 1, ''),
])
def test_error_speed_setting_below_its_minimum(flag, value, minimum, extra):
  assert (f'--{flag} must be at least {minimum}, got --{flag}={value}. Leave it out for the '
          f'default{extra}.') in _parse(f'--{flag}={value}')


def test_error_json_in_a_missing_directory(tmp_path):
  path = tmp_path / 'missing' / 'report.json'
  assert (f'--json={path}: the directory {tmp_path / "missing"} does not exist. Create it'
          in _parse(f'--json={path}'))


def test_error_unknown_variable_strategy():
  assert "value should be one of <collective|cpu|gpu|replicated>" in _parse(
      '--variable_strategy=nccl')
