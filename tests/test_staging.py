"""staged_input_fn: per-device shards prefetched with StagingArea.

Every example of a finite dataset must be consumed exactly once, in every mode,
whatever the staging depth and device count. The counting model has one
variable `counts` (one entry per example id) and the sum-reduced loss
-sum(counts * one_hot(id)): one SGD step with learning rate 1 adds 1 to the
count of every id in the batch, whichever tower it lands on, so after training
`counts` is the number of times each id was trained on. Evaluation counts ids
in a metric, prediction returns them. References are plain numbers (each id
once, in order) or the plain single-device model_fn on the same data.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import make_plan
from estimator_towers import replicate_model_fn
from estimator_towers import staged_input_fn
from estimator_towers.inputs import staging

NUM_IDS = 23
BATCH = 5  # Divides neither 23 nor any device count 2..4; the last batch (3) is smaller than 4.
TIMEOUT = dict(timeout=120, method='thread')  # A hang in session.run must still fail.


def counting_model_fn(features, labels, mode):
  del labels
  ids = features['id']
  one_hot = tf.one_hot(ids, NUM_IDS)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'id': ids})
  counts = tf.compat.v1.get_variable('counts', [NUM_IDS],
                                     initializer=tf.compat.v1.zeros_initializer())
  loss = -tf.reduce_sum(counts * one_hot)
  if mode == tf.estimator.ModeKeys.EVAL:
    seen = tf.compat.v1.get_variable(
        'seen', [NUM_IDS], initializer=tf.compat.v1.zeros_initializer(), trainable=False,
        collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                     tf.compat.v1.GraphKeys.METRIC_VARIABLES])
    update = tf.compat.v1.assign_add(seen, tf.reduce_sum(one_hot, 0))
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, eval_metric_ops={'seen': (tf.convert_to_tensor(seen), update)})
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(1.0)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def ids_input_fn(num_ids=NUM_IDS, batch=BATCH, drop_remainder=False):
  def fn():
    ids = np.arange(num_ids, dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices(
        ({'id': ids}, np.zeros(num_ids, np.float32))).batch(batch, drop_remainder)
  return fn


GET_OPS = ('Unstage',)  # Per-device reads.


def split_in_flight(ops):
  """(the towers' staging ops, the host's): in TRAIN the host mirrors the staged global
  batches in an area of its own (`staging._InFlight`), which the checkpoint saves."""
  def is_in_flight(op):
    node = op if isinstance(op, tf.compat.v1.NodeDef) else op.node_def
    return b'in_flight' in node.attr['shared_name'].s
  return ([op for op in ops if not is_in_flight(op)], [op for op in ops if is_in_flight(op)])


class GraphProbe(tf.compat.v1.train.SessionRunHook):
  """Records the devices of the staged per-device reads of its graph."""

  def begin(self):
    self.get_devices = sorted(op.device for op in split_in_flight(
        [op for op in tf.compat.v1.get_default_graph().get_operations()
         if op.name.startswith('staged_input/') and op.type in GET_OPS])[0])


def counting_estimator(num_devices, depth):
  plan = make_plan(devices=testlib.cpu_devices(num_devices), loss_reduction='sum',
                   staging_depth=depth)
  towered = replicate_model_fn(counting_model_fn, plan=plan)
  return testlib.make_estimator(towered, num_cpus=num_devices), plan


def expected_get_devices(num_devices, depth):
  return sorted(f'/device:CPU:{k}' for k in range(num_devices)) if depth else []


@pytest.mark.timeout(**TIMEOUT)
@pytest.mark.parametrize('depth', [0, 1, 2])
@pytest.mark.parametrize('num_devices', [1, 2, 3, 4])
def test_every_example_once_in_train_evaluate_predict(num_devices, depth):
  est, plan = counting_estimator(num_devices, depth)
  fn = staged_input_fn(ids_input_fn(), plan)
  probes = [GraphProbe() for _ in range(3)]

  est.train(fn, hooks=[probes[0]])  # steps=None: to the end of the dataset.
  np.testing.assert_array_equal(est.get_variable_value('counts'), np.ones(NUM_IDS))
  assert est.get_variable_value('global_step') == -(-NUM_IDS // BATCH)

  metrics = est.evaluate(fn, hooks=[probes[1]])
  np.testing.assert_array_equal(metrics['seen'], np.ones(NUM_IDS))
  # Estimator's loss is the mean over batches of -(batch size).
  sizes = [min(BATCH, NUM_IDS - i) for i in range(0, NUM_IDS, BATCH)]
  testlib.assert_close(metrics['loss'], -np.mean(sizes), err_msg='loss')

  predicted = [p['id'] for p in est.predict(fn, hooks=[probes[2]])]
  assert predicted == list(range(NUM_IDS))
  for probe in probes:  # Staged exactly when depth > 0, one area per device.
    assert probe.get_devices == expected_get_devices(num_devices, depth)


@pytest.mark.timeout(**TIMEOUT)
@pytest.mark.parametrize('num_ids', [0, 3])
def test_empty_and_short_datasets_end(num_ids):
  # No batch at all, and one batch (3 examples on 4 devices) under depth 2.
  est, plan = counting_estimator(4, 2)
  fn = staged_input_fn(ids_input_fn(num_ids), plan)
  est.train(fn)
  expected = (np.arange(NUM_IDS) < num_ids).astype(np.float32)
  if num_ids:
    np.testing.assert_array_equal(est.get_variable_value('counts'), expected)
  predicted = [p['id'] for p in est.predict(fn)] if num_ids else []
  assert predicted == list(range(num_ids))


@pytest.mark.timeout(**TIMEOUT)
def test_resume_and_train_and_evaluate():
  # train(steps=2) stops with 2 batches still staged; the next train() restores
  # them and the input's position from the checkpoint (fresh areas, the staged
  # batches replayed first) and runs to the end of input: every id trained
  # once, as in one uninterrupted train() of the plain model_fn.
  plain = testlib.make_estimator(counting_model_fn)
  plain.train(ids_input_fn())

  est, plan = counting_estimator(3, 2)
  fn = staged_input_fn(ids_input_fn(), plan)
  est.train(fn, steps=2)
  est.train(fn)
  testlib.assert_variables_close(testlib.variables(est), testlib.variables(plain), tol=0)

  est, plan = counting_estimator(3, 2)
  fn = staged_input_fn(ids_input_fn(), plan)
  metrics, _ = tf.estimator.train_and_evaluate(
      est, tf.estimator.TrainSpec(fn),
      tf.estimator.EvalSpec(fn, steps=None, throttle_secs=0, start_delay_secs=0))
  np.testing.assert_array_equal(est.get_variable_value('counts'), np.ones(NUM_IDS))
  np.testing.assert_array_equal(metrics['seen'], np.ones(NUM_IDS))


@functools.lru_cache(maxsize=None)
def reference_variables(model_name, num_devices, depth, num_examples, batch):
  """Variables after training to the end of the data; num_devices=0: plain model_fn."""
  x, y = testlib.data(num_examples)
  fn = testlib.input_fn(x, y, batch)
  if not num_devices:
    est = testlib.make_estimator(testlib.MODELS[model_name])
    est.train(fn)
    return testlib.variables(est)
  plan = make_plan(devices=testlib.cpu_devices(num_devices), staging_depth=depth)
  est = testlib.make_estimator(replicate_model_fn(testlib.MODELS[model_name], plan=plan),
                               num_cpus=num_devices)
  est.train(staged_input_fn(fn, plan))
  return testlib.variables(est)


@pytest.mark.timeout(**TIMEOUT)
@pytest.mark.parametrize('model_name,num_devices,depth,reference_devices', [
    ('v1_layers', 3, 2, 0),  # Batch-separable: equals the plain model_fn.
    ('v1_layers', 4, 1, 0),
    ('keras_bn', 3, 2, 3),  # Shard statistics: equals unstaged towers.
    ('keras_bn', 2, 1, 2),
])
def test_staged_training_matches_unstaged(model_name, num_devices, depth, reference_devices):
  # 19 examples in batches of 7: steps of 7, 7 and 5 examples.
  staged = reference_variables(model_name, num_devices, depth, 19, 7)
  reference = reference_variables(model_name, reference_devices, 0, 19, 7)
  testlib.assert_variables_close(staged, reference)
  assert staged['global_step'] == 3


@pytest.mark.timeout(**TIMEOUT)
@pytest.mark.parametrize('batch,num_devices', [(6, 4), (2, 3)])
def test_static_batch(batch, num_devices):
  # drop_remainder=True gives static shard sizes (2, 3 and 0-row shards).
  est, plan = counting_estimator(num_devices, 1)
  est.train(staged_input_fn(ids_input_fn(batch=batch, drop_remainder=True), plan))
  kept = NUM_IDS // batch * batch
  np.testing.assert_array_equal(est.get_variable_value('counts'),
                                (np.arange(NUM_IDS) < kept).astype(np.float32))


def composite_model_fn(features, mode):
  total = (tf.reduce_sum(tf.sparse.to_dense(features['sparse']), axis=1)
           + tf.reduce_sum(features['ragged'], axis=1))
  return tf.estimator.EstimatorSpec(mode, predictions={'id': features['id'], 'total': total})


def composite_input_fn():
  ids = np.arange(NUM_IDS, dtype=np.int32)
  dense = np.where(np.arange(NUM_IDS * 3).reshape(NUM_IDS, 3) % 4 == 0, ids[:, None], 0)
  sparse = tf.sparse.from_dense(dense.astype(np.float32))
  ragged = tf.ragged.constant([[float(i)] * (i % 3) for i in range(NUM_IDS)])
  return tf.data.Dataset.from_tensor_slices(
      {'id': ids, 'sparse': sparse, 'ragged': ragged}).batch(BATCH)


@pytest.mark.timeout(**TIMEOUT)
def test_sparse_and_ragged_features_predict_like_plain():
  plain = testlib.make_estimator(composite_model_fn)
  expected = list(plain.predict(composite_input_fn))
  plan = make_plan(devices=testlib.cpu_devices(3), staging_depth=2)
  est = testlib.make_estimator(replicate_model_fn(composite_model_fn, plan=plan), num_cpus=3)
  predicted = list(est.predict(staged_input_fn(composite_input_fn, plan)))
  assert [p['id'] for p in predicted] == list(range(NUM_IDS))
  testlib.assert_close([p['total'] for p in predicted], [p['total'] for p in expected],
                       err_msg='total')


@pytest.mark.timeout(**TIMEOUT)
def test_plain_model_fn_uses_the_host_batch():
  # A model_fn without towers gets the plain host batch: no staging, exact end.
  plan = make_plan(devices=testlib.cpu_devices(2), staging_depth=2)
  est = testlib.make_estimator(counting_model_fn)
  est.train(staged_input_fn(ids_input_fn(), plan))
  np.testing.assert_array_equal(est.get_variable_value('counts'), np.ones(NUM_IDS))


def build_towered_graph(devices, mode=tf.estimator.ModeKeys.TRAIN, input_devices=None,
                        twice=False):
  """Builds a staged, towered graph as Estimator would, without running it."""
  x, y = testlib.data(7)
  plan = make_plan(devices=devices, staging_depth=2)
  input_plan = make_plan(devices=input_devices or devices, staging_depth=2)
  towered = replicate_model_fn(testlib.v1_model_fn, plan=plan)
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.get_or_create_global_step()
    with tf.device('/cpu:0'):  # Where Estimator calls input_fns.
      features, labels = staged_input_fn(testlib.input_fn(x, y, 3), input_plan)()
    spec = towered(features, labels, mode=mode)
    if twice:
      towered(features, labels, mode=mode)
  return graph, spec


@pytest.mark.parametrize('mode,hooks_field', [
    (tf.estimator.ModeKeys.TRAIN, 'training_hooks'),
    (tf.estimator.ModeKeys.EVAL, 'evaluation_hooks'),
    (tf.estimator.ModeKeys.PREDICT, 'prediction_hooks'),
])
def test_each_staging_area_sits_on_its_tower_device(mode, hooks_field):
  devices = ['/gpu:0', '/gpu:1', '/gpu:2']
  graph, spec = build_towered_graph(devices, mode)
  tower_devices = [f'/device:GPU:{k}' for k in range(3)]
  ops = graph.get_operations()
  gets, in_flight_gets = split_in_flight([op for op in ops if op.type == 'Unstage'])
  assert sorted(op.device for op in gets) == tower_devices
  # The puts are built in the branch of tf.cond that runs when a batch is left.
  stages, in_flight_stages = split_in_flight(
      [node for function in graph.as_graph_def().library.function
       for node in function.node_def if node.op == 'Stage'])
  assert sorted(node.device for node in stages) == tower_devices
  # A put and the get of the same area share its device.
  put_areas = {node.attr['shared_name'].s: node.device for node in stages}
  assert {op.node_def.attr['shared_name'].s: op.device for op in gets} == put_areas
  # In TRAIN the host keeps the staged global batches whole too (the checkpoint's position).
  in_flight = 1 if mode == tf.estimator.ModeKeys.TRAIN else 0
  assert [op.device for op in in_flight_gets] == ['/device:CPU:0'] * in_flight
  assert [node.device for node in in_flight_stages] == ['/device:CPU:0'] * in_flight
  # The iterator and the split stay on the host.
  host_ops = [op for op in ops if op.name.startswith('staged_input/')
              and op.type in ('IteratorGetNextAsOptional', 'If', 'StatelessIf')]
  assert len(host_ops) >= 2
  assert {op.device for op in host_ops} == {'/device:CPU:0'}
  hooks = [h for h in getattr(spec, hooks_field) if isinstance(h, staging.StagingHook)]
  assert len(hooks) == 1


def test_error_plan_is_not_a_device_plan():
  with pytest.raises(TypeError, match='plan must be a DevicePlan'):
    staged_input_fn(ids_input_fn(), ['/cpu:0'])


def test_error_unknown_backend():
  plan = make_plan(devices=['/cpu:0'])
  with pytest.raises(ValueError, match='backend must be one of'):
    staged_input_fn(ids_input_fn(), plan, backend='prefetch')


def test_error_input_fn_is_not_callable():
  plan = make_plan(devices=['/cpu:0'])
  with pytest.raises(TypeError, match='input_fn must be callable'):
    staged_input_fn(3, plan)


def test_error_input_fn_returns_no_dataset():
  plan = make_plan(devices=['/cpu:0'])
  fn = staged_input_fn(lambda: ({'id': tf.constant([1])}, None), plan)
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match='returns a tf.data.Dataset'):
      fn()


def test_error_dataset_element_is_not_a_pair():
  plan = make_plan(devices=['/cpu:0'])
  fn = staged_input_fn(lambda: tf.data.Dataset.from_tensors((1, 2, 3)), plan)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r'\(features, labels\) or features alone'):
      fn()


def test_error_plans_name_different_devices():
  with pytest.raises(ValueError, match='must tower on the same devices'):
    build_towered_graph(['/gpu:0', '/gpu:1'], input_devices=['/gpu:0', '/gpu:2'])


def test_error_staged_batch_feeds_two_model_fns():
  with pytest.raises(ValueError, match='can feed one towered model_fn only'):
    build_towered_graph(['/gpu:0', '/gpu:1'], mode=tf.estimator.ModeKeys.PREDICT, twice=True)


def test_input_fn_arguments_are_forwarded():
  # Estimator passes mode/params/config only when the input_fn names them.
  seen = {}

  def input_fn(mode, params):
    seen.update(mode=mode, params=params)
    return ids_input_fn()()

  def model_fn(features, labels, mode, params):
    del params
    return counting_model_fn(features, labels, mode)

  plan = make_plan(devices=testlib.cpu_devices(2))
  est = testlib.make_estimator(replicate_model_fn(model_fn, plan=plan),
                               num_cpus=2, params={'p': 1})
  predicted = [p['id'] for p in est.predict(staged_input_fn(input_fn, plan))]
  assert predicted == list(range(NUM_IDS))
  assert seen == {'mode': tf.estimator.ModeKeys.PREDICT, 'params': {'p': 1}}


def test_error_removed_backend():
  plan = make_plan(devices=['/cpu:0'])
  with pytest.raises(ValueError, match="backend='multi_device_iterator' is no longer "
                                       "available: it was removed.*Use backend='staging_area'"):
    staged_input_fn(ids_input_fn(), plan, backend='multi_device_iterator')
