"""Keyed draws inside loops: a random op in a while loop draws what one device draws.

A random op built inside a `tf.while_loop` body is keyed by the op, the step,
the example's position in the global batch and the loop's iteration
(`estimator_towers/draws/loop_keys.py`). The reference of every test is the
same model_fn decorated for one device (keyed too), never the towered code's
own output; the models are tiny recurrent nets (batches of 10, 2 steps):

- TRAIN, every variable and slot after steps 1 and 2 equal to one device's:
  a `DropoutWrapper` (input, output and state keep probabilities) in
  `dynamic_rnn` on 2 and 3 towers, 1 x 2 and 2 x 2 micro-batches under
  control flow v2 (a functional `While`, TF2 behaviour), and on 3 towers
  under v1 (`disable_control_flow_v2()`, a loop's frame in the graph); one
  with `variational_recurrent=True` (v2 and v1); a Keras `LSTM` with
  `dropout` and `recurrent_dropout` on 2 towers and 1 x 2, a Keras `GRU` on
  2 towers (the costliest graphs here: Keras builds them slowly); a decoder loop
  that samples `tf.random.categorical` at each step (v2, and v1 with
  `maximum_iterations`). Whichever part of the model runs where, the update
  is one device's: a functional loop the row reader cannot split runs in the
  head on the whole batch (its draws keyed by the gathered positions), a v1
  loop, which no head can copy, on each tower's rows (its draws keyed by the
  tower's). (Micro-batches of a v1 loop fed by the batch are refused with or
  without draws: their head cannot be built.)
- PREDICT, the masks themselves: a loop that draws `tf.nn.dropout(ones)` at
  each step returns them; on 3 towers and 2 x 2 each example's masks are one
  device's, and, as TensorFlow's own stateful op draws, they differ from one
  iteration to the next and from one example to the next (drop the iteration
  from the key and every step draws the same mask: this test fails).
- The refusals that stay: a random op in a `tf.function`'s body, and in a v1
  loop with no iteration counter.

Across workers (2 workers x 2 towers, a `DropoutWrapper` in `dynamic_rnn`):
tests/test_collective.py::test_loop_draws_across_two_workers_of_two_towers.

Control flow v1 is a process-wide switch read when a loop is built: it is
turned off only while the v1 cases' graphs are built, and back on after.
"""

import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers as et
import testlib
from estimator_graph import EstimatorGraph

ModeKeys = tf.estimator.ModeKeys

T, F, U = 3, 4, 5      # time steps, features, units
CLASSES = 3
BATCH = 10
NUM_EXAMPLES = 20      # two steps of 10 (4/3/3 on 3 towers)
GRAPH_SEED = 11
LAYOUTS = {'2_towers': (2, 1), '3_towers': (3, 1), '1x2': (1, 2), '2x2': (2, 2)}


def _data():
  rng = np.random.RandomState(3)
  x = rng.randn(NUM_EXAMPLES, T, F).astype(np.float32)
  return x, rng.randint(0, CLASSES, NUM_EXAMPLES).astype(np.int32)


def _input_fn():
  x, y = _data()

  def input_fn():
    tf.compat.v1.set_random_seed(GRAPH_SEED)   # as Estimator does with tf_random_seed
    return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(BATCH)
  return input_fn


def _constant(shape, seed):
  values = np.random.RandomState(seed).uniform(-0.5, 0.5, shape).astype(np.float32)
  return tf.compat.v1.constant_initializer(values)


def _keras(layer):
  def encode(x):
    return layer(U, dropout=0.3, recurrent_dropout=0.4, kernel_initializer=_constant(
        [F, (4 if layer is tf.keras.layers.LSTM else 3) * U], 1),
        recurrent_initializer=_constant([U, (4 if layer is tf.keras.layers.LSTM else 3) * U], 2))(
            x, training=True)
  return encode


def _dropout_wrapper(variational):
  def encode(x):
    cell = tf.compat.v1.nn.rnn_cell.LSTMCell(U, initializer=_constant([F + U, 4 * U], 3))
    extra = dict(variational_recurrent=True, input_size=F, dtype=tf.float32) if variational \
        else {}
    cell = tf.compat.v1.nn.rnn_cell.DropoutWrapper(
        cell, input_keep_prob=0.7, output_keep_prob=0.8, state_keep_prob=0.6, **extra)
    outputs, _ = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float32)
    return outputs[:, -1]
  return encode


def _decoder(x):
  """Samples a class at each of T steps from logits that move with the step; the log
  probabilities of the samples (REINFORCE's) are what the loss reads."""
  logits = tf.compat.v1.layers.dense(tf.reshape(x, [-1, T * F]), CLASSES,
                                     kernel_initializer=_constant([T * F, CLASSES], 4))

  def step(i, samples):
    drawn = tf.random.categorical(logits + 0.5 * tf.cast(i, tf.float32), 1)[:, 0]
    return i + 1, samples.write(i, drawn)

  samples = tf.while_loop(lambda i, s: i < T, step,
                          (0, tf.TensorArray(tf.int64, size=T)), maximum_iterations=T)[1]
  samples = tf.transpose(samples.stack())                      # [batch, T]
  chosen = tf.gather(tf.nn.log_softmax(logits), samples, batch_dims=1)
  return chosen


ENCODERS = {'keras_lstm': _keras(tf.keras.layers.LSTM), 'keras_gru': _keras(tf.keras.layers.GRU),
            'dropout_wrapper': _dropout_wrapper(False), 'variational': _dropout_wrapper(True),
            'decoder': _decoder}


def _model_fn(features, labels, mode, params):
  h = ENCODERS[params['encoder']](features['x'])
  logits = tf.compat.v1.layers.dense(h, CLASSES, kernel_initializer=_constant(
      [h.shape[-1], CLASSES], 5))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _decorated(model_fn, layout):
  if layout is None:
    return et.replicate_model_fn(model_fn, devices=['/cpu:0'])
  devices, micro_batches = LAYOUTS[layout]
  return et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(devices),
                               micro_batches=micro_batches)


@contextlib.contextmanager
def _control_flow(version):
  """Control flow v1 (a loop's frame in the graph) or v2 (a functional While) while built."""
  if version == 'v2':
    yield
    return
  tf.compat.v1.disable_control_flow_v2()
  try:
    yield
  finally:
    tf.compat.v1.enable_control_flow_v2()


class _EachStep(tf.compat.v1.train.SessionRunHook):
  """Every global variable (slots included) after each step."""

  def __init__(self, variables: dict):
    self._variables = variables
    self.steps = []

  def after_run(self, run_context, run_values):
    del run_values
    self.steps.append(run_context.session.run(self._variables))


@functools.lru_cache(maxsize=None)
def _trained(encoder, version, layout=None):
  """Every variable after steps 1 and 2."""
  with _control_flow(version):
    graph = EstimatorGraph(_decorated(_model_fn, layout), _input_fn(), ModeKeys.TRAIN,
                           num_cpus=1 if layout is None else LAYOUTS[layout][0],
                           params={'encoder': encoder})
  with graph.graph.as_default():
    each = _EachStep({v.op.name: v for v in tf.compat.v1.global_variables()})
  graph.hooks.append(each)
  try:
    assert graph.run() == 2
  finally:
    graph.close()
  return each.steps


@pytest.mark.parametrize('encoder,version,layout', [
    ('dropout_wrapper', 'v2', '2_towers'), ('dropout_wrapper', 'v2', '3_towers'),
    ('dropout_wrapper', 'v2', '1x2'), ('dropout_wrapper', 'v2', '2x2'),
    ('dropout_wrapper', 'v1', '3_towers'),
    ('keras_lstm', 'v2', '2_towers'), ('keras_lstm', 'v2', '1x2'),
    ('keras_gru', 'v2', '2_towers'),
    ('variational', 'v2', '2_towers'), ('variational', 'v1', '2_towers'),
    ('decoder', 'v2', '3_towers'), ('decoder', 'v2', '2x2'), ('decoder', 'v1', '2_towers')])
def test_recurrent_dropout_trains_as_one_device(encoder, version, layout):
  for actual, expected in zip(_trained(encoder, version, layout), _trained(encoder, version)):
    testlib.assert_variables_close(actual, expected)


def test_the_draws_are_not_the_undecorated_model_fns():
  """The reference can fail: keyed draws inside the loop are not TensorFlow's own stream."""
  with _control_flow('v2'):
    graph = EstimatorGraph(_model_fn, _input_fn(), ModeKeys.TRAIN,
                           params={'encoder': 'keras_lstm'})
  with graph.graph.as_default():
    each = _EachStep({v.op.name: v for v in tf.compat.v1.global_variables()})
  graph.hooks.append(each)
  try:
    graph.run()
  finally:
    graph.close()
  kernel = 'lstm/lstm_cell/kernel'
  assert not np.allclose(each.steps[0][kernel], _trained('keras_lstm', 'v2')[0][kernel])


# --- The masks themselves -------------------------------------------------------------

WIDE = 16   # a mask's width: every example of a batch draws another mask


def _mask_model_fn(features, mode):
  """Predicts the dropout masks a loop draws at each of its T steps: [batch, T, WIDE]."""
  x = features['x']

  def step(i, masks):
    ones = tf.ones_like(x[:, 0, :1]) * tf.ones([1, WIDE])   # [batch, WIDE], the batch's rows
    return i + 1, masks.write(i, tf.nn.dropout(ones, rate=0.5))

  masks = tf.while_loop(lambda i, m: i < T, step, (0, tf.TensorArray(tf.float32, size=T)),
                        maximum_iterations=T)[1]
  return tf.estimator.EstimatorSpec(
      mode, predictions={'masks': tf.transpose(masks.stack(), [1, 0, 2])})


@functools.lru_cache(maxsize=None)
def _masks(version, layout='plain'):
  fn = _mask_model_fn if layout == 'plain' else _decorated(_mask_model_fn, layout)
  with _control_flow(version):
    graph = EstimatorGraph(fn, _input_fn(), ModeKeys.PREDICT,
                           num_cpus=1 if layout in ('plain', None) else LAYOUTS[layout][0])
  try:
    return np.concatenate([p['masks'] for p in graph.run()])
  finally:
    graph.close()


@pytest.mark.parametrize('version,layout', [('v2', '3_towers'), ('v2', '2x2'),
                                            ('v1', '3_towers')])
def test_each_examples_masks_are_one_devices(version, layout):
  testlib.assert_close(_masks(version, layout), _masks(version, None), tol=0)


@pytest.mark.parametrize('layout', ['plain', None])
def test_masks_differ_from_one_iteration_and_example_to_the_next(layout):
  """As TensorFlow's stateful op in the loop (the plain model_fn), a fresh mask each step."""
  masks = _masks('v2', layout)
  assert masks.shape == (NUM_EXAMPLES, T, WIDE)
  assert set(np.unique(masks)) == {0.0, 2.0}
  for t in range(1, T):
    assert not np.array_equal(masks[:, t], masks[:, 0]), f'step {t} draws step 0\'s mask'
  assert len({m.tobytes() for m in masks[:BATCH, 0]}) == BATCH   # a batch's examples differ


# --- What stays refused ----------------------------------------------------------------

_FIX = r"Fix: .*; or set random_draws='per_shard'"


def _build(draw, version='v2'):
  def model_fn(features, mode):
    return tf.estimator.EstimatorSpec(mode, predictions={'draw': draw(features['x'])})
  with tf.Graph().as_default(), _control_flow(version):
    tf.compat.v1.train.create_global_step()
    x = tf.compat.v1.placeholder_with_default(_data()[0][:BATCH], [None, T, F])
    _decorated(model_fn, '2_towers')({'x': x}, None, ModeKeys.PREDICT, None, None)


def test_error_a_random_op_in_a_tf_function():
  @tf.function
  def noisy(y):
    return y + tf.random.normal(tf.shape(y))
  with pytest.raises(ValueError, match=r'the random op random_standard_normal .* cannot be: it '
                                       r'is built inside a function body.*' + _FIX):
    _build(noisy)


def test_error_a_random_op_in_a_v1_loop_that_counts_no_iterations():
  def draw(x):
    return tf.while_loop(lambda i, y: i < 2,
                         lambda i, y: (i + 1, tf.nn.dropout(y, rate=0.5)), (0, x))[1]
  with pytest.raises(ValueError, match=r'the random op random_uniform .* cannot be: it is '
                                       r'built inside a v1 tf.while_loop .* that counts no '
                                       r'iterations.*Fix: give the loop maximum_iterations.*'
                                       r"or set random_draws='per_shard'"):
    _build(draw, 'v1')
