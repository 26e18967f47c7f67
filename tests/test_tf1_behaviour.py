"""TF1 behaviour: `disable_v2_behavior()` and each of its parts, exact and data-parallel.

TF1 behaviour is process-global, so each behaviour's checks run in a process
of their own (tests/tf1_behaviour_task.py, one per behaviour, bounded in time):
the dense model (tf.compat.v1.layers), BERT-style einsum attention and Keras
batch norm (`sync_batch_norm=True`) on 2 towers, the first two and the dense
model with a tf.cond (not chosen by the batch) on 2 towers x 2 micro-batches.
Each must train as the plain model_fn on one device (every variable and slot
within 1e-5 after steps 1 and 3) and be data-parallel: the least loaded device
holds at least 0.9 x the plain graph's heavy ops. Across workers (a chief and a worker
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
import os
import subprocess
import sys

import pytest

import tf1_behaviour_task as task

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'tf1_behaviour_task.py')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600
# Under disable_v2_behavior() every case; under each of its parts alone, one per model.
PARTS_CASES = ('dense_2x2', 'einsum_attention_2', 'batch_norm_2', 'cond_2x2')
RUNS = [('v1', c) for c in (*task.CASES, 'hooks_2x2')] + [
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
  assert result['share'] is not None and result['share'] >= 0.9, result
