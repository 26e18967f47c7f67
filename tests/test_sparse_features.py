"""Feature columns of sparse ids, towered: exact, data-parallel, and no false warning.

Feature columns make a dense id tensor sparse with `tf.where` (its positions
are the SparseTensor's indices) and look ids up with sparse reshapes, empty
rows filled, sparse segment sums, sparse crosses, dense tensors of entries.
Each model here reads its ids as a dict of SparseTensors and as dense ids
(padded with the identity column's ignored -1; the weights 0 there):
every column kind in one wide and deep model (an `input_layer` of an
embedding, an indicator, a crossed column's embedding, a weighted column's
embedding, shared embeddings; a `linear_model` of ids, a cross and weighted
ids: sparse sums of its weights), and a sequence column (`SequenceFeatures`: a sequence's length from its entries'
rows, padded to the batch). Each trains 2 steps on 2 and 3 towers and on 2x2
and 1x2 micro-batches equal to the undecorated model_fn on one device from
the same seeded start (every variable and Adagrad slot within 1e-5), with no
warning; every device holds at least 0.9 x the plain graph's heavy ops,
gathers and sparse segment sums counted (`sparse_work`), and building the
towers warns of nothing.
"""

import functools
import re

import numpy as np
import pytest
import tensorflow as tf

import heavy_ops
import testlib
import estimator_towers as et

fc = tf.feature_column
BATCH, IDS, WIDTH = 12, 10, 3
LAYOUTS = {'2_towers': (2, 1), '3_towers': (3, 1), '2x2_micro': (2, 2), '1x2_micro': (1, 2)}
# What a device's share counts: the heavy ops, the gathers of a lookup and the sparse
# segment sums that sum its entries per example.
SPARSE_WORK = heavy_ops.HEAVY | {
    'GatherV2', 'ResourceGather', 'SparseSegmentSum', 'SparseSegmentMean',
    'SparseSegmentSqrtN', 'SparseSegmentSumWithNumSegments',
    'SparseSegmentMeanWithNumSegments', 'SparseSegmentSqrtNWithNumSegments'}


def _ids():
  """Each example's 0 to 3 ids (some none), and a weight for each."""
  rng = np.random.RandomState(5)
  ids = -np.ones([BATCH, 3], np.int64)
  for i in range(BATCH):
    count = rng.randint(0, 4) if i != BATCH - 1 else 0   # the last example: none
    ids[i, :count] = rng.randint(0, IDS, count)
  weights = np.where(ids >= 0, rng.uniform(0.5, 2.0, ids.shape), 0).astype(np.float32)
  return ids, weights


def _sparse(dense, present):
  where = np.argwhere(present)
  return tf.compat.v1.SparseTensorValue(where.astype(np.int64), dense[present],
                                        np.array(dense.shape, np.int64))


def features(form):
  """{'ids', 'ids2', 'w', 'seq', 'x'}: SparseTensors (form 'sparse') or dense ids."""
  ids, weights = _ids()
  ids2 = np.where(ids >= 0, (ids * 7 + 3) % IDS, -1)
  x = np.random.RandomState(6).randn(BATCH, 2).astype(np.float32)
  if form == 'dense':
    return {'ids': ids, 'ids2': ids2, 'w': weights, 'x': x}
  present = ids >= 0
  return {'ids': _sparse(ids, present), 'ids2': _sparse(ids2, present),
          'w': _sparse(weights, present), 'seq': _sparse(ids, present), 'x': x}


LABELS = (np.arange(BATCH) % 3).astype(np.int32)


def _identity(name='ids'):
  return fc.categorical_column_with_identity(name, IDS)


def _embedding(column, seed):
  return fc.embedding_column(column, WIDTH, initializer=tf.compat.v1.truncated_normal_initializer(
      seed=seed))


def wide_and_deep(features):
  """Every column kind: an input layer (deep) plus a linear model (wide); their logits."""
  ids, ids2 = _identity(), _identity('ids2')
  crossed = fc.crossed_column([ids, ids2], 16)
  weighted = fc.weighted_categorical_column(_identity(), 'w')
  shared = tf.compat.v1.feature_column.shared_embedding_columns(
      [_identity(), _identity('ids2')], WIDTH,
      initializer=tf.compat.v1.truncated_normal_initializer(seed=4))
  columns = [_embedding(ids, 1), fc.indicator_column(ids), _embedding(crossed, 2),
             _embedding(weighted, 3), fc.numeric_column('x', [2])] + shared
  h = tf.compat.v1.feature_column.input_layer(features, columns)
  deep = tf.compat.v1.layers.dense(
      h, 3, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
  wide = tf.compat.v1.feature_column.linear_model(   # sparse sums of its weights
      features, [ids, crossed, weighted, fc.numeric_column('x', [2])], units=3)
  return deep + wide


def sequence(features):
  """A sequence column's embeddings, averaged over each example's length."""
  column = _embedding(fc.sequence_categorical_column_with_identity('seq', IDS), 1)
  h, length = tf.keras.experimental.SequenceFeatures([column])(features)
  mask = tf.sequence_mask(length, tf.shape(h)[1], tf.float32)
  pooled = tf.reduce_sum(h * mask[..., None], 1) / tf.maximum(
      tf.cast(length, tf.float32), 1.0)[:, None]
  return tf.compat.v1.layers.dense(
      tf.concat([pooled, features['x']], 1), 3,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))


MODELS = {'wide_and_deep': wide_and_deep, 'sequence': sequence}
CASES = [(m, f) for m in sorted(MODELS) for f in ('sparse', 'dense')
         if not (m == 'sequence' and f == 'dense')]   # sequence columns read SparseTensors


def model_fn(features, labels, mode, params=None, config=None, model=None):
  logits = MODELS[model](features)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.AdagradOptimizer(0.5).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _input_fn(form):
  def fn():   # the batch size unknown, as most input_fns give it
    return tf.data.Dataset.from_tensor_slices((features(form), LABELS)).repeat().batch(BATCH)
  return fn


@functools.lru_cache(maxsize=None)
def _plain(model, form):
  estimator = testlib.make_estimator(functools.partial(model_fn, model=model))
  estimator.train(_input_fn(form), steps=2)
  return testlib.variables(estimator)


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
@pytest.mark.parametrize('model,form', CASES)
def test_trains_as_plain_with_no_warning(model, form, layout, warnings):
  devices, micro = LAYOUTS[layout]
  towered = et.replicate_model_fn(functools.partial(model_fn, model=model),
                                  devices=testlib.cpu_devices(devices), micro_batches=micro)
  estimator = testlib.make_estimator(towered, num_cpus=devices)
  estimator.train(_input_fn(form), steps=2)
  expected = _plain(model, form)
  assert any(name.endswith('Adagrad') for name in expected)
  testlib.assert_variables_close(testlib.variables(estimator), expected)
  assert not warnings, warnings


def sparse_work(graph: tf.Graph, tower_devices: int) -> dict:
  """`SPARSE_WORK` ops per device ('CPU:0', ...). A lookup TensorFlow colocates with its
  table (`embedding_lookup`'s `colocate_with(params)`) runs where the table lives,
  whatever the towers do: it counts for the tower that issued it (`tower_k/`)."""
  counts = {f'CPU:{i}': 0 for i in range(tower_devices)}
  for op in graph.get_operations():
    if op.type not in SPARSE_WORK:
      continue
    device = heavy_ops._device(op)   # pylint: disable=protected-access
    if any(_variable(graph, group) for group in op.colocation_groups()):
      tower = re.search(r'(^|/)tower_(\d+)/', op.name)
      device = f'CPU:{tower.group(2)}' if tower else 'CPU:0'
    counts[device] = counts.get(device, 0) + 1
  return counts


def _variable(graph: tf.Graph, group: bytes) -> bool:
  """Whether colocation group `group` (b'loc:@name') is a variable's."""
  try:
    return graph.get_operation_by_name(group.decode()[len('loc:@'):]).type in (
        'VarHandleOp', 'VariableV2')
  except KeyError:
    return False


def least_share(model_fn_, towered, num_devices, feature_values, labels, params=None):
  """The least loaded tower device's `sparse_work` over the plain graph's."""
  plain = sparse_work(heavy_ops.train_graph(model_fn_, feature_values, labels, params), 1)
  counts = sparse_work(heavy_ops.train_graph(towered, feature_values, labels, params),
                       num_devices)
  return min(counts.values()) / plain['CPU:0'], counts, plain


@pytest.mark.parametrize('model,form', CASES)
def test_every_device_holds_its_share(model, form, warnings):
  share, counts, plain = least_share(
      lambda f, l, m, p, c: model_fn(f, l, m, model=model),
      et.replicate_model_fn(functools.partial(model_fn, model=model),
                            devices=testlib.cpu_devices(2)), 2, features(form), LABELS)
  assert share >= 0.9, (share, counts, plain)
  assert not warnings, warnings   # nor split per shard with a warning
