"""Upstream SimCLR's pre-training model_fn on towers: stacked views, fused synchronised batch norm.

google-research/simclr's TF1 `model_fn`, kept as it is in small: the input_fn
stacks an example's two augmented views on the channel axis, the model_fn
splits them (`tf.split(features, 2, axis=-1)`) and stacks them on the batch
axis (`tf.concat(..., 0)`: [view 1 of every example; view 2 of every
example]), runs a ResNet (fixed padding, residual blocks, fused batch norms,
`base_model` scope), a 3-layer projection head with batch norms, NT-Xent with
in-batch negatives (`add_contrastive_loss`), `tf.zeros([params['batch_size'],
num_classes])` supervised logits, weight decay on every kernel (ResNet-50 has
about 160: stand-ins here make as many, so that the loss reads hundreds of ops
away from the views) and `tf.losses.get_total_loss()`, Momentum under the update ops (and the v2
summaries: none, `--train_summary_steps=0`, since its label accuracy summary
compares the shard's labels with `params['batch_size']` rows). With `sync_batch_norm=True` on 2 and 3 towers the
towered graph warns of nothing (every shard's views are found, so the head
runs on the whole batch, row-wise) and every device holds at least 0.9 x
plain's heavy ops. 2 steps equal plain's: in float64 (its batch norms unfused:
TensorFlow's fused kernel is float32-only) to 1e-10 on 2 and 3 towers (measured
3e-13; one ulp of the start moves plain by 4e-13), so the towers' math is
plain's; in float32, with upstream's fused batch norms, within 4 x plain's own
rounding floor (`rounding_floor`'s rule: plain from its start nudged by one ulp
moves 2 steps by 2e-3, as the ReLUs after batch norms pass all or nothing of
an activation's gradient within rounding of 0; 2 towers are 3e-3 off, 3
towers 8e-4). Both fail with sync_batch_norm=False (30 off plain).
(On micro-batches sync batch norm is refused:
docs/micro_batches.md.)
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import estimator_graph
import heavy_ops
import testlib
import estimator_towers as et
from estimator_towers.selftest import rounding_floor

tf1 = tf.compat.v1
B, S, BLOCKS, KERNELS = 12, 8, 3, 160


def fixed_padding(inputs, kernel_size):
  pad_total = kernel_size - 1
  pad_beg = pad_total // 2
  return tf.pad(inputs, [[0, 0], [pad_beg, pad_total - pad_beg], [pad_beg, pad_total - pad_beg], [0, 0]])

def conv(inputs, filters, kernel_size, strides, seed):
  if strides > 1:
    inputs = fixed_padding(inputs, kernel_size)
  return tf1.layers.conv2d(inputs, filters, kernel_size, strides, padding='SAME' if strides == 1 else 'VALID', use_bias=False,
                           kernel_initializer=tf1.variance_scaling_initializer(seed=seed))

def bn_relu(inputs, is_training, relu=True, center=True, init_zero=False):
  # Fused as upstream; TensorFlow's fused kernel is float32-only, so the float64 model's are not.
  inputs = tf1.layers.batch_normalization(inputs, axis=-1, momentum=0.9, epsilon=1e-5, center=center, scale=True,
      training=is_training, fused=inputs.dtype != tf.float64, gamma_initializer=tf1.zeros_initializer() if init_zero else tf1.ones_initializer())
  return tf.nn.relu(inputs) if relu else inputs

def block(x, filters, strides, is_training, seed):
  shortcut = x
  if strides > 1 or x.shape[-1] != filters:
    shortcut = conv(x, filters, 1, strides, seed)
    shortcut = bn_relu(shortcut, is_training, relu=False)
  h = conv(x, filters, 3, strides, seed + 1)
  h = bn_relu(h, is_training)
  h = conv(h, filters, 3, 1, seed + 2)
  h = bn_relu(h, is_training, relu=False, init_zero=True)
  return tf.nn.relu(h + shortcut)

def resnet(inputs, is_training):
  x = conv(inputs, 4, 3, 1, 1)
  x = tf.identity(x, 'initial_conv')
  x = bn_relu(x, is_training)
  for i, (filters, strides) in enumerate([(4, 1), (4, 1), (8, 2), (8, 1), (8, 2), (8, 1), (8, 2), (8, 1)][:BLOCKS]):
    with tf1.variable_scope(f'block_{i}'):
      x = block(x, filters, strides, is_training, 10 * i)
  x = tf.reduce_mean(x, [1, 2])
  return tf.identity(x, 'final_avg_pool')

def linear_layer(x, is_training, num, use_bias, use_bn, name, seed):
  with tf1.variable_scope(name, reuse=tf1.AUTO_REUSE):
    x = tf1.layers.dense(x, num, use_bias=use_bias and not use_bn, kernel_initializer=tf1.random_normal_initializer(stddev=.01, seed=seed))
    if use_bn:
      x = bn_relu(x, is_training, relu=False, center=use_bias)
    return tf.identity(x, '%s_out' % name)

def contrastive(hidden, temperature=0.5):
  hidden = tf.math.l2_normalize(hidden, -1)
  hidden1, hidden2 = tf.split(hidden, 2, 0)
  batch_size = tf.shape(hidden1)[0]
  labels = tf.one_hot(tf.range(batch_size), batch_size * 2, dtype=hidden.dtype)
  masks = tf.one_hot(tf.range(batch_size), batch_size, dtype=hidden.dtype)
  logits_aa = tf.matmul(hidden1, hidden1, transpose_b=True) / temperature - masks * 1e9
  logits_bb = tf.matmul(hidden2, hidden2, transpose_b=True) / temperature - masks * 1e9
  logits_ab = tf.matmul(hidden1, hidden2, transpose_b=True) / temperature
  logits_ba = tf.matmul(hidden2, hidden1, transpose_b=True) / temperature
  loss_a = tf1.losses.softmax_cross_entropy(labels, tf.concat([logits_ab, logits_aa], 1), weights=1.0)
  loss_b = tf1.losses.softmax_cross_entropy(labels, tf.concat([logits_ba, logits_bb], 1), weights=1.0)
  return loss_a + loss_b, logits_ab, labels

def model_fn(features, labels, mode, params=None):
  is_training = mode == tf.estimator.ModeKeys.TRAIN
  features_list = tf.split(features, num_or_size_splits=2, axis=-1)
  features = tf.concat(features_list, 0)
  with tf1.variable_scope('base_model'):
    hiddens = resnet(features, is_training)
  with tf1.variable_scope('head_contrastive', reuse=tf1.AUTO_REUSE):
    h = hiddens
    for j in range(3):
      last = j == 2
      h = linear_layer(h, is_training, 4 if last else 8, not last, True, 'nl_%d' % j, 5 + j)
      h = h if last else tf.nn.relu(h)
  contrast_loss, logits_con, labels_con = contrastive(h)
  logits_sup = tf.zeros([params['batch_size'], 3], features.dtype)
  with tf1.variable_scope('base_model'):   # ResNet-50's kernels, as its weight decay reads them
    for i in range(KERNELS):
      tf1.get_variable(f'kernel_{i}', [2], features.dtype, initializer=tf1.ones_initializer())
  l2 = [tf.nn.l2_loss(v) for v in tf1.trainable_variables() if 'batch_normalization' not in v.name]
  tf1.losses.add_loss(1e-4 * tf.add_n(l2))
  loss = tf1.losses.get_total_loss()
  optimizer = tf1.train.MomentumOptimizer(0.1, 0.9)
  control_deps = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
  control_deps.extend(tf1.summary.all_v2_summary_ops())   # none: train_summary_steps=0
  with tf.control_dependencies(control_deps):
    train_op = optimizer.minimize(loss, global_step=tf1.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _data(dtype=np.float32):
  rng = np.random.RandomState(0)
  scale = np.linspace(0.2, 3.0, B, dtype=np.float32).reshape([B, 1, 1, 1])
  x = (rng.randn(B, S, S, 6).astype(np.float32) * scale + 1.0).astype(dtype)
  y = {'labels': np.eye(3, dtype=np.float32)[np.arange(B) % 3], 'mask': np.ones(B, np.float32)}
  return x, y


def _input_fn(dtype=np.float32):
  x, y = _data(dtype)
  return lambda: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(B)


def _params():
  return {'batch_size': B}


class _TrainGraph(tf1.train.SessionRunHook):
  """The graph an Estimator's train() call builds (its heavy ops are counted)."""

  def begin(self):
    self.graph = tf1.get_default_graph()


def _train(model, num_cpus=1, model_dir=None, dtype=np.float32, hooks=None):
  estimator = testlib.make_estimator(model, num_cpus=num_cpus, model_dir=model_dir, params=_params())
  estimator.train(_input_fn(dtype), steps=2, hooks=hooks)
  return testlib.variables(estimator)


class _TwoSteps(tf1.train.SessionRunHook):
  """Every global variable at the session's start and after 2 steps (then it stops)."""

  def __init__(self, variables: dict):
    self._variables = variables
    self.start = self.after = None
    self._steps = 0

  def after_create_session(self, session, coord):
    del coord
    self.start, self._steps = session.run(self._variables), 0

  def after_run(self, run_context, run_values):
    del run_values
    self._steps += 1
    if self._steps == 2:
      self.after = run_context.session.run(self._variables)
      run_context.request_stop()


@functools.lru_cache(maxsize=None)
def _plain_float32():
  """Plain in float32, its TRAIN graph built once (as Estimator builds and runs it:
  estimator_graph) and run three times: 2 steps from its start, then from that start
  with every nonzero float nudged one ulp up, and down (rounding_floor's rule; the start is
  its step-0 values, which Estimator's step-0 checkpoint holds).

  Returns (variables after 2 steps, [the nudged runs' variables after 2 steps], the graph).
  """
  graph = estimator_graph.EstimatorGraph(model_fn, _input_fn(), tf.estimator.ModeKeys.TRAIN,
                                         params=_params())
  with graph.graph.as_default():
    variables = {v.op.name: v for v in tf1.global_variables()}
  steps = _TwoSteps(variables)
  graph.hooks.append(steps)
  try:
    graph.run()
    start, plain = steps.start, steps.after
    assert start['global_step'] == 0 and plain['global_step'] == 2
    nudged = []
    for direction in (np.inf, -np.inf):
      # Each variable's initializer fed the nudged value (the graph is finalized).
      graph.session.run([v.initializer for v in variables.values()], {
          v.initializer.inputs[1]: rounding_floor.nudged(start[n], direction)
          for n, v in variables.items()})
      graph.run()
      assert steps.start['global_step'] == 0 and steps.after['global_step'] == 2
      nudged.append(steps.after)
  finally:
    graph.close()
  return plain, nudged, graph.graph


@functools.lru_cache(maxsize=None)
def _plain_run(dtype):
  """Plain's variables after 2 steps (a plain Estimator)."""
  return _train(model_fn, dtype=dtype)


def _plain(dtype=np.float32):
  return _plain_float32()[0] if dtype == np.float32 else _plain_run(dtype)


def _plain_graph():
  """Plain's TRAIN graph (its heavy ops are each layout's measure)."""
  return _plain_float32()[2]


@functools.lru_cache(maxsize=None)
def _towered_run(devices, dtype=np.float32):
  """(variables after 2 steps on `devices` towers, sync_batch_norm=True; the TRAIN graph
  the Estimator built; the library's warnings while it built and ran it)."""
  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(devices),
                                  sync_batch_norm=True)
  built = _TrainGraph()
  with pytest.MonkeyPatch.context() as patch:
    warned = testlib.logged_warnings(patch)
    variables = _train(towered, devices, dtype=dtype, hooks=[built])
  return variables, built.graph, warned


def _towered(devices, dtype=np.float32):
  return _towered_run(devices, dtype)[0]


def _largest_difference(actual: dict, expected: dict) -> float:
  """max |actual - expected| / max(1, |expected|) over every variable (assert_close's measure)."""
  return max(float(np.max(np.abs(np.float64(actual[n]) - expected[n])
                          / np.maximum(1.0, np.abs(np.float64(expected[n])))))
             for n in expected if np.asarray(expected[n]).dtype.kind == 'f')


def _rounding_floor() -> float:
  """Plain's float32 rounding floor: plain from its start nudged one ulp up and down, against plain.

  rounding_floor's rule (the own-model check's): the ReLUs after batch norms pass all or
  nothing of the gradient of an activation within rounding of 0, so one ulp moves 2 steps
  by about 1e-3 (float64 removes it: 1 ulp moves them 4e-13, and the towers 3e-13).
  """
  plain, nudged, _ = _plain_float32()
  return max(_largest_difference(run, plain) for run in nudged)


@pytest.mark.parametrize('devices', [2, 3])
def test_the_head_is_built_on_every_shard(devices, monkeypatch):
  """No warning: each shard's split views are found (main: 'shard 1 built no counterpart of
  split_1:0', the head split per shard, 0.47 off plain), and every device holds its share."""
  if devices == 2:  # the graph test_two_steps_equal_plain_to_its_rounding_floor trains
    _, graph, warned = _towered_run(devices)
  else:
    warned = testlib.logged_warnings(monkeypatch)
    towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(devices),
                                    sync_batch_norm=True)
    x, y = _data()
    graph = heavy_ops.train_graph(towered, x, y, _params())
  share = heavy_ops.least_share(graph, _plain_graph(), devices)
  assert not warned, warned
  assert share >= 0.9, share


@pytest.mark.parametrize('devices', [2, 3])
def test_two_steps_equal_plain_in_float64(devices):
  """The same math as plain: in float64 (batch norms unfused: TensorFlow's fused kernel is
  float32-only) 2 steps on towers equal plain's to 1e-10 (measured 3e-13). Fails with
  sync_batch_norm=False (each tower's own batch statistics)."""
  expected = _plain(np.float64)
  assert any('moving_variance' in n for n in expected)
  assert expected['base_model/conv2d/kernel'].dtype == np.float64
  testlib.assert_variables_close(_towered(devices, np.float64), expected, tol=1e-10)


def test_two_steps_equal_plain_to_its_rounding_floor():
  """Upstream's float32 fused batch norms: 2 steps on 2 towers equal plain's within
  rounding_floor.tolerance (4 x plain's own rounding floor, about 1e-3: see
  _rounding_floor); the same math is test_two_steps_equal_plain_in_float64's."""
  floor = _rounding_floor()
  assert floor < 1e-2, floor   # rounding, not a wrong statistic
  testlib.assert_variables_close(_towered(2), _plain(), tol=rounding_floor.tolerance(floor))
