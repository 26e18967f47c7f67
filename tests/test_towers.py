"""replicate_model_fn behaviours beyond the basic equivalence matrix.

Every numeric check compares against the plain single-device model_fn run by a
plain Estimator on the same data.
"""

import functools
import os
import threading

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn
from estimator_towers.base import interception

ModeKeys = tf.estimator.ModeKeys


def _input_fn(num_examples, epochs=1):
  """Batches of 7 of testlib.data(num_examples), `epochs` times."""
  x, y = testlib.data(num_examples)
  return testlib.input_fn(x, y, 7, epochs=epochs)


@functools.lru_cache(maxsize=None)
def _plain_variables(model_fn, num_examples, epochs, steps):
  """The plain model_fn's variables after `steps` steps (shared by the device counts)."""
  plain = testlib.make_estimator(model_fn)
  plain.train(_input_fn(num_examples, epochs), steps=steps)
  return testlib.variables(plain)


def _train_pair(model_fn, num_devices, num_examples, epochs=1, steps=1, **towered_kwargs):
  """Variables after `steps` steps of the plain and the towered model_fn, on
  batches of 7 of testlib.data(num_examples) repeated `epochs` times."""
  towered = testlib.make_estimator(
      replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                         **towered_kwargs),
      num_cpus=num_devices)
  towered.train(_input_fn(num_examples, epochs), steps=steps)
  return _plain_variables(model_fn, num_examples, epochs, steps), testlib.variables(towered)


# --- Decorator forms and signature ---------------------------------------------

def test_decorator_keeps_name_docstring_and_forwards_only_accepted_args():
  def model_fn(features, labels, mode):
    """Doc of the user's model_fn."""
    return testlib.v1_model_fn(features, labels, mode, params=None)

  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(2))
  assert towered.__name__ == 'model_fn'
  assert towered.__doc__ == 'Doc of the user\'s model_fn.'
  # A model_fn without `params` must still be refused params by Estimator.
  with pytest.raises(ValueError, match='does not include params'):
    tf.estimator.Estimator(towered, params={'a': 1})
  x, y = testlib.data(7)
  est = testlib.make_estimator(towered, num_cpus=2)
  est.train(testlib.input_fn(x, y, 7), steps=1)
  # The plain reference: the function model_fn calls, on the same batch (the same update).
  testlib.assert_variables_close(testlib.variables(est),
                                 _plain_variables(testlib.v1_model_fn, 7, 1, 1))


@pytest.mark.parametrize('form', ['positional', 'keyword'])
def test_count_forms_build_gpu_towers_and_run_with_soft_placement(form, monkeypatch):
  """@replicate_model_fn(2) and (num_gpus=2) mean /gpu:0, /gpu:1; with soft
  placement TensorFlow runs them on the CPU (here two GPUs are pretended to be
  visible, so that the count is accepted on a machine without GPUs)."""
  from estimator_towers.placement import devices as devices_lib
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: ['/device:GPU:0', '/device:GPU:1'])
  decorate = replicate_model_fn(2) if form == 'positional' else replicate_model_fn(num_gpus=2)
  towered = decorate(testlib.v1_model_fn)
  x, y = testlib.data(7)
  fn = testlib.input_fn(x, y, 7)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    config = testlib.run_config(1)
    config.session_config.allow_soft_placement = True
    spec = towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, config)
    matmuls = {op.device for op in tf.compat.v1.get_default_graph().get_operations()
               if op.type == 'MatMul' and 'gradients' not in op.name}
    assert matmuls == {'/device:GPU:0', '/device:GPU:1'}
    assert spec.train_op is not None
  est = tf.estimator.Estimator(towered, model_dir=None, config=tf.estimator.RunConfig(
      session_config=tf.compat.v1.ConfigProto(allow_soft_placement=True)))
  est.train(fn, steps=1)
  testlib.assert_variables_close(testlib.variables(est),
                                 _plain_variables(testlib.v1_model_fn, 7, 1, 1))


def test_bare_decorator_uses_every_gpu_or_the_cpu():
  towered = replicate_model_fn(testlib.v1_model_fn)
  x, y = testlib.data(5)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, None)
    devices = {op.device for op in tf.compat.v1.get_default_graph().get_operations()
               if op.type == 'MatMul'}
  gpus = tf.config.list_physical_devices('GPU')
  expected = {f'/device:GPU:{i}' for i in range(len(gpus))} if gpus else {'/device:CPU:0'}
  assert devices == expected


def test_a_gpu_count_beyond_the_visible_gpus_fails_at_graph_construction(monkeypatch):
  from estimator_towers.placement import devices as devices_lib
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: [])
  towered = replicate_model_fn(testlib.v1_model_fn, num_gpus=2)
  x, y = testlib.data(4)
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    with pytest.raises(ValueError, match=r'num_gpus=2 asks for 2 GPUs but 0 are visible .*CPU:0.*'
                       r'allow_cpu_fallback=True'):
      towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, testlib.run_config(1))


# --- Gradients ------------------------------------------------------------------

def _partly_used_model_fn(features, labels, mode, params):
  """A variable no loss uses, and one used only in one branch of a tf.cond."""
  x = features
  w = tf.compat.v1.get_variable(
      'w', [testlib.NUM_FEATURES, testlib.NUM_CLASSES],
      initializer=tf.compat.v1.random_normal_initializer(seed=4))
  unused = tf.compat.v1.get_variable('unused', [3], initializer=tf.compat.v1.ones_initializer())
  branch = tf.Variable(tf.ones([testlib.NUM_CLASSES]) * 0.5, name='branch_only')
  logits = tf.matmul(x, w)
  logits = tf.cond(tf.reduce_sum(x) > 1e9, lambda: logits, lambda: logits * branch)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
      loss, tf.compat.v1.train.get_global_step())
  del unused
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices', [2, 3])
def test_variables_without_gradient(num_devices):
  plain, towered = _train_pair(_partly_used_model_fn, num_devices, 7)
  testlib.assert_variables_close(towered, plain)
  np.testing.assert_array_equal(towered['unused'], np.ones(3))


def _two_optimizers_model_fn(features, labels, mode, params):
  """Two losses, two var lists, two optimizers (one with slots), one train_op."""
  x = features
  encoder = tf.compat.v1.layers.Dense(
      4, activation=tf.nn.tanh, name='encoder',
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
  head = tf.compat.v1.layers.Dense(
      testlib.NUM_CLASSES, name='head',
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=6))
  hidden = encoder(x)
  logits = head(hidden)
  loss_head = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  loss_encoder = tf.reduce_mean(tf.square(hidden)) + loss_head
  step = tf.compat.v1.train.get_global_step()
  op1 = tf.compat.v1.train.MomentumOptimizer(0.3, 0.9).minimize(
      loss_head, var_list=head.trainable_weights, global_step=step)
  with tf.control_dependencies([op1]):
    op2 = tf.compat.v1.train.AdamOptimizer(0.01).minimize(
        loss_encoder, var_list=encoder.trainable_weights)
  return tf.estimator.EstimatorSpec(mode, loss=loss_head, train_op=tf.group(op1, op2))


@pytest.mark.parametrize('num_devices', [2, 3])
def test_two_optimizers_with_slots_over_three_steps(num_devices):
  plain, towered = _train_pair(_two_optimizers_model_fn, num_devices, 21, epochs=3, steps=3)
  assert any(name.endswith('/Momentum') for name in plain)  # slots are checkpointed
  assert plain['global_step'] == 3
  testlib.assert_variables_close(towered, plain)


def _controlled_gradients_model_fn(features, labels, mode, params):
  """Gradients asked for inside a control_dependencies block, applied outside it."""
  logits = tf.compat.v1.layers.dense(
      features, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=11))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  counter = tf.compat.v1.get_variable('counter', [], initializer=tf.zeros_initializer(),
                                      trainable=False)
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.5)
  with tf.control_dependencies([counter.assign_add(1.0)]):
    grads_and_vars = optimizer.compute_gradients(loss)
  train_op = optimizer.apply_gradients(grads_and_vars, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices', [2, 3])
def test_gradients_keep_the_control_dependencies_they_were_asked_in(num_devices):
  """The whole-batch gradients are built without the block's control inputs,
  which are put back on the gradients handed over: the counter still counts."""
  plain, towered = _train_pair(_controlled_gradients_model_fn, num_devices, 14, epochs=2,
                               steps=3)
  assert plain['counter'] == 3
  testlib.assert_variables_close(towered, plain)


def _sum_loss_model_fn(features, labels, mode, params):
  logits = tf.compat.v1.layers.dense(
      features, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
  loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.05).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_sum_reduced_loss():
  plain, towered = _train_pair(_sum_loss_model_fn, 3, 7, loss_reduction='sum')
  testlib.assert_variables_close(towered, plain)
  # The mean weighting would be wrong for a sum-reduced loss: the test can fail.
  _, wrong = _train_pair(_sum_loss_model_fn, 3, 7, loss_reduction='mean')
  assert not np.allclose(wrong['dense/kernel'], plain['dense/kernel'], atol=1e-5)


def _v1_batch_norm_model_fn(features, labels, mode, params):
  """tf.compat.v1.layers.batch_normalization with the usual UPDATE_OPS pattern."""
  training = mode == ModeKeys.TRAIN
  normed = tf.compat.v1.layers.batch_normalization(features, momentum=0.5, training=training)
  logits = tf.compat.v1.layers.dense(
      normed, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=8))
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.0).minimize(
        loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@functools.lru_cache(maxsize=None)
def _plain_batch_norm_step(batch, shard0):
  """The plain batch-norm model_fn's variables after one step on the first `shard0` of
  testlib.data(batch) (shared by the layouts whose tower 0 gets the same rows)."""
  x, y = testlib.data(batch)
  plain = testlib.make_estimator(_v1_batch_norm_model_fn)
  plain.train(testlib.input_fn(x[:shard0], y[:shard0], shard0), steps=1)
  return testlib.variables(plain)


@pytest.mark.parametrize('num_devices,batch', [(3, 7), (3, 2), (4, 2)])
def test_update_ops_run_once_per_step_from_tower_zero(num_devices, batch):
  """Moving statistics equal a plain step on tower 0's shard alone: updated once,
  not once per tower, and never NaN from an empty shard."""
  x, y = testlib.data(batch)
  shard0 = -(-batch // num_devices)
  towered = testlib.make_estimator(
      replicate_model_fn(_v1_batch_norm_model_fn, devices=testlib.cpu_devices(num_devices),
                         sync_batch_norm=False),  # per-tower statistics: tower 0's shard's
      num_cpus=num_devices)
  towered.train(testlib.input_fn(x, y, batch), steps=1)
  expected = _plain_batch_norm_step(batch, shard0)
  actual = testlib.variables(towered)
  assert not any(np.isnan(v).any() for v in actual.values())
  testlib.assert_variables_close(actual, expected)


def test_only_tower_zero_builds_batch_norm_updates():
  """The other towers' Keras batch-norm updates, dropped anyway, are not built
  (they were a tenth of a ResNet tower's build time); tower 0's are (the test
  above: the moving statistics equal plain's)."""
  x, y = testlib.data(6)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    towered = replicate_model_fn(_v1_batch_norm_model_fn, devices=testlib.cpu_devices(3))
    towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, {})
  updates = [op.name for op in graph.get_operations() if op.type == 'AssignSubVariableOp'
             and 'AssignMovingAvg' in op.name]
  assert len(updates) == 2 and not any(name.startswith('tower_') for name in updates), updates


def test_batch_norm_updates_are_skipped_only_in_the_thread_building_later_towers():
  """The skip is the building thread's: a batch norm another thread builds meanwhile keeps
  its moving-average updates (Keras' add_update is patched for the process, so the
  patch asks which thread calls)."""

  def updates_of_a_batch_norm():
    with tf.Graph().as_default() as graph:
      tf.compat.v1.layers.batch_normalization(
          tf.compat.v1.placeholder(tf.float32, [None, 3]), training=True)
      return len(graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))

  assert updates_of_a_batch_norm() == 2  # Keras' batch norm imported: the patch applies
  entered, release, inside = threading.Event(), threading.Event(), []

  def building_later_towers():
    with interception.batch_norm_updates_skipped():
      inside.append(updates_of_a_batch_norm())
      entered.set()
      release.wait(30)

  thread = threading.Thread(target=building_later_towers)
  thread.start()
  try:
    assert entered.wait(30)
    meanwhile = updates_of_a_batch_norm()
  finally:
    release.set()
    thread.join(30)
  assert (inside, meanwhile, updates_of_a_batch_norm()) == ([0], 2, 2)


# --- Features -------------------------------------------------------------------

def _sparse_input_fn(batch, num_examples, seed=0):
  """Batches whose 'ids' feature is a SparseTensor with 0 to 3 ids per example."""
  rng = np.random.RandomState(seed)
  ids = np.full([num_examples, 4], -1, np.int64)
  for i in range(num_examples):
    chosen = np.sort(rng.choice(20, size=rng.randint(0, 4), replace=False))
    ids[i, :len(chosen)] = chosen
  labels = rng.randint(0, testlib.NUM_CLASSES, size=num_examples).astype(np.int32)
  dense_x = testlib.data(num_examples, seed=seed + 1)[0]

  def to_sparse(features, label):
    dense = features['ids']
    where = tf.where(dense >= 0)
    sparse = tf.SparseTensor(where, tf.gather_nd(dense, where),
                             tf.shape(dense, out_type=tf.int64))
    return {'ids': sparse, 'x': features['x']}, label

  def fn():
    ds = tf.data.Dataset.from_tensor_slices(({'ids': ids, 'x': dense_x}, labels))
    return ds.batch(batch).map(to_sparse)
  return fn


def _sparse_model_fn(features, labels, mode, params):
  embeddings = tf.compat.v1.get_variable(
      'embeddings', [20, 3], initializer=tf.compat.v1.random_normal_initializer(seed=9))
  pooled = tf.nn.safe_embedding_lookup_sparse(embeddings, features['ids'], combiner='sum')
  inputs = tf.concat([pooled, features['x']], 1)
  logits = tf.compat.v1.layers.dense(
      inputs, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=10))
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'accuracy': tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))})
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('num_devices,batch', [(3, 7), (3, 2)])
def test_sparse_features(num_devices, batch):
  fn = _sparse_input_fn(batch, num_examples=2 * batch)
  plain = testlib.make_estimator(_sparse_model_fn)
  plain.train(fn, steps=2)
  towered = testlib.make_estimator(
      replicate_model_fn(_sparse_model_fn, devices=testlib.cpu_devices(num_devices)),
      num_cpus=num_devices)
  towered.train(fn, steps=2)
  testlib.assert_variables_close(testlib.variables(towered), testlib.variables(plain))
  testlib.assert_close(testlib.predictions(towered, fn), testlib.predictions(plain, fn),
                       err_msg='logits')
  testlib.assert_close(towered.evaluate(fn)['accuracy'], plain.evaluate(fn)['accuracy'],
                       err_msg='accuracy')


# --- Checkpoints and export ------------------------------------------------------

def test_checkpoints_move_between_plain_and_any_device_count():
  """Plain -> 3 towers -> 2 towers -> plain on one model_dir equals plain throughout.

  Every batch is the same 7 examples: a towered call resuming a towered checkpoint reads
  the input where it left off, the plain calls read it from the first element, and what
  is checked here is the variables' move between device counts."""
  x, y = testlib.data(7)
  fn = testlib.input_fn(x, y, 7, epochs=4)
  sequence = [None, 3, 2, None]  # None: the plain model_fn
  plain_dir = testlib.make_estimator(testlib.v1_model_fn).model_dir
  mixed_dir = testlib.make_estimator(testlib.v1_model_fn).model_dir
  for num_devices in sequence:
    testlib.make_estimator(testlib.v1_model_fn, model_dir=plain_dir).train(fn, steps=1)
    model_fn = (testlib.v1_model_fn if num_devices is None else replicate_model_fn(
        testlib.v1_model_fn, devices=testlib.cpu_devices(num_devices)))
    testlib.make_estimator(model_fn, num_cpus=num_devices or 1, model_dir=mixed_dir).train(
        fn, steps=1)
  plain = testlib.variables(testlib.make_estimator(testlib.v1_model_fn, model_dir=plain_dir))
  mixed = testlib.variables(testlib.make_estimator(testlib.v1_model_fn, model_dir=mixed_dir))
  assert plain['global_step'] == len(sequence)
  testlib.assert_variables_close(mixed, plain)


def test_exported_saved_model_serves_on_one_cpu():
  x, y = testlib.data(7)
  fn = testlib.input_fn(x, y, 7)
  towered = testlib.make_estimator(
      replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(3)), num_cpus=3)
  towered.train(fn, steps=1)
  plain_predictions = testlib.predictions(testlib.make_estimator(
      testlib.v1_model_fn, model_dir=towered.model_dir), fn)

  def receiver():
    x_in = tf.compat.v1.placeholder(tf.float32, [None, testlib.NUM_FEATURES], name='x')
    return tf.estimator.export.ServingInputReceiver({'x': x_in}, {'x': x_in})
  export_dir = towered.export_saved_model(os.path.join(towered.model_dir, 'export'), receiver)

  with tf.Graph().as_default():
    with tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
        device_count={'CPU': 1, 'GPU': 0})) as session:
      meta = tf.compat.v1.saved_model.load(session, ['serve'], export_dir)
      signature = meta.signature_def['serving_default']
      served = session.run(signature.outputs['logits'].name,
                           {signature.inputs['x'].name: x})
      devices = {n.device for n in meta.graph_def.node}
  assert devices <= {'', '/device:CPU:0', '/device:CPU:*'}  # no tower device pins
  testlib.assert_close(served, plain_predictions, err_msg='served')


def test_static_batch_shapes():
  """A static batch (drop_remainder) takes the static split path; 2 over 3 builds 2 towers."""
  x, y = testlib.data(4)
  fn = testlib.input_fn(x, y, 2, static_batch=True)
  plain = testlib.make_estimator(testlib.v1_model_fn)
  plain.train(fn, steps=2)
  towered = testlib.make_estimator(
      replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(3)), num_cpus=3)
  towered.train(fn, steps=2)
  testlib.assert_variables_close(testlib.variables(towered), testlib.variables(plain))
  testlib.assert_close(testlib.predictions(towered, fn), testlib.predictions(plain, fn),
                       err_msg='logits')


def test_train_and_evaluate():
  x, y = testlib.data(14)
  fn = testlib.input_fn(x, y, 7, epochs=2)
  towered = testlib.make_estimator(
      replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(2)), num_cpus=2,
      save_checkpoints_steps=2)
  metrics, _ = tf.estimator.train_and_evaluate(
      towered, tf.estimator.TrainSpec(fn, max_steps=2),
      tf.estimator.EvalSpec(testlib.input_fn(x, y, 7), steps=None, throttle_secs=0))
  plain = testlib.make_estimator(testlib.v1_model_fn, model_dir=towered.model_dir)
  expected = plain.evaluate(testlib.input_fn(x, y, 7), name='plain')
  assert metrics['global_step'] == 2
  for key in ('accuracy', 'loss', 'auc', 'mean_logit'):
    testlib.assert_close(metrics[key], expected[key], err_msg=key)


def test_summaries_come_from_tower_zero_and_placement_is_logged(caplog):
  def model_fn(features, labels, mode):
    spec = testlib.v1_model_fn(features, labels, mode, None)
    tf.compat.v1.summary.scalar('my_loss', spec.loss)
    return spec

  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(3))
  x, y = testlib.data(7)
  with caplog.at_level('INFO'), tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, None)
    towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, None)
    summaries = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SUMMARIES)
  names = [s.op.name for s in summaries if not s.op.name.startswith('towers/')]
  assert len(names) == 2 and not any('/' in n for n in names), names  # one per build, tower 0's
  placement_lines = [r.getMessage() for r in caplog.records
                     if r.getMessage().startswith('estimator_towers: train graph:')]
  assert placement_lines == [  # Once per graph.
      'estimator_towers: train graph: 3 tower(s) on /device:CPU:0, /device:CPU:1, /device:CPU:2; '
      'variables on /device:CPU:0 (variable_strategy=cpu, chosen for towers on CPU devices: '
      'the host adds their gradients, loss_reduction=auto).']


def _sequential_model_fn(features, labels, mode, params):
  """A tf.keras.Sequential model built inside the model_fn, Keras legacy Adam."""
  model = tf.keras.Sequential([
      tf.keras.layers.Dense(6, activation='relu',
                            kernel_initializer=tf.keras.initializers.GlorotUniform(seed=11)),
      tf.keras.layers.Dense(testlib.NUM_CLASSES,
                            kernel_initializer=tf.keras.initializers.GlorotUniform(seed=12)),
  ])
  logits = model(features, training=mode == ModeKeys.TRAIN)
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True))
  optimizer = tf.keras.optimizers.legacy.Adam(0.05)
  step = tf.compat.v1.train.get_global_step()
  train_op = tf.group(optimizer.get_updates(loss, model.trainable_weights),
                      step.assign_add(1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_keras_sequential_with_adam_over_three_steps():
  plain, towered = _train_pair(_sequential_model_fn, 3, 21, steps=3)
  assert plain['global_step'] == 3
  assert any('Adam' in name or '/m' in name for name in plain), sorted(plain)
  testlib.assert_variables_close(towered, plain)


def test_tensor_predictions_and_scalar_train_predictions():
  """predictions may be a single Tensor; a scalar in TRAIN is taken from tower 0."""
  def model_fn(features, labels, mode):
    spec = testlib.v1_model_fn(features, labels, mode, None)
    if mode == ModeKeys.PREDICT:
      return spec._replace(predictions=spec.predictions['logits'], export_outputs=None)
    return spec._replace(predictions={'scalar': tf.constant(3.0),
                                      'per_example': tf.reduce_sum(features, 1)})

  def unknown_rank_model_fn(features, labels, mode):
    spec = testlib.v1_model_fn(features, labels, mode, None)
    if mode != ModeKeys.PREDICT:
      return spec
    unknown = tf.compat.v1.placeholder_with_default(spec.predictions['logits'], shape=None)
    return spec._replace(predictions={'unknown_rank': unknown}, export_outputs=None)

  x, y = testlib.data(7)
  fn = testlib.input_fn(x, y, 7)
  towered = testlib.make_estimator(
      replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)), num_cpus=3)
  towered.train(fn, steps=1)
  plain = testlib.make_estimator(model_fn, model_dir=towered.model_dir)
  testlib.assert_close(np.stack(list(towered.predict(fn))), np.stack(list(plain.predict(fn))),
                       err_msg='predictions')
  # A prediction of unknown rank is per-example: every tower's rows come back.
  towered_unknown = testlib.make_estimator(
      replicate_model_fn(unknown_rank_model_fn, devices=testlib.cpu_devices(3)),
      num_cpus=3, model_dir=towered.model_dir)
  plain_unknown = testlib.make_estimator(unknown_rank_model_fn, model_dir=towered.model_dir)
  testlib.assert_close(testlib.predictions(towered_unknown, fn, 'unknown_rank'),
                       testlib.predictions(plain_unknown, fn, 'unknown_rank'),
                       err_msg='unknown_rank')
