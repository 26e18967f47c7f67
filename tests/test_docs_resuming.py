"""docs/resuming.md's code runs as written, and resumes as the page says.

Each program runs in a fresh process (bounded in time, killed by its own pid)
in its own temporary directory, so the page's relative `model_dir='run'` is
there; the references (the same program trained in one call, or run without
a stop) run in the test's process, in directories of their own. The page's
python blocks, in order:

1. The first program, complete, run as written: its second `train()` logs the
   page's text block, word for word; its last checkpoint holds the four
   `input_position/` keys; and it ends with the variables of the same program
   trained in one call (its `max_steps=20` line removed).
2. The preemption lines, a fragment: run, as the page says, in place of the
   first program's `estimator` and `train()` lines (`save_checkpoints_steps=100`,
   `max_steps=300`). Killed once it has a checkpoint after step 0 and
   restarted, the job resumes from its last checkpoint (the log line names
   it) and ends with the variables of the same program run without a stop.
3. The `global_batches` input_fn and 4. the stateless augmentation's
   `augment` and input_fn: fragments, each run in place of the first
   program's input_fn (the test supplies the rest of the first program; for
   3, with `variable_strategy='collective'`, the section's strategy, on one
   machine). Each second `train()` resumes with the input's position, and
   the library warns of nothing (the augmentation can be positioned).
"""

import os
import re
import subprocess
import sys
import time

from absl import logging as absl_logging
import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, 'docs', 'resuming.md')
TIMEOUT = 150
RESUMED = ('INFO:absl:estimator_towers: resumed training from run/model.ckpt-{0} (global step {0}) '
           'with the input position of step {0}: the input reads on after the global batch '
           'of step {0}.')


def _blocks(language):
  with open(PAGE, encoding='utf-8') as f:
    return re.findall(rf'```{language}\n(.*?)```', f.read(), re.S)


def _start(folder, source, restart=False):
  """Runs `source` as train.py in `folder` (again, with its model_dir, if `restart`)."""
  if not restart:
    folder.mkdir()
    (folder / 'train.py').write_text(source)
  env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES='')
  env.pop('TF_CONFIG', None)
  log = open(folder / 'train.log', 'ab')
  return subprocess.Popen([sys.executable, 'train.py'], cwd=folder, env=env, stdout=log,
                          stderr=subprocess.STDOUT)


def _finish(folder, proc):
  """The program's log, once it has ended with 0 (killed if it overruns)."""
  try:
    code = proc.wait(timeout=TIMEOUT)
  except subprocess.TimeoutExpired:
    code = 'timeout'
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  log = (folder / 'train.log').read_text(errors='replace')
  assert code == 0, f'{folder.name} exited with {code}:\n{log[-3000:]}'
  return log


def _variables(folder, step=None):
  """The model's variables in run/'s last checkpoint (or the one at `step`)."""
  path = tf.train.latest_checkpoint(str(folder / 'run'))
  if step is not None:
    assert path.endswith(f'-{step}'), path
  reader = tf.train.load_checkpoint(path)
  return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)
          if not name.startswith('input_position/')}


def _assert_same(resumed, uninterrupted):
  assert sorted(resumed) == sorted(uninterrupted)
  assert 'dense/kernel' in resumed
  for name in resumed:
    np.testing.assert_array_equal(resumed[name], uninterrupted[name], err_msg=name)


def _parts(program):
  """The first program's head (up to its input_fn), its input_fn and its tail."""
  head, rest = program.split('\ndef input_fn():', 1)
  start = rest.index('\nconfig = ')
  return head, 'def input_fn():' + rest[:start], rest[start:]


def _run_here(folder, source, monkeypatch):
  """Runs `source` in this process, in `folder` (a reference: the same program's
  variables, without a process's start); absl's verbosity and its logger's own level
  put back after (a level left set would hide later tests' INFO records from caplog)."""
  folder.mkdir()
  verbosity = absl_logging.get_verbosity()
  level = absl_logging.get_absl_logger().level
  with monkeypatch.context() as patch:
    patch.chdir(folder)
    try:
      code = compile(source, str(folder / 'train.py'), 'exec')
      exec(code, {'__name__': '__main__'})  # pylint: disable=exec-used
    finally:
      absl_logging.set_verbosity(verbosity)
      absl_logging.get_absl_logger().setLevel(level)


def test_resuming_page_programs_run_and_resume_as_written(tmp_path, monkeypatch):
  blocks = _blocks('python')
  assert len(blocks) == 4, [b[:60] for b in blocks]
  program, preemption, global_batches, augmentation = blocks
  head, _, tail = _parts(program)
  last_lines = program[program.index('\nestimator = ') + 1:]
  assert 'max_steps=40' in last_lines, last_lines
  assert 'save_checkpoints_steps=100' in preemption and 'max_steps=300' in preemption
  preempted = program.replace(last_lines, preemption)
  one_call = program.replace('estimator.train(input_fn, max_steps=20)\n', '')
  assert one_call != program
  collective = tail.replace('et.make_config(num_cpu_devices=2)',
                            "et.make_config(num_cpu_devices=2, variable_strategy='collective')")
  assert collective != tail

  runs = {'program': program, 'global_batches': head + '\n' + global_batches + collective,
          'augmentation': head + '\n' + augmentation + tail}
  procs = {name: _start(tmp_path / name, source) for name, source in runs.items()}
  # The preempted job: killed once a checkpoint after step 0 is written, then restarted.
  folder = tmp_path / 'preempted'
  proc = _start(folder, preempted)
  try:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
      latest = tf.train.latest_checkpoint(str(folder / 'run'))
      if latest and not latest.endswith('-0'):
        break
      time.sleep(0.02)
  finally:
    proc.kill()
    proc.wait()
  step = int(tf.train.latest_checkpoint(str(folder / 'run')).rsplit('-', 1)[1])
  assert 100 <= step < 300, (step, (folder / 'train.log').read_text(errors='replace')[-3000:])
  restart = _start(folder, preempted, restart=True)
  # The references, while the page's programs run: in this process (TensorFlow imported).
  for name, source in (('one_call', one_call), ('uninterrupted', preempted)):
    _run_here(tmp_path / name, source, monkeypatch)
  restarted = _finish(folder, restart)
  logs = {name: _finish(tmp_path / name, proc) for name, proc in procs.items()}

  # 1. The first program: the page's log line, the position's keys, the same variables.
  (line,) = [b.strip() for b in _blocks('text')]
  assert line == RESUMED.format(20), line
  assert line in logs['program'].splitlines(), logs['program'][-3000:]
  path = tf.train.latest_checkpoint(str(tmp_path / 'program' / 'run'))
  assert path.endswith('-40'), path
  keys = {name for name, _ in tf.train.list_variables(path) if name.startswith('input_position/')}
  assert keys == {f'input_position/{k}' for k in ('iterator', 'pending', 'ended', 'fingerprint')}
  _assert_same(_variables(tmp_path / 'program', 40), _variables(tmp_path / 'one_call', 40))
  # 2. The preemption: resumed from its last checkpoint, ends as a job that never stopped.
  assert RESUMED.format(step) in restarted.splitlines(), restarted[-3000:]
  _assert_same(_variables(folder, 300), _variables(tmp_path / 'uninterrupted', 300))
  # 3. and 4.: each second call resumes with the position; the library warns of nothing.
  for name in ('global_batches', 'augmentation'):
    assert RESUMED.format(20) in logs[name].splitlines(), (name, logs[name][-3000:])
    warnings = [l for l in logs[name].splitlines() if l.startswith('WARNING:absl:estimator_towers')]
    assert not warnings, (name, warnings)
  assert 'variable_strategy=collective' in logs['global_batches']

