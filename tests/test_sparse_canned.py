"""Canned estimators with categorical columns, towered: on every device, and exact.

TensorFlow's v1 `DNN*`, `Linear*` and `DNNLinearCombined*` classifiers and
regressors over an identity column (its embedding for the deep part) read
their ids as dense ids ([B, 2], the ignored -1 where an example has fewer)
or as a SparseTensor. Every device of 2 towers holds at least 0.9 x the plain
graph's heavy ops, gathers and sparse segment sums counted
(`test_sparse_features.sparse_work`: a lookup TensorFlow colocates with its
table counts for the tower that issued it), and the build warns of nothing
but the canned heads' per-tower summaries. One per layout (2 and 3 towers,
2x2 and 1x2 micro-batches) trains 2 steps equal to the plain canned
estimator from one shared checkpoint (every variable and slot within 1e-5;
tests/test_canned.py runs 3 towers of each).
"""

import functools
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import testlib
import test_sparse_features as sparse_features
from estimator_towers import replicate_model_fn

fc = tf.feature_column
BATCH, IDS = 12, 10
ModeKeys = tf.estimator.ModeKeys


def _features(form):
  rng = np.random.RandomState(3)
  ids = -np.ones([BATCH, 2], np.int64)
  for i in range(BATCH):
    count = rng.randint(0, 3)
    ids[i, :count] = rng.randint(0, IDS, count)
  x = rng.randn(BATCH, 2).astype(np.float32)
  if form == 'dense':
    return {'ids': ids, 'x': x}
  where = np.argwhere(ids >= 0)
  return {'ids': tf.compat.v1.SparseTensorValue(where.astype(np.int64), ids[ids >= 0],
                                                np.array(ids.shape, np.int64)), 'x': x}


def _labels(name):
  if name.endswith('Regressor'):
    return np.linspace(-1, 1, BATCH, dtype=np.float32)[:, None]
  return (np.arange(BATCH) % 3).astype(np.int32)


def _make(name, config=None, model_dir=None):
  ids = fc.categorical_column_with_identity('ids', IDS)
  numeric, embedding = fc.numeric_column('x', [2]), fc.embedding_column(ids, 3)
  kind = getattr(tf.compat.v1.estimator, name)
  extra = {'n_classes': 3} if name.endswith('Classifier') else {}
  if name.startswith('DNNLinearCombined'):
    return kind(linear_feature_columns=[ids], dnn_feature_columns=[numeric, embedding],
                dnn_hidden_units=[4], config=config, model_dir=model_dir, **extra)
  if name.startswith('DNN'):
    return kind([4], [numeric, embedding], config=config, model_dir=model_dir, **extra)
  return kind([numeric, ids], config=config, model_dir=model_dir, **extra)


SHARES = [('DNNClassifier', 'dense'), ('DNNRegressor', 'sparse'),
          ('LinearClassifier', 'dense'), ('LinearRegressor', 'sparse'),
          ('DNNLinearCombinedClassifier', 'sparse'), ('DNNLinearCombinedRegressor', 'dense')]


@pytest.mark.parametrize('name,form', SHARES)
def test_every_device_holds_its_share(name, form, monkeypatch):
  warnings = testlib.logged_warnings(monkeypatch)
  canned = _make(name, testlib.run_config(1))
  model_fn = lambda features, labels, mode: canned.model_fn(features, labels, mode,
                                                            canned.config)
  share, counts, plain = sparse_features.least_share(
      lambda f, l, m, p, c: model_fn(f, l, m),
      replicate_model_fn(model_fn, devices=testlib.cpu_devices(2)), 2, _features(form),
      _labels(name))
  assert share >= 0.9, (share, counts, plain)
  # the canned heads' summaries of tower 0's shard (a zero fraction, an average loss)
  assert all('summary' in w for w in warnings), warnings


def _input_fn(name, form):
  def fn():
    return tf.data.Dataset.from_tensor_slices(
        (_features(form), _labels(name))).repeat().batch(BATCH)
  return fn


@functools.lru_cache(maxsize=None)
def _start(name, form) -> str:
  """A checkpoint of freshly initialised variables both sides start from."""
  canned = _make(name, testlib.run_config(1), tempfile.mkdtemp(prefix='et_'))
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        _input_fn(name, form)()).get_next()
    canned.model_fn(features, labels, ModeKeys.TRAIN, canned.config)
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      return saver.save(session, os.path.join(tempfile.mkdtemp(prefix='et_'), 'model.ckpt'),
                        global_step=0)


def _from_start(name, form) -> str:
  prefix, model_dir = _start(name, form), tempfile.mkdtemp(prefix='et_')
  for path in tf.io.gfile.glob(prefix + '.*'):
    shutil.copy(path, model_dir)
  tf.compat.v1.train.update_checkpoint_state(model_dir, os.path.join(
      model_dir, os.path.basename(prefix)))
  return model_dir


EQUALS = {'2_towers': ('DNNClassifier', 'dense', 2, 1),
          '3_towers': ('LinearRegressor', 'sparse', 3, 1),
          '2x2_micro': ('DNNLinearCombinedClassifier', 'sparse', 2, 2),
          '1x2_micro': ('DNNLinearCombinedRegressor', 'dense', 1, 2)}


@pytest.mark.parametrize('layout', sorted(EQUALS))
def test_two_steps_equal_plain(layout):
  name, form, devices, micro = EQUALS[layout]
  plain = _make(name, testlib.run_config(1), _from_start(name, form))
  plain.train(_input_fn(name, form), steps=2)
  config = testlib.run_config(devices)
  canned = _make(name, config, _from_start(name, form))
  towered = tf.estimator.Estimator(
      replicate_model_fn(canned.model_fn, devices=testlib.cpu_devices(devices),
                         micro_batches=micro), model_dir=canned.model_dir, config=config)
  towered.train(_input_fn(name, form), steps=2)
  expected = testlib.variables(plain)
  assert any(n.endswith(('Adagrad', 'Ftrl', 'accum')) for n in expected), sorted(expected)
  testlib.assert_variables_close(testlib.variables(towered), expected)
