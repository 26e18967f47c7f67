"""Towers inside TensorFlow's own distributed runtime (parameter servers).

With TF_CONFIG, Estimator builds the graph under
`tf.compat.v1.train.replica_device_setter`; the towered graph must keep that
placement for variables and put the towers on the worker's own devices.
Checked on the graph's device strings, without running.
"""

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
