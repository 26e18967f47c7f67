"""TF1 behaviour: `disable_v2_behavior()` and each of its parts, exact and data-parallel.

TF1 behaviour is process-global, so each behaviour's checks run in a process
of their own (tests/tf1_behaviour_task.py, one per behaviour, bounded in time).
Under `disable_v2_behavior()`: the dense model (tf.compat.v1.layers) and
BERT-style einsum attention on 2 towers, 1 device x 2 micro-batches and 2 x 2;
batch norm with the library's defaults (Keras', and tf.compat.v1.layers' twice)
on 2 towers; the dense model with a tf.cond (not chosen by the batch) on 2 x 2.
Under each part alone: the dense, einsum-attention and cond models on 2 x 2 and
the two batch norms on 2 towers. Each must train as the plain model_fn on one
device (every variable, slot and moving statistic within 1e-5 after steps 1
and 3) and be data-parallel: the least loaded device holds at least 0.9 x the
plain graph's heavy ops. A batch norm with micro-batches and the defaults stops
at graph construction with the error naming the choice, `sync_batch_norm=False`
(`task.REFUSED`), under every behaviour. Across workers (a chief and a worker
of 2 towers each, the three models in one model_fn):
test_collective.py::test_tf1_behaviour_across_two_workers_of_two_towers_trains_as_plain.
Under `disable_v2_behavior()` the hooks' and summaries' values are one device's
too (tests/test_hook_values.py's model on 2 x 2: case 'hooks_2x2').

Before: TF1 shapes (`Dimension`s) failed in `reporting/throughput.py` (`int()`
of an unknown batch size); ref variables (`disable_resource_variables()`)
trained on one device (their gradient requests are with respect to the
variables' ref tensors, which were not seen as variables), and, once seen, were
not exact without Optimizer's per-op gates (a ref variable's read shares its
buffer with the in-place update); control flow v1's `Switch` and `Merge` were
ops the row reader did not know (the cond's model on one device, inexact).
"""

import functools
import json
import re
import os
import subprocess
import sys

import pytest

import tf1_behaviour_task as task

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tf1_behaviour_task.py')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600
# Under disable_v2_behavior() every case; under each of its parts alone, each model on
# 2 towers x 2 micro-batches (batch norm: on 2 towers, and refused with micro-batches).
PARTS_CASES = ('dense_2x2', 'einsum_attention_2x2', 'batch_norm_2', 'v1_batch_norm_2',
               'v1_batch_norm_1x2', 'cond_2x2')
RUNS = [('v1', c) for c in (*task.CASES, *task.REFUSED, 'hooks_2x2')] + [
    (b, c) for b in task.BEHAVIOURS if b != 'v1' for c in PARTS_CASES]


@functools.lru_cache(maxsize=None)
def _results(behaviour: str) -> dict:
  """Every case of `behaviour`, run in one process: {case: {'error', 'share'}}."""
  cases = [c for b, c in RUNS if b == behaviour]
  env = dict(os.environ, CUDA_VISIBLE_DEVICES='',
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  done = subprocess.run([sys.executable, SCRIPT, behaviour] + cases, env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=TIMEOUT, check=False)
  found = {}
  for line in done.stdout.splitlines():
    if line.startswith('{'):
      result = json.loads(line)
      found[result['case']] = result
  assert found.keys() == set(cases), (done.returncode, done.stderr[-3000:])
  return found


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize('behaviour,case', RUNS, ids=[f'{b}-{c}' for b, c in RUNS])
def test_tf1_behaviour_trains_like_plain_on_every_device(behaviour, case):
  result = _results(behaviour)[case]
  assert result['error'] is None, result['error']
  if case in task.REFUSED:  # stopped at graph construction, naming sync_batch_norm=False
    assert result['share'] is None, result
  else:
    assert result['share'] is not None and result['share'] >= 0.9, result


# --- CI: the core equivalence tests under TF1 behaviour ------------------------------

def test_ci_runs_the_core_equivalence_tests_a_second_time_under_tf1_behaviour():
  """.ci/run runs the tests marked core_equivalence (test_equivalence.py, the micro-batches'
  and keyed draws' core checks) again with ESTIMATOR_TOWERS_TEST_BEHAVIOUR=v1, under which
  tests/conftest.py switches `disable_v2_behavior()` on before any graph: checked here in a
  process of its own (TF1 shapes, ref variables, control flow v1, graph mode)."""
  with open(os.path.join(ROOT, '.ci', 'run')) as f:
    ci = f.read()
  assert re.search(r'^ESTIMATOR_TOWERS_TEST_BEHAVIOUR=v1 python -m pytest tests .*'
                   r'-m core_equivalence$', ci, re.M), 'the second run is gone from .ci/run'
  probe = ('import conftest, tensorflow as tf; print(conftest.BEHAVIOUR, '
           'type(tf.TensorShape([None])[0]).__name__, tf.compat.v1.resource_variables_enabled(), '
           'tf.compat.v1.control_flow_v2_enabled(), tf.executing_eagerly())')
  env = dict(os.environ, ESTIMATOR_TOWERS_TEST_BEHAVIOUR='v1', CUDA_VISIBLE_DEVICES='',
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  done = subprocess.run([sys.executable, '-c', probe], env=env, capture_output=True, text=True,
                        cwd=os.path.join(ROOT, 'tests'), timeout=TIMEOUT, check=False)
  assert done.stdout.split() == ['v1', 'Dimension', 'False', 'False', 'False'], (
      done.stdout, done.stderr[-2000:])
