"""docs/clusters.md's program runs as written on loopback, on the commands the page gives.

The page's `train.py` (its first python block) and its shell block: a chief and
a worker on two machines (`host0:2222`, `host1:2222`, replaced by free
127.0.0.1 ports) train 20 steps with `save_checkpoints_steps`, then the same
program restarted on one task (no TF_CONFIG) resumes at step 20 and trains
to 30. `train_and_evaluate` returns None on the cluster's tasks, and the
evaluation's metrics on one machine, which the program prints. The global
batch stays the global batch on any number of tasks: the variables at step
30 equal those of the same program run on one machine from the cluster's
checkpoint of step 10 (steps 11..30 on one task instead of 11..20 on two).
Each task is a subprocess, bounded in time and killed by its own pid; the
reference runs in the test's process.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import tensorflow as tf

from test_collective import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, 'docs', 'clusters.md')


def _blocks(language):
  with open(PAGE, encoding='utf-8') as f:
    return re.findall(rf'```{language}\n(.*?)```', f.read(), re.S)


def _commands(hosts):
  """The shell block's commands: (TF_CONFIG or None, argv), hosts replaced."""
  commands = []
  for line in _blocks('shell')[0].splitlines():
    if not line.strip() or line.lstrip().startswith('#'):
      continue
    for host, address in hosts.items():
      line = line.replace(host, address)
    words = shlex.split(line)
    tf_config = words.pop(0).split('=', 1)[1] if words[0].startswith('TF_CONFIG=') else None
    assert words[:2] == ['python', 'train.py'], line
    commands.append((tf_config, words[2:]))
  return commands


def _start(tmp_path, tf_config, args, name):
  env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES='')
  env.pop('TF_CONFIG', None)
  if tf_config is not None:
    env['TF_CONFIG'] = tf_config
  log = open(tmp_path / f'{name}.log', 'wb')
  return subprocess.Popen([sys.executable, 'train.py'] + args, cwd=tmp_path, env=env,
                          stdout=log, stderr=subprocess.STDOUT)


def _finish(procs, tmp_path, timeout=150, logs=None):
  try:
    for name, proc in procs.items():
      try:
        code = proc.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        code = 'timeout'
      log = ((logs or {}).get(name, tmp_path) / f'{name}.log').read_text(errors='replace')
      assert code == 0, f'{name} exited with {code}:\n{log[-3000:]}'
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def _run_here(folder, source, args, monkeypatch):
  """Runs `source` with `args` in this process, in `folder` (the one-machine reference:
  the same program's variables, without a process's start)."""
  with monkeypatch.context() as patch:
    patch.chdir(folder)
    patch.setattr(sys, 'argv', ['train.py'] + args)
    code = compile(source, str(folder / 'train.py'), 'exec')
    exec(code, {'__name__': '__main__'})  # pylint: disable=exec-used


def test_clusters_page_program_runs_on_two_tasks_and_resumes_on_one(tmp_path, monkeypatch):
  (tmp_path / 'train.py').write_text(_blocks('python')[0])
  hosts = {'host0:2222': f'127.0.0.1:{_free_port()}', 'host1:2222': f'127.0.0.1:{_free_port()}'}
  cluster, restart = _commands(hosts)[:2], _commands(hosts)[2:]
  assert [json.loads(c)['task']['type'] for c, _ in cluster] == ['chief', 'worker']
  assert len(restart) == 1 and restart[0][0] is None
  _finish({json.loads(c)['task']['type']: _start(tmp_path, c, args, json.loads(c)['task']['type'])
           for c, args in cluster}, tmp_path)
  for task_type in ('chief', 'worker'):  # train_and_evaluate returned None on both
    assert 'metrics:' not in (tmp_path / f'{task_type}.log').read_text(errors='replace')
  model_dir = tmp_path / 'model'
  checkpoints = tf.train.get_checkpoint_state(str(model_dir)).all_model_checkpoint_paths
  assert [int(p.rsplit('-', 1)[1]) for p in checkpoints][-2:] == [10, 20], checkpoints
  tenth = (model_dir / 'model.ckpt-10.index').stat().st_mtime_ns
  # The reference: the same program on one machine from the cluster's checkpoint of step 10.
  reference = tmp_path / 'one_machine'
  (reference / 'model').mkdir(parents=True)
  (reference / 'train.py').write_text(_blocks('python')[0])
  for f in model_dir.glob('model.ckpt-10.*'):
    shutil.copy(f, reference / 'model')
  (reference / 'model' / 'checkpoint').write_text('model_checkpoint_path: "model.ckpt-10"\n')
  restarted = {'restart': _start(tmp_path, None, restart[0][1], 'restart')}
  try:  # the reference, while the restart runs: in this process (TensorFlow imported)
    _run_here(reference, _blocks('python')[0], restart[0][1], monkeypatch)
  finally:
    _finish(restarted, tmp_path)
  assert tf.train.latest_checkpoint(str(model_dir)).endswith('-30')
  # on one machine it trains, evaluates and returns the evaluation: the page prints it
  printed = [l for l in (tmp_path / 'restart.log').read_text(errors='replace').splitlines()
             if l.startswith('metrics: ')]
  assert len(printed) == 1 and "'global_step': 30" in printed[0], printed
  # resumed from step 20: step 10 was not trained (nor saved) again
  assert (model_dir / 'model.ckpt-10.index').stat().st_mtime_ns == tenth
  # Steps 11..20 on two tasks and 21..30 on one train as steps 11..30 on one: the same
  # global batches of GLOBAL_BATCH examples, whatever the number of tasks.
  trained, alone = (tf.train.load_checkpoint(str(d / 'model.ckpt-30'))
                    for d in (model_dir, reference / 'model'))
  names = [n for n, _ in tf.train.list_variables(str(model_dir / 'model.ckpt-30'))
           if n.startswith('dense/')]
  assert len(names) == 2, names
  for name in names:
    np.testing.assert_allclose(trained.get_tensor(name), alone.get_tensor(name),
                               rtol=1e-5, atol=1e-6, err_msg=name)
