"""Recovery: a towered, staged training process killed with SIGKILL and restarted,
and a parameter server killed and restarted under the chief's session recovery.

Both tests run tests/recovery_task.py in subprocesses, each in its own process
group, and kill those groups by id in `finally` whatever happens; every wait has
a time limit, and the tests carry pytest-timeout markers. Ports are free
loopback ports. The input is a seeded shuffle + repeat + batch of 23 examples in
batches of 5, read from its first element: what a restart or a recovered session
resumes from is the checkpoint's input position (the library's: the iterator's
state and the global batches staged on the towers), not a skip written by hand.
References: an uninterrupted run of the same training (bit equal), and the
model_fn decorated for one device trained in one call on the same input_fn
(within 1e-5).
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import recovery_task
import testlib
from estimator_towers import replicate_model_fn

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'recovery_task.py')
START_TIMEOUT = 180  # TensorFlow's import and graph building on a busy 2-core machine.


class Task:
  """A recovery_task.py process in a process group of its own, output collected."""

  def __init__(self, *args, env=None):
    self.proc = subprocess.Popen(
        [sys.executable, SCRIPT, *map(str, args)], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    self.lines = []
    self._queue = queue.Queue()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)
      self._queue.put(line)
    self._queue.put(None)

  def output(self, tail: int = 4000) -> str:
    return ''.join(self.lines)[-tail:]

  def wait_for(self, text: str, timeout: float) -> str:
    """The first output line containing `text`; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
      try:
        line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
      except queue.Empty:
        raise AssertionError(f'{text!r} not printed within {timeout} s:\n{self.output()}')
      if line is None:
        raise AssertionError(f'Exited with {self.proc.wait()} before printing {text!r}:\n'
                             f'{self.output()}')
      if text in line:
        return line

  def wait(self, timeout: float) -> int:
    returncode = self.proc.wait(timeout=timeout)
    self._reader.join(timeout=10)
    return returncode

  def kill(self) -> None:
    """SIGKILL to the task's process group (no-op once it is gone)."""
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    self.proc.wait(timeout=30)
    self._reader.join(timeout=10)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def restored_checkpoint(output: str) -> str:
  lines = [l for l in output.splitlines() if 'Restoring parameters from' in l]
  assert lines, f'no checkpoint was restored:\n{output[-4000:]}'
  return os.path.basename(lines[-1].split('Restoring parameters from')[-1].strip())


def one_device_variables(x, y, max_steps: int) -> dict:
  """The model_fn decorated for one device, one train() call on the same input_fn."""
  one_device = testlib.make_estimator(
      replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0']))
  one_device.train(recovery_task.input_fn(x, y), max_steps=max_steps)
  return testlib.variables(one_device)


@pytest.mark.timeout(420)
@pytest.mark.parametrize('depth', [1, 2])
def test_sigkill_and_restart_equals_uninterrupted_training(tmp_path, depth):
  # 23 examples, batches of 5 (an epoch ends inside batches 5 and 10), steps
  # 1..10. Checkpoints at steps 4 and 8 (20 and 40 examples: mid-epoch, with
  # `depth` batches staged on the towers); the process is killed at step 6,
  # losing steps 5 and 6.
  x, y = testlib.data(23)
  data = tmp_path / 'data.npz'
  np.savez(data, x=x, y=y)
  model_dir = tmp_path / 'killed'
  flag = tmp_path / 'never_created'
  common = dict(max_steps=10, checkpoint_steps=4, staging_depth=depth)
  options = [f'--{k}={v}' for k, v in common.items()]

  task = Task('train', model_dir, data, '--block_at=6', f'--flag={flag}', *options)
  try:
    task.wait_for(recovery_task.BLOCKED, timeout=START_TIMEOUT)
    os.killpg(task.proc.pid, signal.SIGKILL)
    assert task.wait(timeout=30) == -signal.SIGKILL
  finally:
    task.kill()
  assert recovery_task.checkpoint_step(str(model_dir)) == 4

  restarted = Task('train', model_dir, data, *options)
  try:
    assert restarted.wait(timeout=START_TIMEOUT) == 0, restarted.output()
  finally:
    restarted.kill()
  assert restored_checkpoint(restarted.output(tail=10**6)) == 'model.ckpt-4'

  uninterrupted = recovery_task.train(str(tmp_path / 'uninterrupted'), x, y, **common)
  resumed = testlib.variables(testlib.make_estimator(testlib.v1_model_fn,
                                                     model_dir=str(model_dir)))
  assert resumed['global_step'] == 10
  testlib.assert_variables_close(resumed, testlib.variables(uninterrupted), tol=0)
  testlib.assert_variables_close(resumed, one_device_variables(x, y, 10))


@pytest.mark.timeout(420)
def test_parameter_server_killed_and_restarted(tmp_path):
  """A ps + chief cluster on loopback ports (TF_CONFIG); the chief trains 3
  staged towers with its variables on the ps. The ps is killed after step 5
  (checkpoints at 2 and 4) and restarted on its port: the chief's
  MonitoredSession recovers (a new session restores model.ckpt-4, the input's
  position with it: the iterator, and the batches staged at step 4) and
  training completes: steps 5 to 8 read the batches that follow step 4, as in
  one uninterrupted call of one device."""
  x, y = testlib.data(23)
  data = tmp_path / 'data.npz'
  np.savez(data, x=x, y=y)
  model_dir = tmp_path / 'model'
  flag = tmp_path / 'ps_restarted'
  cluster = {'chief': [f'localhost:{free_port()}'], 'ps': [f'localhost:{free_port()}']}

  def env(task_type):
    return dict(os.environ, CUDA_VISIBLE_DEVICES='', TF_CONFIG=json.dumps(
        {'cluster': cluster, 'task': {'type': task_type, 'index': 0}}))

  tasks = []
  try:
    tasks.append(Task('ps', env=env('ps')))
    chief = Task('chief', model_dir, data, '--block_at=5', f'--flag={flag}',
                 '--max_steps=8', '--checkpoint_steps=2', env=env('chief'))
    tasks.append(chief)
    chief.wait_for(recovery_task.BLOCKED, timeout=START_TIMEOUT)
    tasks[0].kill()
    tasks.append(Task('ps', env=env('ps')))
    tasks[-1].wait_for('PS STARTED', timeout=START_TIMEOUT)
    flag.touch()
    assert chief.wait(timeout=START_TIMEOUT) == 0, chief.output()
  finally:
    for task in tasks:
      task.kill()
  output = chief.output(tail=10**6)
  assert 'This may be due to a preemption' in output, output[-4000:]  # Session recovery ran.
  assert restored_checkpoint(output) == 'model.ckpt-4'
  trained = testlib.variables(testlib.make_estimator(testlib.v1_model_fn,
                                                     model_dir=str(model_dir)))
  assert trained['global_step'] == 8
  testlib.assert_variables_close(trained, one_device_variables(x, y, 8))
