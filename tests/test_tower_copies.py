"""Towers after the first copied from its ops (estimator_towers.tower_copies).

The reference is the plain single-device model_fn on the same data: a copied
tower must train exactly as a built one. Each case also checks, on the graph,
whether the towers were copied (tower 0's backward pass copied under
`tower_<k>/`; a built tower's is under `gradients/tower_<k>/`) or built, so that a case meant to copy cannot pass
by building, nor a case that must build by copying.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import control_flow_util_v2  # pylint: disable=g-direct-tensorflow-import

import heavy_ops
import testlib
from estimator_towers import current_tower
from estimator_towers import replicate as towers
from estimator_towers import replicate_model_fn
from estimator_towers.towers import tower_copies

ModeKeys = tf.estimator.ModeKeys


class _GraphOf(tf.compat.v1.train.SessionRunHook):
  """Keeps the graph of the training it is passed to."""

  def begin(self):
    self.graph = tf.compat.v1.get_default_graph()


def _copied(graph: tf.Graph, tower: int) -> bool:
  return any(op.name.startswith(f'tower_{tower}/') and '_grad/' in op.name
             for op in graph.get_operations())


def _built(graph: tf.Graph, tower: int) -> bool:
  """True if tower `tower` was built by running the model_fn (its ops under tower_<k>/)."""
  return (any(op.name.startswith(f'tower_{tower}/') for op in graph.get_operations())
          and not _copied(graph, tower))


def _train(model_fn, num_devices, x, y, batch, static_batch=False, steps=2, seed=None,
           **towered):
  """The variables after `steps` steps, and the graph (towered when num_devices > 1)."""
  if num_devices > 1:
    model_fn = replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices), **towered)
  estimator = testlib.make_estimator(model_fn, num_cpus=num_devices, tf_random_seed=seed)
  hook = _GraphOf()
  estimator.train(testlib.input_fn(x, y, batch, static_batch=static_batch, epochs=steps),
                  steps=steps, hooks=[hook])
  return testlib.variables(estimator), hook.graph


def _convnet_model_fn(features, labels, mode):
  """Conv + fused batch norm (moving averages in UPDATE_OPS) + dense, Momentum, clipping."""
  training = mode == ModeKeys.TRAIN
  image = tf.reshape(features, [-1, 1, testlib.NUM_FEATURES, 1])
  conv = tf.compat.v1.layers.conv2d(
      image, 4, (1, 3), padding='same', use_bias=False,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  normed = tf.nn.relu(tf.compat.v1.layers.batch_normalization(conv, training=training))
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.flatten(normed), testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    grads, variables = zip(*optimizer.compute_gradients(loss))
  grads, _ = tf.clip_by_global_norm(grads, 1.0)
  train_op = optimizer.apply_gradients(zip(grads, variables),
                                       tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _embedding_model_fn(features, labels, mode):
  """An embedding lookup (IndexedSlices gradients) and a token-weighted mean loss."""
  del mode
  ids = tf.cast(tf.abs(features[:, :2]) * 3, tf.int32) % 7
  table = tf.compat.v1.get_variable(
      'table', initializer=tf.constant(np.linspace(-1, 1, 7 * 4, dtype=np.float32).reshape(7, 4)))
  embedded = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), 1)
  logits = tf.compat.v1.layers.dense(
      embedded, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
  weights = tf.cast(labels > 0, tf.float32) + 0.5
  losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  loss = tf.reduce_sum(losses * weights) / tf.reduce_sum(weights)
  train_op = tf.compat.v1.train.AdagradOptimizer(0.3).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(ModeKeys.TRAIN, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices', [2, 3])
@pytest.mark.parametrize('model_fn', [testlib.v1_model_fn, _embedding_model_fn],
                         ids=['v1', 'ratio_loss_embedding'])
def test_copied_towers_train_as_plain(model_fn, num_devices):
  """Shards of 5 and 4 (a mean weighs them unequally) or 3 each."""
  x, y = testlib.data(18)
  plain, _ = _train(model_fn, 1, x, y, 9)
  towered, graph = _train(model_fn, num_devices, x, y, 9)
  assert all(_copied(graph, k) for k in range(1, num_devices))
  testlib.assert_variables_close(towered, plain)


@pytest.mark.parametrize('static_batch', [False, True], ids=['all_copied', 'last_built'])
@pytest.mark.parametrize('strategy', ['replicated', 'collective'])
def test_towers_with_their_own_variable_copies(strategy, static_batch):
  """Copied towers read (and differentiate) their own copies of the variables.

  A batch of 7 over 4 towers (2/2/2/1): unknown when built, every tower is
  copied; static, the last one differs in shape from the first and is built.
  """
  x, y = testlib.data(14)
  plain, _ = _train(testlib.v1_model_fn, 1, x, y, 7, static_batch=static_batch)
  towered, graph = _train(testlib.v1_model_fn, 4, x, y, 7, static_batch=static_batch,
                          variable_strategy=strategy)
  assert _copied(graph, 1) and _copied(graph, 2)
  assert _copied(graph, 3) != static_batch
  for k in (1, 2, 3):
    reads = {op.inputs[0].op.name for op in graph.get_operations()
             if op.type == 'ReadVariableOp' and op.name.startswith(f'tower_{k}/')}
    assert reads and all(name.endswith(f'/replica_{k}') for name in reads), reads
  testlib.assert_variables_close(towered, plain)


@pytest.mark.parametrize('model_fn', [testlib.keras_model_fn, _convnet_model_fn],
                         ids=['keras', 'convnet'])
def test_copied_batch_norm_towers_train_as_built(model_fn, monkeypatch):
  """sync_batch_norm=False: each tower normalises its shard, copied or built alike.

  (Unsynced towers differ from plain by design; the default, synchronised, is
  checked against plain below and in tests/test_sync_batch_norm.py.)
  """
  x, y = testlib.data(18)
  copied, graph = _train(model_fn, 3, x, y, 9, sync_batch_norm=False)
  monkeypatch.setattr(towers, '_tower_copies', lambda *args: None)
  built, built_graph = _train(model_fn, 3, x, y, 9, sync_batch_norm=False)
  assert _copied(graph, 1) and _copied(graph, 2) and _built(built_graph, 1)
  testlib.assert_variables_close(copied, built)


@pytest.mark.parametrize('batch', [10, 2])
def test_copied_synchronised_batch_norm_trains_as_plain(batch, monkeypatch):
  """Each copy's statistics join the sync points; its normalisation has its own gradient.

  Batch 2 over 3 towers: the third shard is empty at run time (its borrowed
  row counts 0, and each tower's correction is its own).
  """
  forward = []
  copy = tower_copies.TowerCopies.copy

  def spy(self, k, *args):
    found = copy(self, k, *args)
    forward.append((k, found is not None))
    return found
  monkeypatch.setattr(tower_copies.TowerCopies, 'copy', spy)
  x, y = testlib.data(2 * batch)
  plain, _ = _train(_convnet_model_fn, 1, x, y, batch)
  towered, _ = _train(_convnet_model_fn, 3, x, y, batch, sync_batch_norm=True)
  assert forward == [(1, True), (2, True)]
  testlib.assert_variables_close(towered, plain)


def test_copies_run_on_their_towers_devices():
  x, y = testlib.data(9)
  _, graph = _train(_convnet_model_fn, 3, x, y, 9, steps=1)
  for k in (1, 2):
    convs = [op for op in graph.get_operations()
             if op.name.startswith(f'tower_{k}/') and op.type in ('Conv2D', 'Conv2DBackpropFilter', 'FusedBatchNormV3',
                             'FusedBatchNormGradV3', 'MatMul')]
    assert convs and all(tf.DeviceSpec.from_string(op.device).device_index == k
                         for op in convs), [(op.name, op.device) for op in convs]


@pytest.mark.parametrize('model_fn', [_convnet_model_fn, _embedding_model_fn],
                         ids=['convnet', 'ratio_loss_embedding'])
def test_a_copy_holds_only_ops_its_step_runs(model_fn):
  """A copy leaves out what tower 0's passes made that no step reads: the gradients
  tf.gradients makes on the way and nobody asked for (the first layer's input, a loss
  normaliser's), a loss's static shape checks, the value a moving average's update
  returns. Each copy is the first tower's ops a step runs, and they still train as
  plain (test_copied_towers_train_as_plain, test_copied_synchronised_batch_norm_...)."""
  x, y = testlib.data(18)
  _, graph = _train(model_fn, 3, x, y, 9, steps=1)
  fetched = graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP) + [
      op for op in graph.get_operations() if op.type in ('ScalarSummary', 'MergeSummary')]
  run = heavy_ops.walk(fetched)  # what the step runs
  for k in (1, 2):
    copy = [op for op in graph.get_operations() if op.name.startswith(f'tower_{k}/')]
    assert copy and _copied(graph, k)
    assert not [op.name for op in copy if op not in run]


def _dropout_model_fn(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(
      features, 8, activation=tf.nn.relu,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=4))
  hidden = tf.compat.v1.layers.dropout(hidden, 0.5, training=mode == ModeKeys.TRAIN)
  logits = tf.compat.v1.layers.dense(hidden, testlib.NUM_CLASSES)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _random_seeds(graph: tf.Graph) -> list:
  seeds = []
  for op in graph.get_operations():
    if op.type.startswith('Random') and 'initializer' not in op.name.lower():
      seeds.append((op.get_attr('seed'), op.get_attr('seed2')))
  return sorted(seeds)


def test_copies_draw_the_op_seeds_a_build_would(monkeypatch):
  """Drawn per shard under a graph-level seed, each tower's dropout gets its own op seed."""
  x, y = testlib.data(9)
  _, copied = _train(_dropout_model_fn, 3, x, y, 9, steps=1, seed=11, random_draws='per_shard')
  monkeypatch.setattr(towers, '_tower_copies', lambda *args: None)
  _, built = _train(_dropout_model_fn, 3, x, y, 9, steps=1, seed=11, random_draws='per_shard')
  assert _copied(copied, 1) and _built(built, 1)
  seeds = _random_seeds(copied)
  assert len(seeds) == 3 and len(set(seeds)) == 3, seeds
  assert seeds == _random_seeds(built)


def _rnn_model_fn(features, labels, mode):
  """An LSTM over the features read as a sequence (a functional While loop and its gradient
  loop), then dense."""
  steps = features[:, :, None]   # a sequence of NUM_FEATURES steps of one value
  init = tf.compat.v1.glorot_uniform_initializer(seed=3)
  with tf.compat.v1.variable_scope('rnn', initializer=init):
    outputs, _ = tf.compat.v1.nn.dynamic_rnn(
        tf.compat.v1.nn.rnn_cell.LSTMCell(6), steps, dtype=tf.float32)
  logits = tf.compat.v1.layers.dense(
      outputs[:, -1], testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _seeded_loop_model_fn(features, labels, mode):
  """A loop whose body draws with an op seed (per-shard draws): a build would seed it anew."""
  _, noisy = tf.while_loop(lambda i, x: i < 2,
                           lambda i, x: (i + 1, x + 0.01 * tf.random.uniform(tf.shape(x), seed=7)),
                           [0, features])
  return testlib.v1_model_fn(noisy, labels, mode, None)


def _loop_functions(graph: tf.Graph, op: tf.Operation) -> dict:
  """The FunctionDefs loop `op` calls, and those they call, by name."""
  found, pending = {}, [op.get_attr('body').name, op.get_attr('cond').name]
  while pending:
    name = pending.pop()
    if name in found:
      continue
    found[name] = graph._get_function(name).definition  # pylint: disable=protected-access
    for node in found[name].node_def:
      pending.extend(v.func.name for v in node.attr.values() if v.WhichOneof('value') == 'func')
  return found


def test_a_recurrent_tower_is_copied_with_its_loops_on_its_device(monkeypatch):
  """A tower's loops (the LSTM's and its gradient's) are copied, not traced again: they call
  copies of tower 0's functions whose ops run on the tower's own device; it trains as a
  built tower and as plain."""
  logged = []
  monkeypatch.setattr(tower_copies, '_log_once', logged.append)
  x, y = testlib.data(12)
  plain, _ = _train(_rnn_model_fn, 1, x, y, 12)
  copied, graph = _train(_rnn_model_fn, 3, x, y, 12)
  assert not logged, logged
  override = control_flow_util_v2._EXPERIMENTAL_OUTPUT_ALL_INTERMEDIATES_OVERRIDE  # pylint: disable=protected-access
  assert override is None, override   # put back after the build
  loops = [op for op in graph.get_operations() if op.type in ('While', 'StatelessWhile')]
  first = {name for op in loops if not op.name.startswith('tower_')
           for name in _loop_functions(graph, op)}
  for k in (1, 2):
    assert _copied(graph, k)
    mine = [op for op in loops if op.name.startswith(f'tower_{k}/')]
    assert len(mine) == 2, [op.name for op in loops]   # the LSTM and its gradient
    for op in mine:
      assert tf.DeviceSpec.from_string(op.device).device_index == k, (op.name, op.device)
      functions = _loop_functions(graph, op)
      assert not set(functions) & first, sorted(functions)
      devices = {node.device for f in functions.values() for node in f.node_def if node.device}
      assert devices and all(tf.DeviceSpec.from_string(d).device_index == k for d in devices), (
          op.name, devices)
  monkeypatch.setattr(towers, '_tower_copies', lambda *args: None)
  built, graph = _train(_rnn_model_fn, 3, x, y, 12)
  assert _built(graph, 1)
  testlib.assert_variables_close(copied, plain)
  testlib.assert_variables_close(copied, built)


def _next_value_model_fn(features, labels, mode):
  """Features only: an LSTM reads the first steps of each example and predicts its last."""
  del labels
  steps = features[:, :-1, None]
  init = tf.compat.v1.glorot_uniform_initializer(seed=3)
  with tf.compat.v1.variable_scope('rnn', initializer=init):
    outputs, _ = tf.compat.v1.nn.dynamic_rnn(
        tf.compat.v1.nn.rnn_cell.LSTMCell(4), steps, dtype=tf.float32)
  guess = tf.compat.v1.layers.dense(
      outputs[:, -1], 1, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
  loss = tf.reduce_mean(tf.square(guess[:, 0] - features[:, -1]))
  train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_a_features_only_recurrent_model_is_copied_and_trains_as_plain(monkeypatch):
  logged = []
  monkeypatch.setattr(tower_copies, '_log_once', logged.append)
  x, _ = testlib.data(12)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(x).repeat(2).batch(12)
  trained = {}
  for n in (1, 3):
    model_fn = (_next_value_model_fn if n == 1 else replicate_model_fn(
        _next_value_model_fn, devices=testlib.cpu_devices(n)))
    estimator = testlib.make_estimator(model_fn, num_cpus=n)
    hook = _GraphOf()
    estimator.train(input_fn, steps=2, hooks=[hook])
    trained[n] = testlib.variables(estimator)
  assert not logged, logged
  assert _copied(hook.graph, 1) and _copied(hook.graph, 2)
  testlib.assert_variables_close(trained[3], trained[1])


def test_a_loop_with_a_seeded_draw_is_built_not_copied(monkeypatch):
  logged = []
  monkeypatch.setattr(tower_copies, '_log_once', logged.append)
  x, y = testlib.data(8)
  _, graph = _train(_seeded_loop_model_fn, 2, x, y, 8, seed=2, random_draws='per_shard')
  assert _built(graph, 1)
  assert any('draws seeded random numbers (RandomUniform' in m for m in logged), logged


def _asks_its_tower_model_fn(features, labels, mode):
  if current_tower().primary:
    tf.compat.v1.summary.scalar('first_feature', tf.reduce_mean(features[:, 0]))
  return testlib.v1_model_fn(features, labels, mode, None)


def _device_scope_model_fn(features, labels, mode):
  with tf.device('/cpu:0'):
    features = tf.identity(features) * 1.0
  return testlib.v1_model_fn(features, labels, mode, None)


def _cond_model_fn(features, labels, mode):
  step = tf.compat.v1.train.get_global_step()
  features = tf.cond(step >= 0, lambda: features * 2.0, lambda: features)
  return testlib.v1_model_fn(features, labels, mode, None)


@pytest.mark.parametrize('model_fn, batch, static, reason', [
    (_asks_its_tower_model_fn, 9, False, 'asked which tower'),
    (_device_scope_model_fn, 9, False, 'by the model_fn (a device scope)'),
    (_cond_model_fn, 9, False, 'calls a function'),
    (lambda features, labels, mode: testlib.v1_model_fn(features, labels, mode, None),
     7, True, 'differ in static shape'),
], ids=['current_tower', 'device_scope', 'tf_cond', 'static_uneven_shards'])
def test_towers_that_cannot_be_copied_are_built(model_fn, batch, static, reason, monkeypatch):
  logged = []
  monkeypatch.setattr(tower_copies, '_log_once', logged.append)
  x, y = testlib.data(14)
  plain, _ = _train(model_fn, 1, x, y, batch, static_batch=static)
  towered, graph = _train(model_fn, 2, x, y, batch, static_batch=static)
  assert _built(graph, 1), [op.name for op in graph.get_operations()][:50]
  assert any(reason in message for message in logged), logged
  testlib.assert_variables_close(towered, plain)


def _unshared_table_model_fn(features, labels, mode):
  """A lookup table with no shared name, filled by its own initializer (TABLE_INITIALIZERS)."""
  table = tf.raw_ops.HashTableV2(key_dtype=tf.int64, value_dtype=tf.float32, shared_name='',
                                 use_node_name_sharing=False)
  tf.compat.v1.add_to_collection(
      tf.compat.v1.GraphKeys.TABLE_INITIALIZERS, tf.raw_ops.LookupTableImportV2(
          table_handle=table, keys=tf.constant([0, 1], tf.int64),
          values=tf.constant([0.5, 2.0])))
  scale = tf.raw_ops.LookupTableFindV2(table_handle=table, keys=tf.cast(labels > 0, tf.int64),
                                       default_value=tf.constant(1.0))
  logits = tf.compat.v1.layers.dense(
      features * tf.reshape(scale, [-1, 1]), testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_an_op_that_creates_a_resource_is_built_not_copied():
  """A copy of the table's op would be a new table no initializer fills (the step failed)."""
  x, y = testlib.data(18)
  plain, _ = _train(_unshared_table_model_fn, 1, x, y, 9)
  towered, graph = _train(_unshared_table_model_fn, 2, x, y, 9)
  assert _built(graph, 1)
  testlib.assert_variables_close(towered, plain)


class _Collected(tf.compat.v1.train.SessionRunHook):
  """How many tensors the model_fn added to its own collection 'per_example_losses'."""

  def begin(self):
    self.count = len(tf.compat.v1.get_collection('per_example_losses'))


@pytest.mark.parametrize('asks_tower', [False, True], ids=['copied', 'built'])
def test_a_collection_holds_the_first_tower_s_tensors_unless_every_tower_is_built(asks_tower):
  """The documented side-effect rule: a copied tower runs none of the model_fn's Python,
  so a tensor it adds to a collection is added once (tower 0's); a model_fn that
  asks current_tower() has every tower built, each adding its own."""

  def model_fn(features, labels, mode):
    if asks_tower:
      current_tower()
    logits = tf.compat.v1.layers.dense(
        features, testlib.NUM_CLASSES,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=6))
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    tf.compat.v1.add_to_collection('per_example_losses', losses)
    loss = tf.reduce_mean(losses)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  x, y = testlib.data(9)
  estimator = testlib.make_estimator(
      replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)), num_cpus=3)
  collected = _Collected()
  estimator.train(testlib.input_fn(x, y, 9), steps=1, hooks=[collected])
  assert collected.count == (3 if asks_tower else 1)
