"""The own-model check (`python -m estimator_towers.selftest --model_fn=... --input_fn=...`).

The user's model is named by module path (`tests/own_model_example.py`): a
dense classifier with dropout and Adam, and the same model planted with a
difference (its loss scaled on every tower but the first, through
`current_tower()`). In this process, through the command's `main` on 2
virtual CPU devices and 2 micro-batches: the dense model passes (exit 0) and
its JSON gives every run, variable and slot; the planted one exits 1 naming
the first variable and the op one tower only builds. One real command line
in a fresh process gives the exit status and the JSON; the flags' errors are
tried here, as is a user's module that cannot be imported.

The rounding floor (`rounding_floor`): a tiny ResNet whose float32 training
moves by more than 1e-5 with the rounding alone (ReLUs on their kink, as a
deep ResNet has; `own_model_example.resnet_model_fn`) passes on 2 towers,
which differ from one device by more than 1e-5 but no more than the
reference nudged by one unit in the last place does; the same model with a
real difference (each tower's own batch-norm statistics) still fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import flags
import pytest

from estimator_towers.selftest import cli
from estimator_towers.selftest import one_start
from estimator_towers.selftest import own_model
from estimator_towers.selftest import user_code
from test_selftest import _parse  # the flags' error for a command line

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
MODULE = 'own_model_example'
DEVICE_FLAGS = ['--num_cpu_devices=2', '--micro_batches=2', '--steps=2',
                '--params={"batch_size": 10}']


def _main(tmp_path, model_fn: str, *extra: str) -> tuple[int, dict]:
  """The command's main in this process: (exit status, the JSON report)."""
  path = tmp_path / 'report.json'
  flag_values = flags.FlagValues()
  cli.define_flags(flag_values)
  flag_values(['selftest', f'--model_fn={MODULE}:{model_fn}', f'--input_fn={MODULE}:input_fn',
               f'--json={path}', *DEVICE_FLAGS, *extra])
  if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
  status = cli.main([], flag_values)
  return status, json.loads(path.read_text())


@pytest.fixture(scope='module')
def passed(tmp_path_factory):
  return _main(tmp_path_factory.mktemp('pass'), 'model_fn')


def test_a_dense_model_passes_on_towers_and_micro_batches(passed):
  status, found = passed
  assert status == 0 and found['status'] == 'PASS', found
  (check,) = [c for c in found['checks'] if c['name'] == 'own model']
  runs = check['data']['runs']
  assert [r['label'] for r in runs] == ['2 towers', '1 device x 2 micro-batches',
                                        '2 towers x 2 micro-batches']
  assert all(r['status'] == 'PASS' and r['max_difference'] <= 1e-5 and r['steps'] == 2
             for r in runs), runs


def test_the_json_gives_each_variable_and_slot_and_the_work_per_device(passed):
  _, found = passed
  (check,) = [c for c in found['checks'] if c['name'] == 'own model']
  data = check['data']
  assert data['base_tolerance'] == 1e-5 and data['rounding_floor'] < 1e-4  # 2e-6 to 1e-5 here
  assert data['tolerance'] == max(1e-5, 4 * data['rounding_floor'])
  assert data['steps'] == 2 and data['params'] == {'batch_size': 10}
  assert data['reference'] == '/device:CPU:0' and data['op_determinism'] is False
  towers = data['runs'][0]
  names = [d['variable'] for d in towers['differences']]
  assert names[:4] == ['global_step', 'hidden/kernel', 'hidden/bias', 'logits/kernel'], names
  assert {'hidden/kernel/Adam', 'hidden/kernel/Adam_1', 'beta1_power'} <= set(names)  # slots
  assert not any(n.startswith('input_position/') for n in names)
  # the step's heavy ops per device: two matrix products forward, three backward (the
  # first layer's input gradient, which nothing reads, is not run)
  assert towers['heavy_ops'] == {'/device:CPU:0': 5, '/device:CPU:1': 5}, towers
  assert towers['first_device_extra_share'] == 0.0
  assert any(line == 'op determinism not needed (CPU devices only)' for line in check['lines'])


def test_a_model_that_reads_its_tower_fails_naming_the_variable_and_the_op(tmp_path):
  status, found = _main(tmp_path, 'tower_dependent_model_fn', '--micro_batches=1')
  assert status == 1 and found['status'] == 'FAIL'
  (check,) = [c for c in found['checks'] if c['name'] == 'own model']
  (run,) = check['data']['runs']
  assert run['status'] == 'FAIL' and run['max_difference'] > 1e-5, run
  assert check['data']['first_variable'] == run['first_variable'] == 'hidden/kernel'
  assert check['data']['op'].startswith('tower_1/mul'), check['data']['op']
  assert 'built in one tower only' in check['data']['op']
  assert any(f'first variable above {run["tolerance"]:.3g}: hidden/kernel' in line
             for line in check['lines']), check['lines']


def test_the_command_line_exits_1_on_a_difference_and_writes_the_json(tmp_path):
  env = dict(os.environ, CUDA_VISIBLE_DEVICES='', TF_CPP_MIN_LOG_LEVEL='2',
             PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
  process = subprocess.run(
      [sys.executable, '-m', 'estimator_towers.selftest', '--num_cpu_devices=2',
       '--micro_batches=1', '--steps=2', f'--model_fn={MODULE}:tower_dependent_model_fn',
       f'--input_fn={MODULE}:input_fn', f'--json={tmp_path / "r.json"}'],
      cwd=TESTS, env=env, text=True, capture_output=True, timeout=240, check=False)
  assert process.returncode == 1, process.stdout + process.stderr[-3000:]
  lines = process.stdout.splitlines()
  assert lines[-1] == '== result: FAIL (failed: own model) ==', process.stdout
  assert any(line.startswith('FAIL  2 towers ') for line in lines), process.stdout
  assert json.loads((tmp_path / 'r.json').read_text())['status'] == 'FAIL'


def test_a_module_that_cannot_be_imported_is_the_checks_fail(tmp_path):
  path = tmp_path / 'report.json'
  flag_values = flags.FlagValues()
  cli.define_flags(flag_values)
  flag_values(['selftest', '--model_fn=no_such_module:model_fn', f'--input_fn={MODULE}:input_fn',
               f'--json={path}', '--num_cpu_devices=2'])
  assert cli.main([], flag_values) == 1
  (check,) = [c for c in json.loads(path.read_text())['checks'] if c['name'] == 'own model']
  assert check['status'] == 'FAIL'
  assert ('--model_fn=no_such_module:model_fn: the module no_such_module cannot be imported'
          in check['lines'][0]), check['lines']


def test_the_runs_start_from_one_checkpoint(tmp_path):
  """One device and two towers, one step each from the step-0 checkpoint: the same values."""
  sys.path.insert(0, TESTS)
  import own_model_example  # pylint: disable=g-import-not-at-top
  start = one_start.initial_checkpoint(own_model_example.model_fn, own_model_example.input_fn,
                                       '/cpu:0', {}, str(tmp_path))
  runs = [one_start.train(own_model_example.model_fn, own_model_example.input_fn, devices, 1,
                          {}, start, 1, str(tmp_path))
          for devices in (['/cpu:0'], ['/cpu:0', '/cpu:1'])]
  assert own_model.differences(runs[0], runs[1])['hidden/kernel'] <= 1e-5


def _resnet_check(**settings):
  sys.path.insert(0, TESTS)
  import own_model_example  # pylint: disable=g-import-not-at-top
  return own_model.check_model(own_model_example.resnet_model_fn,
                               own_model_example.resnet_input_fn, ['/cpu:0', '/cpu:1'], steps=1,
                               micro_batches=1, **settings)


def test_a_model_whose_rounding_moves_it_beyond_1e5_passes_within_its_floor():
  result = _resnet_check()
  data = result.data
  (run,) = data['runs']
  assert data['rounding_floor'] > 1e-5, data  # the model: float32 rounding alone moves it
  assert run['max_difference'] > 1e-5, run  # the towers too: a fixed 1e-5 failed them
  assert data['tolerance'] == run['tolerance'] == 4 * data['rounding_floor']
  assert run['max_difference'] <= data['tolerance'], run
  assert result.status == 'PASS' and run['status'] == 'PASS', result.lines
  assert any(line.startswith('rounding floor ') for line in result.lines), result.lines


def test_the_floor_does_not_hide_a_real_difference():
  """Each tower's own batch-norm statistics: a difference of the gradient's size, a FAIL."""
  result = _resnet_check(sync_batch_norm=False)
  (run,) = result.data['runs']
  assert result.status == 'FAIL' and run['status'] == 'FAIL', result.lines
  assert run['max_difference'] > 10 * result.data['rounding_floor'], run
  assert run['first_variable'].startswith(('unit/', 'initial_bn/')), run['first_variable']


def test_error_model_fn_without_input_fn():
  assert ('--model_fn and --input_fn go together (the check trains your model on your input), '
          'got --model_fn alone. Give both') in _parse('--model_fn=a.b:f')


def test_error_a_path_without_a_function():
  assert ('--input_fn names a function as module.path:function (e.g. '
          '--input_fn=my_project.model:input_fn), got --input_fn=a.b.') in _parse(
              '--model_fn=a:f', '--input_fn=a.b')


def test_error_params_not_a_json_object():
  assert '--params is a JSON object (the model_fn\'s params dict), got --params=[1], a list' in \
      _parse('--model_fn=a:f', '--input_fn=a:g', '--params=[1]')
  assert '--params is a JSON object, got --params={x}' in _parse(
      '--model_fn=a:f', '--input_fn=a:g', '--params={x}')


def test_error_steps_below_one():
  assert '--steps must be at least 1, got --steps=0' in _parse('--steps=0')


def test_error_a_name_the_module_does_not_have():
  with pytest.raises(ValueError, match=r'--model_fn=own_model_example:nothing: '
                                       r'own_model_example has no nothing\. Name a function'):
    sys.path.insert(0, TESTS)
    user_code.load('model_fn', f'{MODULE}:nothing')
