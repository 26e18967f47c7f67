"""Towers inside TensorFlow's own distributed runtime (parameter servers).

With TF_CONFIG, Estimator builds the graph under
`tf.compat.v1.train.replica_device_setter`; the towered graph must keep that
placement for variables and put the towers on the worker's own devices.
Checked on the graph's device strings, without running. Only the chief's
checkpoints hold the input's position: a non-chief worker's graph warns that
its input restarts.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn


def test_parameter_server_placement_is_kept_and_gradients_summed_on_the_worker():
  towered = replicate_model_fn(testlib.v1_model_fn, devices=['/gpu:0', '/gpu:1'])
  x, y = testlib.data(7)
  setter = tf.compat.v1.train.replica_device_setter(
      ps_tasks=2, worker_device='/job:worker/task:1')
  with tf.Graph().as_default() as graph:
    with tf.compat.v1.device(setter):
      tf.compat.v1.train.create_global_step()
      towered(tf.constant(x), tf.constant(y), tf.estimator.ModeKeys.TRAIN, None, None)
  ops = graph.get_operations()
  variables = {op.name: op.device for op in ops if op.type == 'VarHandleOp'}
  assert variables and all(d.startswith('/job:ps/task:') for d in variables.values()), variables
  forward = [op for op in ops if op.type == 'MatMul' and 'gradients' not in op.name]
  for op in forward:
    tower = 1 if op.name.startswith('tower_1/') else 0
    assert op.device == f'/job:worker/task:1/device:GPU:{tower}', (op.name, op.device)
  updates = [op for op in ops if op.type == 'ResourceApplyGradientDescent']
  assert len(updates) == 4
  for op in updates:
    variable = op.inputs[0].op
    assert op.device == variable.device
    # The towers' gradients are summed on the worker; only the sum goes to the ps.
    combined = op.inputs[2].op
    assert combined.type == 'AddN', combined.type
    assert combined.device == '/job:worker/task:1/device:CPU:0', combined.device
    assert {t.op.device for t in combined.inputs} <= {
        '/job:worker/task:1/device:CPU:0', '/job:worker/task:1/device:GPU:0',
        '/job:worker/task:1/device:GPU:1'}


@pytest.mark.parametrize('task_type', ['worker', 'chief'])
def test_a_worker_with_parameter_servers_warns_that_its_input_restarts(monkeypatch, task_type):
  """With parameter servers only the chief's checkpoints hold the input's position: a
  non-chief worker's TRAIN graph says so, once; the chief's says nothing of it."""
  cluster = {'chief': ['localhost:1'], 'worker': ['localhost:2'], 'ps': ['localhost:3']}
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': cluster, 'task': {'type': task_type, 'index': 0}}))
  warnings = testlib.logged_warnings(monkeypatch)
  config = tf.estimator.RunConfig(session_config=testlib.session_config(2))
  towered = replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0', '/cpu:1'])
  x, y = testlib.data(8)
  setter = tf.compat.v1.train.replica_device_setter(
      ps_tasks=1, worker_device=f'/job:{task_type}/task:0')
  with tf.Graph().as_default() as graph, graph.device(setter):
    tf.compat.v1.train.create_global_step()
    with tf.device('/cpu:0'):  # as Estimator reads an input_fn's dataset
      iterator = tf.compat.v1.data.make_initializable_iterator(
          tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
      features, labels = iterator.get_next()
    towered(features, labels, tf.estimator.ModeKeys.TRAIN, None, config)
  restarts = [w for w in warnings if 'only the chief\'s checkpoints save the input' in w]
  if task_type == 'chief':
    assert not restarts, warnings
    return
  assert restarts == [
      'estimator_towers: this task (worker 0) trains with parameter servers, where only the '
      'chief\'s checkpoints save the input\'s position: this worker reads its own input, which '
      'a restarted job reads again from its first element. To resume every worker\'s input, '
      'train with variable_strategy=\'collective\'.'
  ], warnings


def _free_port():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_train_and_evaluate_with_a_parameter_server_task(tmp_path):
  """A ps task and a chief (2 towers on virtual CPUs) under TF_CONFIG give the
  plain single-process result after 3 steps."""
  x, y = testlib.data(21)
  data_path = str(tmp_path / 'data.npz')
  np.savez(data_path, x=x, y=y)
  cluster = {'chief': [f'localhost:{_free_port()}'], 'ps': [f'localhost:{_free_port()}']}
  script = os.path.join(os.path.dirname(__file__), 'distributed_task.py')
  model_dir = str(tmp_path / 'model')

  def start(task_type):
    env = dict(os.environ, TF_CONFIG=json.dumps(
        {'cluster': cluster, 'task': {'type': task_type, 'index': 0}}), CUDA_VISIBLE_DEVICES='')
    return subprocess.Popen([sys.executable, script, model_dir, data_path, '2'], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

  ps = start('ps')
  try:
    chief = start('chief')
    output, _ = chief.communicate(timeout=200)
    assert chief.returncode == 0, output.decode()[-3000:]
  finally:
    ps.kill()
    ps.wait()

  plain = testlib.make_estimator(testlib.v1_model_fn)
  plain.train(testlib.input_fn(x, y, 7, epochs=10), max_steps=3)
  distributed = testlib.make_estimator(testlib.v1_model_fn, model_dir=model_dir)
  assert testlib.variables(distributed)['global_step'] == 3
  testlib.assert_variables_close(testlib.variables(distributed), testlib.variables(plain))
