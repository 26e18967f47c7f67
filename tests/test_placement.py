"""Variable placement strategies: where variables, compute and gradient sums go.

GPU placement is checked on graphs built for '/gpu:k' devices and inspected,
not run (there is no GPU here). Numerical equivalence is checked on virtual CPU
devices against the plain single-device model_fn on the same data.
"""

import functools
import math
import re

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn
from estimator_towers.placement import strategies as placement

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
  """Tower index from the op's name: 'tower_k/...' (its backward pass:
  '.../gradients/tower_k/...'), or none for tower 0."""
  match = re.search(r'(?:^|/)tower_(\d+)/', op.name)
  return int(match.group(1)) if match else 0


def variable_ops(graph):
  """VarHandleOps of the model's global variables and optimizer slots.

  Not global_step, and not the towers' replicas, which are local variables.
  """
  return {v.op.name: v.op for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
          if v.op.name != 'global_step'}


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
# replicated: the originals on the first tower's device (copies are checked in
# test_replicated_towers_read_their_own_copies).
MODEL_VARIABLES = ('dense/kernel', 'dense/bias', 'dense_1/kernel', 'dense_1/bias',
                   'dense_2/kernel', 'dense_2/bias')
EXPECTED_DEVICES = {
    'cpu': {name: '/device:CPU:0' for name in MODEL_VARIABLES},
    'gpu': {'dense/kernel': gpu(0), 'dense/bias': gpu(1),
            'dense_1/kernel': gpu(2), 'dense_1/bias': gpu(3),
            'dense_2/kernel': gpu(1), 'dense_2/bias': gpu(3)},
    'replicated': {name: gpu(0) for name in MODEL_VARIABLES},
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

  # Each variable's gradients are combined on its device: the gradient its
  # update applies is one sum, on the variable's device, of one part from each
  # tower (each computed on that tower's device).
  combined = set()
  for update in (op for op in ops if op.type.startswith('ResourceApply')):
    variable = update.inputs[0].op.name
    sums = [t.op for t in update.inputs if t.op.type == 'AddN']
    assert len(sums) == 1, (update.name, [t.op.type for t in update.inputs])
    parts = sums[0].inputs
    assert sums[0].device == expected[variable], (variable, sums[0].device)
    assert sorted(tower_of(t.op) for t in parts) == [0, 1, 2, 3], variable
    for t in parts:
      assert t.op.device == gpu(tower_of(t.op)), t.op.name
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



# --- replicated ---------------------------------------------------------------

def ancestors(tensors):
  """Every op that `tensors` depend on through data edges."""
  seen, pending = set(), [t.op for t in tensors]
  while pending:
    op = pending.pop()
    if op not in seen:
      seen.add(op)
      pending.extend(t.op for t in op.inputs)
  return seen


def replica_name(name, k):
  return f'{name}/replica_{k}'


@pytest.mark.parametrize('features', sorted(FEATURES))
def test_replicated_towers_read_their_own_copies(features):
  graph = build_train_graph('replicated', SMALL_WIDTHS, FEATURES[features])
  ops = graph.get_operations()
  keys = tf.compat.v1.GraphKeys
  originals = {v.op.name: v for v in graph.get_collection(keys.GLOBAL_VARIABLES)
               if v.op.name in MODEL_VARIABLES}
  assert sorted(originals) == sorted(MODEL_VARIABLES)

  # Towers 1..3 each have a copy of every model variable on their own device:
  # local variables (initialized from the original, never saved), not global
  # and not trainable once the towers are built. Tower 0 uses the originals.
  copies = {v.op.name: v for v in graph.get_collection(keys.LOCAL_VARIABLES)}
  assert sorted(copies) == sorted(replica_name(name, k) for name in MODEL_VARIABLES
                                  for k in range(1, len(GPUS)))
  for name, copy in copies.items():
    assert copy.device == gpu(int(name.rsplit('_', 1)[1])), name
  global_ids = {id(v) for v in graph.get_collection(keys.GLOBAL_VARIABLES)}
  assert not any(id(v) in global_ids for v in copies.values())
  assert ([v.op.name for v in graph.get_collection(keys.TRAINABLE_VARIABLES)]
          == list(MODEL_VARIABLES))

  # Each tower's compute (forward and backward MatMul, BiasAdd and their
  # gradients) reads only variables on its own device: the originals for tower
  # 0, its copies for tower k; no op in tower k's scope touches another variable.
  read = {k: set() for k in range(len(GPUS))}
  for op in ops:
    handles = [t.op for t in op.inputs if t.dtype == tf.resource]
    if op.type == 'ReadVariableOp' and any(c.type in ('MatMul', 'BiasAdd', 'BiasAddGrad')
                                           for c in op.outputs[0].consumers()):
      read[tower_of(op)].update(h.name for h in handles)
    elif op.name.startswith('tower_'):
      assert not handles or op.type == 'ReadVariableOp', op.name
    if op.name.startswith('tower_'):
      for h in handles:
        assert h.name == replica_name(h.name.split('/replica_')[0], tower_of(op)), op.name
  assert read[0] == set(MODEL_VARIABLES)
  for k in range(1, len(GPUS)):
    assert read[k] == {replica_name(name, k) for name in MODEL_VARIABLES}, k
  for k, names in read.items():
    for name in names:
      assert graph.get_operation_by_name(name).device == gpu(k), name

  # Each original's update (on GPU:0, with its gradients combined there, see
  # test_graph_placement_on_four_gpus) takes every tower's gradient: the one of
  # tower k with respect to its copy.
  updates = {op.inputs[0].op.name: op for op in ops if op.type == 'ResourceApplyMomentum'}
  assert sorted(updates) == sorted(MODEL_VARIABLES)
  for name, update in updates.items():
    assert update.device == gpu(0)
    towers = {tower_of(op) for op in ancestors(update.inputs)
              if re.search(r'(^|/)gradients(_\d+)?/', op.name)}  # one pass or one per tower
    assert towers == set(range(len(GPUS))), (name, towers)

  # After the update, each copy is overwritten with its original's value,
  # read on GPU:0 and written on the copy's device.
  refreshed = set()
  for op in ops:
    if op.type == 'AssignVariableOp' and op.name.startswith('refresh_replicas/'):
      copy = op.inputs[0].op
      assert op.device == copy.device
      sources = {a.inputs[0].op for a in ancestors(op.inputs[1:]) if a.type == 'ReadVariableOp'}
      assert [(s.name, s.device) for s in sources] == [(copy.name.split('/replica_')[0], gpu(0))]
      refreshed.add(copy.name)
  assert refreshed == set(copies)


def keras_dense_model_fn(features, labels, mode, params):
  """A Keras Dense layer plus a raw tf.Variable scale; Keras legacy SGD."""
  del params  # Unused.
  scale = tf.Variable(1.0, name='scale')
  logits = scale * tf.keras.layers.Dense(testlib.NUM_CLASSES)(features)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions=logits)
  loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True))
  optimizer = tf.keras.optimizers.legacy.SGD(0.1)
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  train_op = optimizer.get_updates(loss, tf.compat.v1.trainable_variables())
  return tf.estimator.EstimatorSpec(tf.estimator.ModeKeys.TRAIN, loss=loss,
                                    train_op=tf.group(train_op))


@pytest.mark.parametrize('model_fn', [testlib.keras_model_fn, keras_dense_model_fn])
def test_replicated_copies_of_keras_and_raw_variables(model_fn):
  # Keras layers (batch-norm moving statistics included) and tf.Variable create
  # through other paths than get_variable; their copies are local too, and the
  # Keras optimizer in tower 1 computes gradients for the copies.
  x, y = testlib.data(7)
  with tf.Graph().as_default():  # The model's variables (not the optimizer's).
    model_fn(tf.constant(x), None, tf.estimator.ModeKeys.PREDICT, None)
    model_variables = [v.op.name for v in tf.compat.v1.global_variables()]
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    towered = replicate_model_fn(model_fn, devices=GPUS[:2], variable_strategy='replicated')
    towered(tf.constant(x), tf.constant(y), tf.estimator.ModeKeys.TRAIN, None, None)
    keys = tf.compat.v1.GraphKeys
    originals = [v for v in graph.get_collection(keys.GLOBAL_VARIABLES)
                 if v.op.name in model_variables]
    copies = graph.get_collection(keys.LOCAL_VARIABLES)
    trainable = graph.get_collection(keys.TRAINABLE_VARIABLES)
  assert sorted(v.op.name for v in originals) == sorted(model_variables)
  assert all(v.device == gpu(0) for v in originals)
  assert [v.op.name for v in copies] == [replica_name(v.op.name, 1) for v in originals]
  assert all(v.device == gpu(1) for v in copies)
  assert not {id(v) for v in copies} & {id(v) for v in trainable}
  assert all(v.trainable == o.trainable for v, o in zip(copies, originals))
  updates = [op for op in graph.get_operations() if op.type.startswith('ResourceApply')]
  assert sorted(op.inputs[0].op.name for op in updates) == sorted(v.op.name for v in trainable)
  for update in updates:  # Each takes both towers' gradients.
    towers = {tower_of(op) for op in ancestors(update.inputs) if 'gradients/' in op.name}
    assert towers == {0, 1}, update.name


class CopiesHook(tf.compat.v1.train.SessionRunHook):
  """After every step, fetches every replica and the original it copies."""

  def __init__(self):
    self.steps = []  # per step: {copy name: (copy value, original value)}

  def begin(self):
    graph = tf.compat.v1.get_default_graph()
    originals = {v.op.name: v for v in tf.compat.v1.global_variables()}
    self.fetches = {v.op.name: (v, originals[v.op.name.split('/replica_')[0]])
                    for v in graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
                    if '/replica_' in v.op.name}

  def after_run(self, run_context, run_values):
    self.steps.append(run_context.session.run(self.fetches))


def test_replicated_copies_equal_originals_after_every_step():
  batch, steps, num_devices = 7, 3, 3
  x, y = testlib.data(batch * steps)
  towered = replicate_model_fn(mlp_model_fn, devices=testlib.cpu_devices(num_devices),
                               variable_strategy='replicated')
  est = testlib.make_estimator(towered, num_cpus=num_devices,
                               params={'widths': SMALL_WIDTHS})
  hook = CopiesHook()
  est.train(testlib.input_fn(x, y, batch), steps=steps, hooks=[hook])
  assert len(hook.steps) == steps
  assert sorted(hook.steps[0]) == sorted(replica_name(name, k) for name in MODEL_VARIABLES
                                         for k in range(1, num_devices))
  for values in hook.steps:
    for name, (copy, original) in values.items():
      np.testing.assert_array_equal(copy, original, err_msg=name)
  for name in hook.steps[0]:  # The originals did move: the test can fail.
    assert not np.array_equal(hook.steps[0][name][1], hook.steps[-1][name][1]), name


def plain_checkpoint_names(model_fn):
  """Names of the variables the plain model_fn saves after training."""
  x, y = testlib.data(7)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    model_fn(tf.constant(x), tf.constant(y), tf.estimator.ModeKeys.TRAIN, None)
    return sorted(v.op.name for v in tf.compat.v1.global_variables())


@pytest.mark.parametrize('model_name', sorted(testlib.MODELS))
def test_replicated_checkpoint_restores_into_plain_model_fn(model_name):
  # Train on 3 towers with batches of 7; the checkpoint holds exactly the plain
  # names (besides the input's position), and evaluate/predict on 3 towers
  # (tower k reading its copies, batch-norm moving statistics included) equal
  # the plain model_fn's on it.
  model_fn = testlib.MODELS[model_name]
  batch, steps, num_devices = 7, 2, 3
  x, y = testlib.data(batch * steps)
  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                               variable_strategy='replicated')
  est = testlib.make_estimator(towered, num_cpus=num_devices)
  est.train(testlib.input_fn(x, y, batch), steps=steps)
  assert sorted(testlib.variables(est)) == plain_checkpoint_names(model_fn)

  plain = testlib.make_estimator(model_fn, model_dir=est.model_dir)
  fn = testlib.input_fn(x, y, batch)
  plain_metrics, metrics = plain.evaluate(fn), est.evaluate(fn)
  assert sorted(metrics) == sorted(plain_metrics)
  for key in plain_metrics:
    testlib.assert_close(metrics[key], plain_metrics[key], err_msg=key)
  predicted = testlib.predictions(est, fn)
  assert predicted.shape == (batch * steps, testlib.NUM_CLASSES)
  testlib.assert_close(predicted, testlib.predictions(plain, fn), err_msg='predictions')
