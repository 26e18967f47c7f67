"""Recurrent models under TF1 behaviour: control flow v1 frames and TensorArrays on towers.

`disable_v2_behavior()` is process-global, so the cases run in a process of their own
(tests/loop_frames_task.py, bounded in time): tests/loop_models.py's models, each on 2
towers, and a few on 3 towers, 2x2 and 1x2 micro-batches. Their loops are v1 frames
(`Enter`, `Merge`, `Switch`, `NextIteration`, `Exit`; TensorArrays), read by
`rows/frames.py`. Each must train as the plain model_fn on one device (every variable and
slot within 1e-5 after steps 1 and 2, no warning) with every device holding at least 0.9 of
the plain graph's heavy ops. Before frames were read, each ran from its first time-major
transpose (or its first frame op) on one device, with the warning; once read, a tower's
loop whose body reads a variable failed to place (its gradient's accumulators were
colocated both with the tower's ops and with a read the variable placed).
"""

import functools
import json
import os
import subprocess
import sys

import pytest

import loop_models

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'loop_frames_task.py')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 900
CASES = [f'{name}-2_towers' for name in loop_models.MODELS] + [
    'dynamic_rnn-3_towers', 'bidirectional-2x2', 'keras_lstm-2x2', 'seq2seq-1x2',
    'map_fn-3_towers']


@functools.lru_cache(maxsize=None)
def _results() -> dict:
  env = dict(os.environ, CUDA_VISIBLE_DEVICES='',
             PYTHONPATH=os.pathsep.join([ROOT, os.environ.get('PYTHONPATH', '')]))
  done = subprocess.run([sys.executable, SCRIPT] + CASES, env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=TIMEOUT, check=False)
  found = {}
  for line in done.stdout.splitlines():
    if line.startswith('{'):
      result = json.loads(line)
      found[result['case']] = result
  assert found.keys() == set(CASES), (done.returncode, done.stderr[-3000:])
  return found


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize('case', CASES)
def test_v1_loops_train_like_plain_on_every_device(case):
  result = _results()[case]
  assert result['error'] is None, result['error']
  assert result['share'] is not None and result['share'] >= 0.9, result
