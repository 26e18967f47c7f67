"""micro_batches=k: each device's shard in k parts, one after another, one update per batch.

The reference is the plain model_fn on one device, trained by a plain Estimator
on the same global batches. Layouts: one device with 4 micro-batches, and 3
devices with 2 each, on batches of 7 examples (which divides by neither N*k:
micro-batches 2/2/2/1 and 2+1/1+1/1+1) and of 3 (smaller than N*k), with the
batch size known only at run time (the common case) or statically.
"""

import functools
import re

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import make_plan
from estimator_towers import replicate_model_fn
from estimator_towers import staged_input_fn
from estimator_towers.inputs import micro_batches as micro_batches_lib

V1 = tf.compat.v1.train
ModeKeys = tf.estimator.ModeKeys

LAYOUTS = [(1, 4), (3, 2)]  # (devices, micro_batches)
NORM_COLLECTION = 'test_micro_batches_global_norm'
CLIP_NORM = 0.05


def _minimize(optimizer, loss):
  return optimizer.minimize(loss, V1.get_global_step())


def _clipped(loss):
  """compute_gradients -> clip_by_global_norm -> apply_gradients (Momentum)."""
  optimizer = V1.MomentumOptimizer(0.3, 0.9)
  grads, tvars = zip(*optimizer.compute_gradients(loss))
  clipped, norm = tf.clip_by_global_norm(grads, CLIP_NORM)
  tf.compat.v1.add_to_collection(NORM_COLLECTION, norm)
  return optimizer.apply_gradients(zip(clipped, tvars), V1.get_global_step())


OPTIMIZERS = {
    'Momentum': lambda loss: _minimize(V1.MomentumOptimizer(0.3, 0.9), loss),
    'Adam': lambda loss: _minimize(V1.AdamOptimizer(0.05), loss),
    'clip_by_global_norm': _clipped,
    'MixedPrecisionLossScale(dynamic)': lambda loss: _minimize(
        V1.experimental.MixedPrecisionLossScaleOptimizer(V1.GradientDescentOptimizer(0.5),
                                                         'dynamic'), loss),
}


def model_fn_with(name):
  def model_fn(features, labels, mode):
    hidden = tf.compat.v1.layers.dense(
        features, 6, activation=tf.nn.tanh,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
    logits = tf.compat.v1.layers.dense(
        hidden, testlib.NUM_CLASSES,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2),
        bias_initializer=tf.compat.v1.random_normal_initializer(seed=3))
    if mode == ModeKeys.PREDICT:
      return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    if mode == ModeKeys.EVAL:
      return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
          'mean_logit': tf.compat.v1.metrics.mean(logits)})
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=OPTIMIZERS[name](loss))
  return model_fn


def assert_close(actual: dict, expected: dict) -> None:
  """The tolerance rule: |d| / max(1, |plain|) <= 1e-5, for every variable and slot."""
  assert sorted(actual) == sorted(expected)
  for name, plain in expected.items():
    plain = np.asarray(plain, np.float64)
    error = np.abs(np.asarray(actual[name], np.float64) - plain) / np.maximum(1, np.abs(plain))
    assert error.max(initial=0) <= 1e-5, (name, actual[name], plain)


def train_1_and_3(model_fn, fn, num_cpus=1):
  """Variables after steps 1 and 3 of one train(steps=3) call."""
  return testlib.train_and_read(testlib.stepwise_estimator(model_fn, num_cpus=num_cpus), fn)


def _input_fn(batch, static=False):
  x, y = testlib.data(batch)
  return testlib.input_fn(x, y, batch, static_batch=static, epochs=3)


@functools.lru_cache(maxsize=None)
def plain_reference(name, batch, static=False):
  """The plain model_fn's variables after 1 and 3 steps (shared by the layouts)."""
  return train_1_and_3(model_fn_with(name), _input_fn(batch, static))


def check_like_plain(name, num_devices, k, batch, static=False, variable_strategy='cpu'):
  fn = _input_fn(batch, static)
  model_fn = model_fn_with(name)
  plain = plain_reference(name, batch, static)
  towered = train_1_and_3(
      replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices), micro_batches=k,
                         variable_strategy=variable_strategy),
      fn, num_cpus=num_devices)
  for steps, mine, theirs in zip((1, 3), towered, plain):
    assert theirs['global_step'] == steps and mine['global_step'] == steps
    assert_close(mine, theirs)
  return plain


def initial_global_norm(batch):
  """The unclipped global gradient norm of the plain clipped model_fn's first step."""
  x, y = testlib.data(batch)
  with tf.Graph().as_default():
    V1.create_global_step()
    model_fn_with('clip_by_global_norm')(tf.constant(x), tf.constant(y), ModeKeys.TRAIN)
    (norm,) = tf.compat.v1.get_collection(NORM_COLLECTION)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return float(session.run(norm))


@pytest.mark.core_equivalence
@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
@pytest.mark.parametrize('num_devices, k', LAYOUTS)
def test_trains_like_plain(num_devices, k, name, batch=7):
  """Batch 7: uneven micro-batches on both layouts (a batch of 10, 3/3/2/2 and 2+2/2+1/2+1,
  is uneven the same way and proved nothing more)."""
  if name == 'clip_by_global_norm':
    assert initial_global_norm(batch) > 2 * CLIP_NORM  # the clipping is active
  plain = check_like_plain(name, num_devices, k, batch)
  slots = {'Momentum': '/Momentum', 'Adam': '/Adam', 'clip_by_global_norm': '/Momentum',
           'MixedPrecisionLossScale(dynamic)': 'loss_scale'}
  assert any(slots[name] in n for n in plain[1])  # the optimizer's state is compared


@pytest.mark.parametrize('batch, static', [(3, False), (3, True), (2, False)])
@pytest.mark.parametrize('num_devices, k', LAYOUTS)
def test_batch_smaller_than_devices_times_micro_batches(num_devices, k, batch, static):
  check_like_plain('Adam', num_devices, k, batch=batch, static=static)


def test_num_gpus_zero_the_cpu_alone():
  plain = plain_reference('Momentum', 7)
  towered = train_1_and_3(
      replicate_model_fn(model_fn_with('Momentum'), num_gpus=0, micro_batches=3), _input_fn(7))
  for mine, theirs in zip(towered, plain):
    assert_close(mine, theirs)


@pytest.mark.parametrize('strategy', ['gpu', 'replicated'])
def test_variable_strategies(strategy):
  """Placement is per device: 'replicated' makes one copy per device, not per shard."""
  check_like_plain('Momentum', 3, 2, batch=7, variable_strategy=strategy)


def test_one_copy_per_device_when_replicated():
  model_fn = replicate_model_fn(model_fn_with('Momentum'), devices=testlib.cpu_devices(2),
                                micro_batches=3, variable_strategy='replicated')
  x, y = testlib.data(7)
  with tf.Graph().as_default():
    V1.create_global_step()
    model_fn(tf.constant(x), tf.constant(y), ModeKeys.TRAIN)
    replicas = [v.op.name for v in tf.compat.v1.local_variables() if 'replica' in v.op.name]
  assert sorted(replicas) == ['dense/bias/replica_1', 'dense/kernel/replica_1',
                              'dense_1/bias/replica_1', 'dense_1/kernel/replica_1']


def _evaluate_input_fn():
  x, y = testlib.data(7)
  return testlib.input_fn(x, y, 7)


@functools.lru_cache(maxsize=None)
def plain_evaluated():
  """(model_dir, metrics, predictions) of the plain model_fn trained one step: the checkpoint
  the layouts evaluate and predict from, and plain's results on it (shared by the layouts)."""
  fn = _evaluate_input_fn()
  plain = testlib.make_estimator(model_fn_with('Momentum'))
  plain.train(fn, steps=1)
  return plain.model_dir, plain.evaluate(fn), testlib.predictions(plain, fn)


@pytest.mark.core_equivalence
@pytest.mark.parametrize('num_devices, k', [(1, 3), (2, 2)])
def test_evaluate_and_predict_like_plain(num_devices, k):
  fn = _evaluate_input_fn()
  model_dir, theirs, plain_predictions = plain_evaluated()
  towered = testlib.make_estimator(
      replicate_model_fn(model_fn_with('Momentum'), devices=testlib.cpu_devices(num_devices),
                         micro_batches=k),
      num_cpus=num_devices, model_dir=model_dir)
  mine = towered.evaluate(fn, name=f'{num_devices}x{k}')
  for key in ('loss', 'mean_logit'):
    assert abs(mine[key] - theirs[key]) <= 1e-5 * max(1, abs(theirs[key])), key
  np.testing.assert_allclose(testlib.predictions(towered, fn), plain_predictions,
                             atol=1e-5, rtol=0)


def _staged_case_input_fn(examples, epochs):
  x, y = testlib.data(examples)
  return testlib.input_fn(x, y, 7, epochs=epochs)


@functools.lru_cache(maxsize=None)
def plain_staged_case(examples, epochs, steps):
  """The plain Adam model_fn's variables after `steps` steps, unstaged (shared by the
  layouts)."""
  plain = testlib.make_estimator(model_fn_with('Adam'))
  plain.train(_staged_case_input_fn(examples, epochs), steps=steps)
  return testlib.variables(plain)


@pytest.mark.parametrize('examples, epochs, steps', [
    (10, 3, 5),  # batches of 7, 7, 7, 7, 2
    (8, 1, 2),   # batches of 7, 1: the second device's shard is empty at run time
])
@pytest.mark.parametrize('num_devices, k', [(1, 3), (2, 2)])
def test_staged_input(num_devices, k, examples, epochs, steps):
  fn = _staged_case_input_fn(examples, epochs)
  plan = make_plan(devices=testlib.cpu_devices(num_devices), micro_batches=k, staging_depth=2)
  towered = testlib.make_estimator(replicate_model_fn(model_fn_with('Adam'), plan=plan),
                                   num_cpus=num_devices)
  towered.train(staged_input_fn(fn, plan), steps=steps)
  expected = plain_staged_case(examples, epochs, steps)
  assert expected['global_step'] == steps
  assert_close(testlib.variables(towered), expected)


def batch_norm_model_fn(features, labels, mode):
  """tf.compat.v1.layers.batch_normalization with the usual UPDATE_OPS pattern; lr 0."""
  normed = tf.compat.v1.layers.batch_normalization(features, momentum=0.5,
                                                   training=mode == ModeKeys.TRAIN)
  logits = tf.compat.v1.layers.dense(
      normed, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=8))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = _minimize(V1.GradientDescentOptimizer(0.0), loss)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@functools.lru_cache(maxsize=None)
def plain_batch_norm_step(batch, primary):
  """The plain batch-norm model_fn's variables after one step on the first `primary` rows of
  testlib.data(batch) (shared by the layouts whose primary micro-batch holds the same rows)."""
  x, y = testlib.data(batch)
  plain = testlib.make_estimator(batch_norm_model_fn)
  plain.train(testlib.input_fn(x[:primary], y[:primary], primary), steps=1)
  return testlib.variables(plain)


@pytest.mark.parametrize('batch', [7, 3])
@pytest.mark.parametrize('num_devices, k', LAYOUTS)
def test_batch_norm_moving_averages_from_the_primary_micro_batch(num_devices, k, batch):
  """Moving statistics equal a plain step on micro-batch 0 of device 0 alone:
  updated once per step, not once per micro-batch, and never NaN."""
  x, y = testlib.data(batch)
  primary = -(-(-(-batch // num_devices)) // k)  # ceil(ceil(B / N) / k)
  towered = testlib.make_estimator(
      replicate_model_fn(batch_norm_model_fn, devices=testlib.cpu_devices(num_devices),
                         micro_batches=k, sync_batch_norm=False), num_cpus=num_devices)
  towered.train(testlib.input_fn(x, y, batch), steps=1)
  actual = testlib.variables(towered)
  assert not any(np.isnan(v).any() for v in actual.values())
  assert_close(actual, plain_batch_norm_step(batch, primary))


# --- Micro-batches of one device run one after another ---------------------------

class StepTrace(tf.compat.v1.train.SessionRunHook):
  """Records the step stats (RunMetadata, FULL_TRACE) of every step."""

  def __init__(self):
    self.node_stats = []

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(None, options=tf.compat.v1.RunOptions(
        trace_level=tf.compat.v1.RunOptions.FULL_TRACE))

  def after_run(self, run_context, run_values):
    self.node_stats.append([node for device in run_values.run_metadata.step_stats.dev_stats
                            for node in device.node_stats])


def _shard(scope):
  """s for a scope 'tower_<s>', 0 (the primary's plain names) otherwise."""
  match = re.fullmatch(r'tower_(\d+)', scope)
  return int(match.group(1)) if match else 0


def _shard_of_forward(name):
  """The shard whose forward pass a node belongs to (tower_<s>/..., or 0), else None."""
  return None if name.startswith('gradients') else _shard(name.split('/')[0])


def _shard_of_backward(name):
  """The shard whose backward pass a node belongs to (gradients*/[tower_<s>/]...)."""
  parts = name.split('/')
  if not parts[0].startswith('gradients') or len(parts) < 2:
    return None
  return _shard(parts[1])


def _op_type(node):
  """The op type in a node's timeline label ('name = Type(inputs)'; fused ops included)."""
  label = node.timeline_label.split(' = ', 1)
  return label[1].split('(', 1)[0] if len(label) == 2 else ''


def overlaps(node_stats, k):
  """(j, first forward start of j+1, last backward end of j) where j+1 starts too early.

  Forward ops: the MatMuls of the dense layers, fused or not (they read the
  micro-batch's inputs or activations). Backward ops: every op of the micro-batch's gradient.
  """
  starts, ends = {}, {}
  for node in node_stats:
    name = node.node_name
    start, end = node.all_start_micros, node.all_start_micros + node.all_end_rel_micros
    forward, backward = _shard_of_forward(name), _shard_of_backward(name)
    if forward is not None and 'MatMul' in _op_type(node):
      starts[forward] = min(starts.get(forward, start), start)
    if backward is not None:
      ends[backward] = max(ends.get(backward, end), end)
  assert sorted(starts) == list(range(k)) and sorted(ends) == list(range(k)), (starts, ends)
  return [(j, starts[j + 1], ends[j]) for j in range(k - 1) if starts[j + 1] < ends[j]]


def wide_model_fn(features, labels, mode):
  hidden = tf.compat.v1.layers.dense(
      features, 256, activation=tf.nn.relu,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  logits = tf.compat.v1.layers.dense(
      hidden, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(
      V1.GradientDescentOptimizer(0.1), loss))


def traced_steps(k, steps=3):
  x, y = testlib.data(512)
  est = testlib.make_estimator(
      replicate_model_fn(wide_model_fn, devices=['/cpu:0'], micro_batches=k))
  trace = StepTrace()
  est.train(testlib.input_fn(x, y, 512, epochs=steps), steps=steps, hooks=[trace])
  return trace.node_stats


def test_micro_batches_of_a_device_do_not_overlap():
  for node_stats in traced_steps(k=4):
    assert not overlaps(node_stats, 4)


def test_the_overlap_check_fails_without_the_ordering(monkeypatch):
  monkeypatch.setattr(micro_batches_lib, 'order_after', lambda gates, done: None)
  assert any(overlaps(node_stats, 4) for node_stats in traced_steps(k=4))



# --- Every branch of a micro-batch waits for the previous one's backward pass -----
#
# A model with two branches (query and doc encoders) and an op that reads none
# of the micro-batch's inputs (a learned offset tiled to the batch's static
# size): every op of micro-batch j+1's forward pass must wait (by data or
# control edges) for micro-batch j's backward pass and its addition to the
# device's gradient sums, or the executor may run it early and hold its
# activations at the same time as micro-batch j's.

STRUCTURES = ['dict features, Tensor labels', 'dict features, no labels',
              'Tensor features, dict labels']
QUERY, DOC, TWO_BRANCH_BATCH = 3, 5, 10


def two_branch_model_fn(features, labels, mode):
  init = tf.compat.v1.glorot_uniform_initializer

  def encoder(x, name, seed):
    with tf.compat.v1.variable_scope(name):
      hidden = tf.compat.v1.layers.dense(x, 8, activation=tf.nn.tanh,
                                         kernel_initializer=init(seed=seed))
      return tf.compat.v1.layers.dense(hidden, 4, kernel_initializer=init(seed=seed + 1))

  if isinstance(features, dict):
    query, doc = features['query'], features['doc']
  else:
    query, doc = features[:, :QUERY], features[:, QUERY:]
  offset = tf.compat.v1.get_variable(
      'offset', [1, 4], initializer=tf.compat.v1.random_normal_initializer(seed=5))
  doc_embedding = encoder(doc, 'doc', 3) + tf.tile(offset, [doc.shape[0], 1])  # static rows
  score = tf.reduce_sum(encoder(query, 'query', 1) * doc_embedding, -1)
  target = 0.0 if labels is None else labels['y'] if isinstance(labels, dict) else labels
  loss = tf.reduce_mean(tf.square(score - target))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(
      V1.MomentumOptimizer(0.1, 0.9), loss))


def two_branch_batch(structure, rows):
  """(features, labels) of `structure`, `rows` examples, as numpy arrays."""
  rng = np.random.RandomState(0)
  query, doc = rng.randn(rows, QUERY), rng.randn(rows, DOC)
  y = rng.randn(rows).astype(np.float32)
  features = ({'query': query.astype(np.float32), 'doc': doc.astype(np.float32)}
              if structure.startswith('dict') else np.hstack([query, doc]).astype(np.float32))
  labels = None if 'no labels' in structure else {'y': y} if 'dict labels' in structure else y
  return features, labels


def two_branch_input_fn(structure):
  def fn():
    data = two_branch_batch(structure, 3 * TWO_BRANCH_BATCH)
    ds = tf.data.Dataset.from_tensor_slices(data if data[1] is not None else data[0])
    return ds.batch(TWO_BRANCH_BATCH, drop_remainder=True)  # static: the Tile's rows
  return fn


def _graph_neighbours(graph):
  """(inputs, consumers) of every op: data and control edges."""
  inputs = {op: {t.op for t in op.inputs} | set(op.control_inputs)
            for op in graph.get_operations()}
  consumers = {op: set() for op in inputs}
  for op, found in inputs.items():
    for other in found:
      consumers[other].add(op)
  return inputs, consumers


def _closure(start, edges):
  seen, pending = set(), list(start)
  while pending:
    op = pending.pop()
    if op not in seen:
      seen.add(op)
      pending.extend(edges[op])
  return seen


def unordered_ops(structure, k):
  """Per j >= 1: (ops of micro-batch j's backward pass and gradient sums that some op of
  micro-batch j+1's forward pass does not wait for, that op), or None; on one device."""
  features, labels = two_branch_batch(structure, TWO_BRANCH_BATCH)
  graph = tf.Graph()
  with graph.as_default():
    V1.create_global_step()
    spec = replicate_model_fn(two_branch_model_fn, devices=['/cpu:0'], micro_batches=k)(
        tf.nest.map_structure(tf.constant, features),
        None if labels is None else tf.nest.map_structure(tf.constant, labels),
        ModeKeys.TRAIN, config=tf.estimator.RunConfig())
  inputs, consumers = _graph_neighbours(graph)
  update = _closure([spec.train_op], inputs)
  computing = lambda op: op.type not in ('Const', 'NoOp', 'VarHandleOp')
  forward = [{op for op in graph.get_operations() if op.name.startswith(f'tower_{j}/')
              and computing(op)} for j in range(k)]
  found = []
  for j in range(1, k - 1):
    backward = (_closure(forward[j], consumers) & update) - _closure(forward[j + 1], consumers)
    backward -= forward[j] | {op for op in backward if op.name.startswith('micro_batch_gates/')}
    assert any(op.type == 'AddN' for op in backward)  # the sums of micro-batches 0..j
    for op in sorted(forward[j + 1], key=lambda op: op.name):
      missing = backward - _closure([op], inputs)
      if missing:
        found.append((j, op.name, sorted(m.name for m in missing)[:3]))
        break
  return found


@pytest.mark.parametrize('structure', STRUCTURES)
def test_every_branch_waits_for_the_previous_backward_pass_and_sums(structure):
  assert unordered_ops(structure, 4) == []


@functools.lru_cache(maxsize=None)
def two_branch_plain(structure):
  """The plain two-branch model_fn after steps 1 and 3 (shared by the layouts)."""
  return train_1_and_3(two_branch_model_fn, two_branch_input_fn(structure))


@pytest.mark.parametrize('structure', STRUCTURES)
@pytest.mark.parametrize('num_devices, k', LAYOUTS)
def test_two_branches_train_like_plain(structure, num_devices, k):
  fn = two_branch_input_fn(structure)
  plain = two_branch_plain(structure)
  towered = train_1_and_3(replicate_model_fn(
      two_branch_model_fn, devices=testlib.cpu_devices(num_devices), micro_batches=k),
      fn, num_cpus=num_devices)
  for steps, mine, theirs in zip((1, 3), towered, plain):
    assert theirs['global_step'] == steps and mine['global_step'] == steps
    assert_close(mine, theirs)
