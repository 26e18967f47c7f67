"""Variable placement strategies: where variables, compute and gradient sums go.

GPU placement is checked on graphs built for '/gpu:k' devices and inspected,
not run (there is no GPU here). Numerical equivalence is checked on virtual CPU
devices against the plain single-device model_fn on the same data.
"""

import functools
import math
import re

import pytest
import tensorflow as tf

import testlib
from estimator_towers import placement
from estimator_towers import replicate_model_fn

GPUS = [f'/gpu:{k}' for k in range(4)]
SMALL_WIDTHS = (8, 16)  # dense 5->8->16->3: kernels of 40, 128, 48 floats.


def mlp_model_fn(features, labels, mode, params):
  """Dense tanh layers of params['widths'], then NUM_CLASSES logits; Momentum.

  Momentum makes slot variables, which the optimizer creates after the towers.
  """
  del mode  # TRAIN only.
  x = features
  for i, width in enumerate(params['widths']):
    x = tf.compat.v1.layers.dense(
        x, width, activation=tf.nn.tanh,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i + 1))
  logits = tf.compat.v1.layers.dense(
      x, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=100),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=101))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.5, momentum=0.9)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(tf.estimator.ModeKeys.TRAIN, loss=loss,
                                    train_op=train_op)


def build_train_graph(strategy, widths, features, devices=GPUS):
  """Builds (does not run) the towered TRAIN graph; returns the tf.Graph."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    towered = replicate_model_fn(mlp_model_fn, devices=devices,
                                 variable_strategy=strategy)
    features = features()
    labels = tf.zeros(tf.shape(features)[:1], tf.int32)
    towered(features=features, labels=labels, mode=tf.estimator.ModeKeys.TRAIN,
            params={'widths': widths}, config=None)
  return graph


def tower_of(op):
  """Tower index from the op's name scope: 'tower_k/...' or none for tower 0."""
  match = re.match(r'tower_(\d+)/', op.name)
  return int(match.group(1)) if match else 0


def variable_ops(graph):
  """VarHandleOps of the model and its optimizer slots (not global_step)."""
  return {op.name: op for op in graph.get_operations()
          if op.type == 'VarHandleOp' and op.name != 'global_step'}


def gpu(k):
  return f'/device:GPU:{k}'


FEATURES = {
    'placeholder': lambda: tf.compat.v1.placeholder(tf.float32, [None, testlib.NUM_FEATURES]),
    'constant': lambda: tf.constant(testlib.data(7)[0]),
}

# The device of each model variable, derived by hand from each rule.
# gpu: bytes 160, 32, 512, 64 go to the four empty devices in turn; then
# dense_2/kernel (192) joins GPU:1 (32, the lightest) and dense_2/bias joins
# GPU:3 (64, lightest of 160, 224, 512, 64). Round-robin would differ on both.
EXPECTED_DEVICES = {
    'cpu': {name: '/device:CPU:0' for name in (
        'dense/kernel', 'dense/bias', 'dense_1/kernel', 'dense_1/bias',
        'dense_2/kernel', 'dense_2/bias')},
    'gpu': {'dense/kernel': gpu(0), 'dense/bias': gpu(1),
            'dense_1/kernel': gpu(2), 'dense_1/bias': gpu(3),
            'dense_2/kernel': gpu(1), 'dense_2/bias': gpu(3)},
}


@pytest.mark.parametrize('features', sorted(FEATURES))
@pytest.mark.parametrize('strategy', sorted(EXPECTED_DEVICES))
def test_graph_placement_on_four_gpus(strategy, features):
  graph = build_train_graph(strategy, SMALL_WIDTHS, FEATURES[features])
  ops = graph.get_operations()

  # Tower compute (forward and backward matmuls) stays on the tower's device.
  matmuls = [op for op in ops if op.type == 'MatMul']
  assert sorted({tower_of(op) for op in matmuls}) == [0, 1, 2, 3]
  for op in matmuls:
    assert op.device == gpu(tower_of(op)), op.name

  # Variables are where the rule says; Momentum slots sit with their variable.
  expected = EXPECTED_DEVICES[strategy]
  variables = variable_ops(graph)
  slots = {name: op for name, op in variables.items() if name.endswith('/Momentum')}
  assert {name: op.device for name, op in variables.items() if name not in slots} == expected
  assert sorted(slots) == sorted(f'{name}/Momentum' for name in expected)
  for name, op in slots.items():
    assert op.device == expected[name[:-len('/Momentum')]], name

  # Each variable's gradients are combined on its device: every op in the
  # combine_gradients scope that feeds its update is on the variable's device.
  combined = set()
  for update in (op for op in ops if op.type.startswith('ResourceApply')):
    variable = update.inputs[0].op.name
    scopes = {t.op.name.split('/')[0] for t in update.inputs
              if t.op.name.startswith('combine_gradients')}
    assert len(scopes) == 1, (update.name, scopes)
    scope = scopes.pop()
    members = [op for op in ops if op.name.startswith(scope + '/')]
    assert {op.device for op in members} == {expected[variable]}, (variable, scope)
    combined.add(variable)
  assert combined == set(expected)


def test_gpu_counts_bytes_of_partly_known_variables():
  # Unknown dimensions count as 1, an unknown dtype as float32 (4 bytes).
  rule = placement.GpuPlacement(['/device:GPU:0', '/device:GPU:1'])
  placed = [
      rule.variable_device(tf.TensorShape([None, 10]), tf.float16, 'a'),  # 20 -> 0
      rule.variable_device(tf.TensorShape([3]), tf.float32, 'b'),  # 12 -> 1
      rule.variable_device(None, None, 'c'),  # 4 -> 1 (12 < 20), now 16
      rule.variable_device(tf.TensorShape(None), tf.float64, 'd'),  # 8 -> 1, now 24
      rule.variable_device(tf.TensorShape([2]), None, 'e'),  # 8 -> 0 (20 < 24)
  ]
  assert placed == [gpu(0), gpu(1), gpu(1), gpu(1), gpu(0)]


# An embedding-sized 1000x100 matrix, 500x100 and 300x100 matrices, several
# 10x10 and biases of every size. Balance is possible (the largest variable is
# smaller than the mean load), while one device, or round-robin in creation
# order (kernels and biases alternate, so kernels land on two devices), is off
# by 2x or more.
UNEVEN_INPUT = 1000
UNEVEN_WIDTHS = (100, 500, 100, 500, 100, 300, 100, 300, 100, 10, 10, 10, 10)


def test_gpu_balances_uneven_variables():
  graph = build_train_graph(
      'gpu', UNEVEN_WIDTHS,
      lambda: tf.compat.v1.placeholder(tf.float32, [None, UNEVEN_INPUT]))
  loads = {gpu(k): 0 for k in range(len(GPUS))}
  largest = 0
  for name, op in variable_ops(graph).items():
    assert op.device in loads, (name, op.device)
    size = math.prod(tf.TensorShape(op.get_attr('shape')).as_list()) * op.get_attr('dtype').size
    loads[op.device] += size
    largest = max(largest, size)
  mean = sum(loads.values()) / len(loads)
  assert largest <= mean  # The model leaves room for balance.
  assert max(loads.values()) <= 1.5 * mean, loads


@functools.lru_cache(maxsize=None)
def plain_steps(batch, steps):
  x, y = testlib.data(batch * steps)
  est = testlib.make_estimator(mlp_model_fn, params={'widths': SMALL_WIDTHS})
  est.train(testlib.input_fn(x, y, batch), steps=steps)
  return testlib.variables(est)


@pytest.mark.parametrize('num_devices', [2, 3])
@pytest.mark.parametrize('strategy', sorted(placement.STRATEGIES))
def test_training_matches_plain(strategy, num_devices):
  # Two Momentum steps on batches of 7 (divisible by neither 2 nor 3): the
  # second step also reads the slots written by the first.
  batch, steps = 7, 2
  x, y = testlib.data(batch * steps)
  towered = replicate_model_fn(mlp_model_fn, devices=testlib.cpu_devices(num_devices),
                               variable_strategy=strategy)
  est = testlib.make_estimator(towered, num_cpus=num_devices,
                               params={'widths': SMALL_WIDTHS})
  est.train(testlib.input_fn(x, y, batch), steps=steps)
  testlib.assert_variables_close(testlib.variables(est), plain_steps(batch, steps))


@pytest.mark.parametrize('strategy', sorted(placement.STRATEGIES))
def test_describe_is_one_line_naming_the_devices(strategy):
  rule = placement.make_placement(strategy, ['/device:GPU:0', '/device:GPU:1'])
  line = rule.describe()
  assert line and '\n' not in line
  assert any(device in line for device in ('/device:CPU:0', '/device:GPU:0'))

