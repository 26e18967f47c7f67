"""A static batch size (`batch(drop_remainder=True)`): the whole batch's head is exact as ever.

With a static batch dimension the shard's shape is static, and `tf.shape(q)[0]`
would be a constant of the graph holding the shard's size; while a tower is
built shape reads stay ops of the graph (`interception.shape_reads_kept`), so
the head on the whole batch reads the whole batch's size, on towers and on
micro-batches, as with an unknown batch size: the in-batch softmax on 3 towers,
1 x 2, 1 x 3 and 2 x 2 (and on uneven static shards), CLIP and SimCLR on 3
towers, each against the undecorated model_fn on the same static batches
(every variable and Momentum slot within 1e-5 after steps 1 and 2), with no
warning; mixup cut at the input (`batch_mixing`) and attention's head.

A size read as a Python int (`q.shape[0]`, `q.shape.as_list()[0]`) is baked
into the graph as a constant the head cannot tell from a hyper-parameter: a
clear error at graph construction names it and the fix. Constants that are no
size read (a factor of a batch-size value, a folded rank, an axis, a one-hot
depth of the examples' labels) are not taken for one, nor is the constant
TensorFlow's gradient code makes of a static shape (an input-gradient penalty,
`tf.gradients(reduce_sum(logits), x)`: per example, trained as plain, as with
an unknown batch size). Such a constant that reaches a head on the whole batch
(a gradient through the mixing ops) is an error naming TensorFlow's gradient
code and the fix, not a size read in Python.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import cross_example_models as patterns
import testlib
import estimator_towers as et

ModeKeys = tf.estimator.ModeKeys
BATCH = 12
STEPS = 2


def _model_fn(pattern, features, labels, mode):
  loss, _ = pattern(features['x'], labels)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _input_fn(batch):
  rng = np.random.RandomState(5)
  x = rng.randn(batch * STEPS, patterns.F).astype(np.float32)
  y = (np.arange(batch * STEPS) % 3).astype(np.int32)
  return lambda: tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(
      batch, drop_remainder=True)


@functools.lru_cache(maxsize=None)
def _plain(name, batch=BATCH):
  """The undecorated model_fn on the whole (static) batch, after each of 2 steps."""
  return tuple(testlib.plain_train_and_read(functools.partial(_model_fn, getattr(patterns, name)),
                                            _input_fn(batch), at=(1, STEPS)))


def _towered(name, num_devices, micro_batches=1, batch=BATCH):
  model_fn = functools.partial(_model_fn, getattr(patterns, name))
  est = testlib.stepwise_estimator(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                            micro_batches=micro_batches),
      num_cpus=num_devices)
  return tuple(testlib.train_and_read(est, _input_fn(batch), at=(1, STEPS)))


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


def _check(warnings, name, num_devices, micro_batches=1, batch=BATCH):
  """Every variable and Momentum slot within 1e-5 of plain's after steps 1 and 2; no warning."""
  for towered, plain in zip(_towered(name, num_devices, micro_batches, batch),
                            _plain(name, batch)):
    testlib.assert_variables_close(towered, plain)
  assert not [w for w in warnings if 'estimator_towers' in w], warnings


LAYOUTS = {'3_towers': (3, 1), '1x2': (1, 2), '1x3': (1, 3), '2x2': (2, 2)}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_in_batch_softmax_equals_plain(layout, warnings):
  """Shards of 4 (3 towers), 6 (1 x 2), 4 (1 x 3), 3 (2 x 2): variables and momenta."""
  _check(warnings, 'in_batch_softmax', *LAYOUTS[layout])


def test_in_batch_softmax_uneven_static_shards_equal_plain(warnings):
  """A static batch of 10 on 3 towers: shards of 4, 3 and 3 (the last tower built)."""
  _check(warnings, 'in_batch_softmax', 3, batch=10)


@pytest.mark.parametrize('name', ['clip', 'simclr'])
def test_clip_and_simclr_on_towers_equal_plain(name, warnings):
  _check(warnings, name, 3)


def test_shape_reads_of_a_static_shard_are_ops_while_a_tower_is_built():
  """tf.shape / tf.size / tf.ones_like of a static shard: Shape, Size, OnesLike, not constants."""
  seen = {}

  def model_fn(features, labels, mode):
    x = features['x']
    seen['ops'] = [t.op.type for t in (tf.shape(x), tf.size(x), tf.ones_like(x),
                                       tf.zeros_like(x))]
    return _model_fn(patterns.in_batch_softmax, features, labels, mode)

  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3))
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    towered({'x': tf.zeros([BATCH, patterns.F])}, tf.zeros([BATCH], tf.int32), ModeKeys.TRAIN,
            None, None)
    assert seen['ops'] == ['Shape', 'Size', 'OnesLike', 'ZerosLike'], seen['ops']
    assert tf.shape(tf.zeros([2, 3])).op.type == 'Const'   # outside a tower: as TensorFlow's


# --- The batch size read as a Python int ------------------------------------------------

def python_int_range(x, y):
  """TPU-born code: the static batch size read in Python, `tf.range(q.shape[0])`."""
  q, d = patterns.encoders(x)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  labels = tf.range(q.shape[0])
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)), [q, d]


def python_int_eye(x, y):
  """`tf.eye(q.shape.as_list()[0])` as the in-batch softmax's one-hot labels."""
  q, d = patterns.encoders(x)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  labels = tf.eye(q.shape.as_list()[0])
  return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels, logits)), [q, d]


def _build(model, num_devices, micro_batches=1):
  towered = et.replicate_model_fn(functools.partial(_model_fn, model),
                                  devices=testlib.cpu_devices(num_devices),
                                  micro_batches=micro_batches)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    x = np.random.RandomState(0).randn(BATCH, patterns.F).astype(np.float32)
    towered({'x': tf.constant(x)}, tf.constant(np.arange(BATCH, dtype=np.int32) % 3),
            ModeKeys.TRAIN, None, None)


@pytest.mark.parametrize('model,const,where', [(python_int_range, 'range/limit', 'value'),
                                               (python_int_eye, 'eye/ones', 'shape')])
@pytest.mark.parametrize('num_devices,micro_batches', [(3, 1), (1, 2)])
def test_a_python_int_batch_size_is_an_error_naming_the_constant(model, const, where,
                                                                 num_devices, micro_batches):
  shard = BATCH // (num_devices * micro_batches)
  with pytest.raises(ValueError, match=(
      rf"the loss .* depends on MatMul op 'MatMul'.* its head on the whole batch reads the "
      rf"constant {const}:0 .*, which holds the shard's static size \({shard}\) in its "
      rf"{where}: a batch size read as a Python int \(x\.shape\[0\], "
      rf"x\.shape\.as_list\(\)\[0\]\).*Read the batch size with tf\.shape\(x\)\[0\]")):
    _build(model, num_devices, micro_batches)


def test_simclr_on_shards_of_2_is_not_taken_for_a_python_int(warnings):
  """`one_hot(range(batch), batch * 2)` on static shards of 2: the factor 2 of a batch-size
  value is no size read in Python; the head builds, without warning."""
  towered = et.replicate_model_fn(functools.partial(_model_fn, patterns.simclr),
                                  devices=testlib.cpu_devices(3),
                                  resume_input=False)  # built on tensors: nothing to position
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    x = np.random.RandomState(0).randn(6, patterns.F).astype(np.float32)
    towered({'x': tf.constant(x)}, tf.zeros([6], tf.int32), ModeKeys.TRAIN, None, None)
  assert not [w for w in warnings if 'estimator_towers' in w], warnings


# --- Cuts (batch_mixing): mixup at the input, attention mid-network --------------------

class _GraphOf(tf.compat.v1.train.SessionRunHook):
  def begin(self):
    self.graph = tf.compat.v1.get_default_graph()


@pytest.mark.parametrize('name', ['mixup', 'attention'])
def test_cuts_on_a_static_batch_equal_plain(name, warnings):
  """Mixup: its reverses computed once on the whole batch (`batch_mixing`), the network after
  them on each tower's rows, no whole-batch head, as with an unknown batch size. Attention
  (`h h^T`, whose columns are the batch's: the static shard's layers after it were built for
  the shard's columns): not cut, the whole batch's head from h, exact, with the warning that
  it runs once on one device."""
  model_fn = functools.partial(_model_fn, getattr(patterns, name))
  est = testlib.stepwise_estimator(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)), num_cpus=3)
  hook = _GraphOf()
  towered = testlib.train_and_read(est, _input_fn(BATCH), at=(1, STEPS), hooks=[hook])
  for mine, plain in zip(towered, _plain(name)):
    testlib.assert_variables_close(mine, plain)
  names = [op.name for op in hook.graph.get_operations()]
  head = any(n.startswith(('whole_batch_head/', 'row_wise_head/')) for n in names)
  assert head == (name == 'attention'), name
  ours = [w for w in warnings if 'estimator_towers' in w]
  if name == 'mixup':
    assert any(n.startswith('batch_mixing/') and n.endswith('ReverseV2') for n in names)
    assert not ours, ours
  else:   # exact; the one warning: the head runs once, on one device (`work_share`)
    assert len(ours) == 1 and 'runs once, on the whole batch' in ours[0], ours


def test_a_number_of_classes_equal_to_the_shard_size_is_not_refused(warnings):
  """Mixup's `one_hot(y, 3)` on static shards of 3: the depth of the examples' own labels is
  a number of classes, not a size read in Python; the loss trains (no error, no warning)."""
  towered = et.replicate_model_fn(functools.partial(_model_fn, patterns.mixup),
                                  devices=testlib.cpu_devices(3),
                                  resume_input=False)  # built on tensors: nothing to position
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    x = np.random.RandomState(0).randn(9, patterns.F).astype(np.float32)
    towered({'x': tf.constant(x)}, tf.constant(np.arange(9, dtype=np.int32) % 3),
            ModeKeys.TRAIN, None, None)
  assert not [w for w in warnings if 'estimator_towers' in w], warnings


# --- An input-gradient penalty (WGAN-GP): TensorFlow's gradient of a static shape -----------

def input_gradient_penalty(x, y):
  """Cross-entropy plus 0.1 * mean(sum(g**2)), g = tf.gradients(reduce_sum(logits), x): per
  example. With a static shard, the gradient of reduce_sum is a constant of the shard's shape
  tiled (`gradients/Sum_grad/Const`, `.../Tile`), every row the same: no size read in
  Python, and nothing mixes the rows."""
  h = tf.compat.v1.layers.dense(x, 8, activation=tf.nn.tanh, name='h',
                                kernel_initializer=tf.compat.v1.glorot_uniform_initializer(1))
  logits = tf.compat.v1.layers.dense(
      h, 3, name='logits', kernel_initializer=tf.compat.v1.glorot_uniform_initializer(2))
  g = tf.gradients(tf.reduce_sum(logits), x)[0]
  penalty = tf.reduce_mean(tf.reduce_sum(g ** 2, axis=1))
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits) + 0.1 * penalty, [h]


@pytest.mark.parametrize('static', [True, False], ids=['static', 'unknown'])
def test_input_gradient_penalty_on_towers_equals_plain(static, warnings):
  """A batch of 7 on 3 towers (shards of 3, 2, 2), static or of unknown size: every variable
  and Momentum slot within 1e-5 of plain's after steps 1 and 2, no warning."""
  model_fn = functools.partial(_model_fn, input_gradient_penalty)
  rng = np.random.RandomState(5)
  x = rng.randn(7 * STEPS, patterns.F).astype(np.float32)
  y = (np.arange(7 * STEPS) % 3).astype(np.int32)
  input_fn = lambda: tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(
      7, drop_remainder=static)
  plain = testlib.plain_train_and_read(model_fn, input_fn, at=(1, STEPS))
  est = testlib.stepwise_estimator(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)), num_cpus=3)
  for towered, expected in zip(testlib.train_and_read(est, input_fn, at=(1, STEPS)), plain):
    testlib.assert_variables_close(towered, expected)
  assert not [w for w in warnings if 'estimator_towers' in w], warnings


def gradient_through_in_batch_softmax(x, y):
  """The in-batch softmax plus a penalty on tf.gradients(reduce_sum(logits), q): the gradient
  of the sum of the B x B logits goes through the mixing MatMul, into the head."""
  q, d = patterns.encoders(x)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  g = tf.gradients(tf.reduce_sum(logits), q)[0]
  labels = tf.range(tf.shape(q)[0])
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  return loss + 0.1 * tf.reduce_mean(tf.reduce_sum(g ** 2, 1)), [q, d]


def test_a_static_shape_of_tensorflows_gradient_code_in_the_head_is_an_error_naming_it():
  """Its constant (`gradients/Sum_grad/Const`, the shard's [4, 4]) is no batch size read in
  Python: the error names TensorFlow's gradient code and the fix (an unknown batch size)."""
  with pytest.raises(ValueError, match=(
      r"reads the constant gradients/Sum_grad/Const:0 .*which holds the shard's static size "
      r"\(4\) in its value: TensorFlow's gradient code built it from a static shape of the "
      r"shard.*Leave the batch dimension unknown")) as raised:
    _build(gradient_through_in_batch_softmax, 3)
  assert 'read as a Python int' not in str(raised.value)
