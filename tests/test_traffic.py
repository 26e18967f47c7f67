"""Bytes that cross devices in a training step, against the scheme's lower bound.

The measurement is TensorFlow's own (the `_Send`/`_Recv` pairs of the step's
partition graphs); the bound is computed from the plain model_fn's checkpoint
and the input's size, independently of the towers.
"""

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn
from estimator_towers.reporting import traffic


def _plain_parameter_bytes() -> int:
  """Bytes of the plain model_fn's trained variables (its checkpoint, no step)."""
  x, y = testlib.data(4)
  plain = testlib.make_estimator(testlib.v1_model_fn)
  plain.train(testlib.input_fn(x, y, 4), steps=1)
  values = [plain.get_variable_value(n) for n in plain.get_variable_names()
            if n != 'global_step']
  return sum(np.asarray(v).nbytes for v in values)


@pytest.mark.parametrize('batch', [8, 7])
def test_cpu_strategy_on_two_towers_sends_each_variable_and_gradient_once(batch):
  """Lower bound: tower 1 (on /cpu:1) pulls every variable from /cpu:0 and pushes
  every gradient back once, and receives its shard of the input. Beyond it,
  exactly two scalars: tower 1's loss weight (the batch size is known only at
  run time) and its loss (for the reported loss)."""
  x, y = testlib.data(batch)
  towered = testlib.make_estimator(
      replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(2),
                         variable_strategy='cpu'), num_cpus=2)
  hook = traffic.TransferHook(step=2)
  towered.train(testlib.input_fn(x, y, batch, epochs=2), steps=2, hooks=[hook])

  rows_of_tower_1 = batch // 2
  input_bytes = rows_of_tower_1 * (x.itemsize * x.shape[1] + y.itemsize)
  parameters = _plain_parameter_bytes()
  scalars = [t for t in hook.transfers if t.shape == ()]
  assert sorted((t.destination[-5:], t.bytes) for t in scalars) == [
      ('CPU:0', 4), ('CPU:1', 4)], scalars
  links = traffic.by_link(hook.transfers)
  cpu0, cpu1 = ('/job:localhost/replica:0/task:0/device:CPU:0',
                '/job:localhost/replica:0/task:0/device:CPU:1')
  sent = sorted((t.source[-5:], t.tensor, t.bytes) for t in hook.transfers)
  assert links == {(cpu0, cpu1): parameters + input_bytes + 4,   # pull, shard, weight
                   (cpu1, cpu0): parameters + 4}, sent            # push, loss
  assert traffic.total_bytes(hook.transfers) == 2 * parameters + input_bytes + 8


def _controlled_model_fn(features, labels, mode, params):
  """testlib's v1 model, its gradients asked for inside a control_dependencies block."""
  hidden = tf.compat.v1.layers.dense(features, 4, activation=tf.nn.tanh)
  logits = tf.compat.v1.layers.dense(hidden, testlib.NUM_CLASSES)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  counter = tf.compat.v1.get_variable('counter', [], initializer=tf.zeros_initializer(),
                                      trainable=False)
  with tf.control_dependencies([counter.assign_add(1.0)]):
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
        loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('strategy', ['cpu', 'gpu', 'replicated'])
def test_every_strategy_on_two_towers_moves_only_its_bound_and_scalars(strategy):
  """On two towers each strategy's bound is the same: every variable is on one
  device, so one tower pulls it and pushes its gradient (replicated: the
  gradient goes to tower 0, the new value comes back). Everything else that
  crosses is a scalar (loss weight, loss, the learning rate for an update on
  /cpu:1, control edges of 0 bytes). The gradients are asked for under a
  control dependency, which must not send them via tower 0's device."""
  x, y = testlib.data(8)
  towered = testlib.make_estimator(
      replicate_model_fn(_controlled_model_fn, devices=testlib.cpu_devices(2),
                         variable_strategy=strategy), num_cpus=2)
  hook = traffic.TransferHook(step=2)
  towered.train(testlib.input_fn(x, y, 8, epochs=2), steps=2, hooks=[hook])
  parameters = 4 * (testlib.NUM_FEATURES * 4 + 4 + 4 * testlib.NUM_CLASSES
                    + testlib.NUM_CLASSES)  # float32 kernels and biases
  input_bytes = 4 * (x.itemsize * x.shape[1] + y.itemsize)
  tensors = [t for t in hook.transfers if t.shape != ()]
  assert traffic.total_bytes(tensors) == 2 * parameters + input_bytes, sorted(
      (t.source[-5:], t.tensor, t.bytes) for t in hook.transfers)
  assert all(t.bytes <= 4 for t in hook.transfers if t.shape == ())


def _tied_model_fn(features, labels, mode):
  """An autoencoder whose decoder is its encoder's kernel transposed: each tower reads the
  kernel twice. Features only (labels None)."""
  del labels
  layer = tf.compat.v1.layers.Dense(
      4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.constant_initializer(
          np.linspace(-0.5, 0.5, testlib.NUM_FEATURES * 4).reshape(testlib.NUM_FEATURES, 4)))
  hidden = layer(features)
  loss = tf.compat.v1.losses.mean_squared_error(
      features, tf.matmul(hidden, layer.kernel, transpose_b=True))
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _features_only(x, batch):
  return lambda: tf.data.Dataset.from_tensor_slices(x).repeat(2).batch(batch)


@pytest.mark.parametrize('model, layout', [
    ('v1', {'micro_batches': 2}), ('v1', {'shards': 4}), ('tied', {}),
    ('tied', {'micro_batches': 2})])
def test_a_device_receives_each_variable_once_per_step(model, layout):
  """Each use of a resource variable is a read of its own, run where the variable
  lives: a device that runs two shards (micro-batches, or a grid of 4 shards on
  2 devices), or a tower that uses one kernel twice (tied weights), must still
  receive each variable once. Checked on TensorFlow's own partition graphs: what
  /cpu:0 sends /cpu:1 beyond the shard's input rows and scalars is the plain
  model's parameters, once; and the training equals plain's."""
  x, y = testlib.data(8)
  model_fn = {'v1': testlib.v1_model_fn, 'tied': _tied_model_fn}[model]
  input_fn = (testlib.input_fn(x, y, 8, epochs=2) if model == 'v1'
              else _features_only(x, 8))
  towered = testlib.make_estimator(
      replicate_model_fn(model_fn, devices=testlib.cpu_devices(2), variable_strategy='cpu',
                         **layout), num_cpus=2)
  hook = traffic.TransferHook(step=2)
  towered.train(input_fn, steps=2, hooks=[hook])
  plain = testlib.make_estimator(model_fn)
  plain.train(input_fn, steps=2)
  expected = testlib.variables(plain)
  testlib.assert_variables_close(testlib.variables(towered), expected)
  parameters = sum(np.asarray(v).nbytes for n, v in expected.items() if n != 'global_step')
  pulled = [t for t in hook.transfers if t.destination.endswith('CPU:1') and t.shape != ()
            and not t.tensor.startswith('shard_inputs/')]
  assert traffic.total_bytes(pulled) == parameters, sorted(
      (t.tensor, t.shape, t.bytes) for t in pulled)


def test_transfers_need_partition_graphs():
  with pytest.raises(ValueError, match='output_partition_graphs=True'):
    traffic.transfers(tf.compat.v1.RunMetadata())


def test_total_bytes_refuses_unknown_sizes():
  unknown = traffic.Transfer('a:0', '/cpu:0', '/cpu:1', 'float32', None, None)
  with pytest.raises(ValueError, match='was not recorded'):
    traffic.total_bytes([unknown])
