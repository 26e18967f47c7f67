"""Issue 7: TensorFlow's v1 canned estimators, towered, equal their plain selves.

Each canned estimator is built with default arguments (v1 heads sum the loss
over the batch; Ftrl, Adagrad and KMeans' own update) and run with testlib's
RunConfig, whose ConfigProto turns soft placement off. Its model_fn
(`canned.model_fn`, public) is towered by replicate_model_fn with the library's
defaults and run by a plain Estimator. The reference is the same canned
estimator, plain, on the same data (for KMeans' training step: its update
computed in numpy, since plain k-means' own update races; see test_kmeans.py).
Both sides start from one shared checkpoint (the canned DNN initialises
without seeds). The linear and combined classifiers run also on a hashed
categorical column of a SparseTensor feature (`*_sparse`). Checks: one training
step equal to plain (every variable and slot within 1e-5, identical
checkpoint names); on one checkpoint, identical eval metrics and predictions
in input order.
"""

import functools
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn

ModeKeys = tf.estimator.ModeKeys
BATCH = 7
NUM_DEVICES = 3
NUM_IDS = 10


def _data():
  rng = np.random.RandomState(7)
  x = rng.randn(2 * BATCH, testlib.NUM_FEATURES).astype(np.float32)
  ids = rng.randint(0, NUM_IDS, size=(2 * BATCH, 2)).astype(np.int64)
  y = rng.randint(0, testlib.NUM_CLASSES, size=2 * BATCH).astype(np.int32)
  return x, ids, y


def _classifier_input_fn():
  x, ids, y = _data()
  return tf.data.Dataset.from_tensor_slices(({'x': x, 'ids': ids}, y)).batch(BATCH)


def _tags():
  """Each example's hashed tags as a SparseTensor: 0 to 3 per example, some none."""
  rng = np.random.RandomState(11)
  indices, values = [], []
  for i in range(2 * BATCH):
    for j in range(rng.randint(0, 4)):
      indices.append([i, j])
      values.append(b'tag%d' % rng.randint(37))
  return tf.SparseTensor(np.array(indices, np.int64), np.array(values), [2 * BATCH, 3])


def _sparse_input_fn():
  """The classifiers' input with a SparseTensor feature (a hashed categorical column's)."""
  x, _, y = _data()
  return tf.data.Dataset.from_tensor_slices(({'x': x, 'tag': _tags()}, y)).batch(BATCH)


def _kmeans_input_fn():
  x, _, _ = _data()
  return tf.data.Dataset.from_tensor_slices(x).batch(BATCH)


def _columns():
  numeric = tf.feature_column.numeric_column('x', shape=[testlib.NUM_FEATURES])
  ids = tf.feature_column.categorical_column_with_identity('ids', NUM_IDS)
  return numeric, ids, tf.feature_column.embedding_column(ids, 3)


def _hashed():
  """A hashed categorical column of the SparseTensor feature, and its embedding."""
  tag = tf.feature_column.categorical_column_with_hash_bucket('tag', NUM_IDS)
  return tag, tf.feature_column.embedding_column(tag, 3)


def _linear_sparse(config, model_dir):
  numeric, _, _ = _columns()
  tag, _ = _hashed()
  return tf.compat.v1.estimator.LinearClassifier(
      [numeric, tag], n_classes=testlib.NUM_CLASSES, config=config, model_dir=model_dir)


def _combined_sparse(config, model_dir):
  numeric, _, _ = _columns()
  tag, embedding = _hashed()
  return tf.compat.v1.estimator.DNNLinearCombinedClassifier(
      linear_feature_columns=[tag], dnn_feature_columns=[numeric, embedding],
      dnn_hidden_units=[4], n_classes=testlib.NUM_CLASSES, config=config, model_dir=model_dir)


def _linear(config, model_dir):
  numeric, ids, _ = _columns()
  return tf.compat.v1.estimator.LinearClassifier(
      [numeric, ids], n_classes=testlib.NUM_CLASSES, config=config, model_dir=model_dir)


def _dnn(config, model_dir):
  numeric, _, embedding = _columns()
  return tf.compat.v1.estimator.DNNClassifier(
      [4], [numeric, embedding], n_classes=testlib.NUM_CLASSES, config=config,
      model_dir=model_dir, input_layer_partitioner=tf.compat.v1.fixed_size_partitioner(2))


def _combined(config, model_dir):
  numeric, ids, embedding = _columns()
  return tf.compat.v1.estimator.DNNLinearCombinedClassifier(
      linear_feature_columns=[ids], dnn_feature_columns=[numeric, embedding],
      dnn_hidden_units=[4], n_classes=testlib.NUM_CLASSES, config=config, model_dir=model_dir)


def _kmeans(config, model_dir):
  # KMeans trains without gradients (its train_op assigns new centres computed
  # from the batch) and its eval SCORE is metrics.mean of the batch's summed
  # distances: a batch-level value, not a per-example one.
  return tf.compat.v1.estimator.experimental.KMeans(
      testlib.NUM_CLASSES, config=config, model_dir=model_dir, seed=1)


CANNED = {  # name: (constructor, input_fn, prediction key compared in order)
    'linear': (_linear, _classifier_input_fn, 'logits'),
    'dnn': (_dnn, _classifier_input_fn, 'logits'),
    'dnn_linear_combined': (_combined, _classifier_input_fn, 'logits'),
    'kmeans': (_kmeans, _kmeans_input_fn, 'all_distances'),
    # A hashed column of a SparseTensor feature (its SparseReshape to [n, -1] reads the
    # batch size from the dense shape): per example, no head on the whole batch.
    'linear_sparse': (_linear_sparse, _sparse_input_fn, 'logits'),
    'dnn_linear_combined_sparse': (_combined_sparse, _sparse_input_fn, 'logits'),
}


def _plain(name, model_dir):
  make, _, _ = CANNED[name]
  return make(testlib.run_config(1), model_dir)


def _towered(name, model_dir):
  """A plain Estimator running the canned model_fn on NUM_DEVICES towers."""
  make, _, _ = CANNED[name]
  config = testlib.run_config(NUM_DEVICES)
  canned = make(config, model_dir)
  # canned.params is {}; passing it would make Estimator refuse a model_fn
  # without a params argument.
  assert not canned.params
  return tf.estimator.Estimator(
      replicate_model_fn(canned.model_fn, devices=testlib.cpu_devices(NUM_DEVICES)),
      model_dir=model_dir, config=config)


def _train_graph(name):
  """The plain canned model_fn's TRAIN graph on the input, and a Saver for it."""
  _, input_fn, _ = CANNED[name]
  estimator = _plain(name, tempfile.mkdtemp(prefix='et_'))
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    batch = tf.compat.v1.data.make_one_shot_iterator(input_fn()).get_next()
    features, labels = batch if isinstance(batch, tuple) else (batch, None)
    estimator.model_fn(features, labels, ModeKeys.TRAIN, estimator.config)
    saver = tf.compat.v1.train.Saver()
  return graph, saver


@functools.lru_cache(maxsize=None)
def _shared_start(name) -> str:
  """Prefix of the checkpoint both sides start from.

  Classifiers: freshly initialised variables (and slots). KMeans: after one
  plain step, so that its clusters are initialised (its init hook picks them
  from the first batch) and the compared step is a pure training step.
  """
  model_dir = tempfile.mkdtemp(prefix='et_start_')
  if name == 'kmeans':
    estimator = _plain(name, model_dir)
    estimator.train(CANNED[name][1], steps=1)
    return tf.train.latest_checkpoint(model_dir)
  graph, saver = _train_graph(name)
  with graph.as_default(), tf.compat.v1.Session() as session:
    session.run([tf.compat.v1.global_variables_initializer(),
                 tf.compat.v1.local_variables_initializer(),
                 tf.compat.v1.tables_initializer()])
    return saver.save(session, os.path.join(model_dir, 'model.ckpt'),
                      global_step=tf.compat.v1.train.get_global_step())


def _model_dir_from(prefix) -> str:
  """A new model_dir whose latest checkpoint is a copy of `prefix`."""
  model_dir = tempfile.mkdtemp(prefix='et_')
  source = os.path.dirname(prefix)
  for filename in os.listdir(source):
    if filename.startswith(os.path.basename(prefix) + '.'):
      shutil.copy(os.path.join(source, filename), model_dir)
  tf.compat.v1.train.update_checkpoint_state(
      model_dir, os.path.join(model_dir, os.path.basename(prefix)))
  return model_dir


def _checkpoint_values(name, model_dir):
  """{graph variable name: value} of model_dir's latest checkpoint, restored
  into the plain TRAIN graph (partitioned slots such as
  `embedding_weights/t_0/Adagrad` cannot be read by name from the checkpoint)."""
  graph, saver = _train_graph(name)
  with graph.as_default(), tf.compat.v1.Session() as session:
    saver.restore(session, tf.train.latest_checkpoint(model_dir))
    return session.run({v.op.name: v for v in tf.compat.v1.global_variables()})


def _checkpoint_names(model_dir):
  """The checkpoint's variables (not the towered run's input position)."""
  return sorted(n for n in tf.train.load_checkpoint(model_dir).get_variable_to_shape_map()
                if not n.startswith(testlib.POSITION_PREFIX))


@functools.lru_cache(maxsize=None)
def _plain_step(name):
  """model_dir of the plain canned estimator after one step from the shared start."""
  model_dir = _model_dir_from(_shared_start(name))
  _plain(name, model_dir).train(CANNED[name][1], steps=1)
  return model_dir


@pytest.mark.parametrize('name', sorted(CANNED))
def test_one_training_step_equals_plain(name):
  start = _shared_start(name)
  plain_dir = _plain_step(name)
  towered_dir = _model_dir_from(start)
  _towered(name, towered_dir).train(CANNED[name][1], steps=1)

  assert _checkpoint_names(towered_dir) == _checkpoint_names(plain_dir)
  plain = _checkpoint_values(name, plain_dir)
  before = _checkpoint_values(name, os.path.dirname(start))
  towered = _checkpoint_values(name, towered_dir)
  assert plain['global_step'] == before['global_step'] + 1
  changed = [n for n in plain if n != 'global_step' and np.asarray(plain[n]).dtype.kind == 'f'
             and not np.allclose(plain[n], before[n])]
  assert changed, 'the plain step must change variables'
  if name == 'kmeans':
    # Plain k-means' update races (tests/test_kmeans.py): the reference is
    # its update as its code states it, from the same start and batch.
    plain['clusters'], plain['Variable'] = testlib.minibatch_kmeans_steps(
        before['clusters'], before['Variable'], [_data()[0][:BATCH]])
  testlib.assert_variables_close(towered, plain)


@pytest.mark.parametrize('name', sorted(CANNED))
def test_eval_metrics_on_one_checkpoint(name):
  input_fn = CANNED[name][1]
  model_dir = _plain_step(name)
  expected = _plain(name, model_dir).evaluate(input_fn, name='plain')
  metrics = _towered(name, model_dir).evaluate(input_fn, name='towered')
  assert sorted(metrics) == sorted(expected)
  for metric in expected:
    testlib.assert_close(metrics[metric], expected[metric], err_msg=metric)


@pytest.mark.parametrize('name', sorted(CANNED))
def test_predictions_in_order_on_one_checkpoint(name):
  _, input_fn, key = CANNED[name]
  model_dir = _plain_step(name)
  plain_predictions = list(_plain(name, model_dir).predict(input_fn))
  towered_predictions = list(_towered(name, model_dir).predict(input_fn))
  assert key in plain_predictions[0]
  assert len(towered_predictions) == len(plain_predictions) == 2 * BATCH
  for i, (mine, ref) in enumerate(zip(towered_predictions, plain_predictions)):
    assert sorted(mine) == sorted(ref)
    for k in ref:
      if np.asarray(ref[k]).dtype.kind in 'SUO':
        np.testing.assert_array_equal(mine[k], ref[k], err_msg=f'example {i} {k}')
      else:
        testlib.assert_close(mine[k], ref[k], err_msg=f'example {i} {k}')
