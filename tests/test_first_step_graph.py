"""What the library builds once for all the towers, in the ops that time to first step pays for.

A session's placement, grappler's passes and the executors take time per op of
the graph, so the library's own ops are made once for all the towers where
they can be: the shards of a batch whose size is known at run time only get
their sizes and bounds from a few vector ops (not a few ops per shard), and the
towers' loss statistics are summed left to right by `fixed_sums.in_sequence`,
not by an AddN, which grappler's memory optimizer may rewrite into additions
in arrival order (after which it simulates the whole graph's memory again).
Each reference here is independent of the code: numpy's rows of the batch by
the sharding rule, numpy's float32 additions in order, the op count of one
shard more.
"""

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn
from estimator_towers.base import fixed_sums
from estimator_towers.inputs import sharding


def _shards(num_shards: int, fill_empty: bool = True):
  """A graph splitting a {'x', 'y'} batch of unknown size; (graph, feeds, shards, sizes)."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2])
    y = tf.compat.v1.placeholder(tf.int32, [None])
    sizes = sharding.shard_sizes(tf.shape(x)[0], num_shards)
    shards = sharding.split({'x': x, 'y': y}, sizes, fill_empty=fill_empty)
  return graph, (x, y), shards, sizes


def _rule(batch: int, num_shards: int) -> list:
  """Shard k's rows by the rule: B // N, one more for the first B % N; an empty shard after
  the first borrows row 0 (training)."""
  rows, start = [], 0
  for k in range(num_shards):
    size = batch // num_shards + (1 if k < batch % num_shards else 0)
    rows.append(list(range(start, start + size)) if size or k == 0 else [0][:batch])
    start += size
  return rows


@pytest.mark.parametrize('num_shards', [2, 3])
def test_shards_of_a_batch_known_at_run_time_are_the_rule(num_shards):
  graph, (x, y), shards, sizes = _shards(num_shards)
  with tf.compat.v1.Session(graph=graph) as session:
    for batch in range(2 * num_shards + 2):
      xs = np.arange(2 * batch, dtype=np.float32).reshape(batch, 2)
      ys = np.arange(batch, dtype=np.int32) + 100
      got, got_sizes = session.run((shards, sizes), {x: xs, y: ys})
      for k, rows in enumerate(_rule(batch, num_shards)):
        np.testing.assert_array_equal(got[k]['x'], xs[rows], err_msg=f'batch {batch} shard {k}')
        np.testing.assert_array_equal(got[k]['y'], ys[rows], err_msg=f'batch {batch} shard {k}')
        assert got_sizes[k] == batch // num_shards + (k < batch % num_shards)


def test_shard_ops_do_not_grow_with_the_shards():
  """One more shard of one leaf is one more slice of it: sizes and bounds are vectors."""
  def ops(num_shards):
    graph = tf.Graph()
    with graph.as_default():
      x = tf.compat.v1.placeholder(tf.float32, [None, 2])
      sharding.split(x, sharding.shard_sizes(tf.shape(x)[0], num_shards), fill_empty=True)
    return len(graph.get_operations())
  assert ops(8) - ops(4) == 4


@pytest.mark.parametrize('shape', [[], [2, 3], None])
def test_in_sequence_adds_left_to_right(shape):
  rng = np.random.RandomState(7)
  static = [] if shape is None else shape
  values = [np.float32(np.asarray(rng.randn(*static)) * 10.0 ** rng.randint(-6, 7))
            for _ in range(5)]
  expected = values[0]
  for v in values[1:]:
    expected = np.float32(expected + v)
  with tf.Graph().as_default():
    feeds = [tf.compat.v1.placeholder(tf.float32, shape) for _ in values]
    total = fixed_sums.in_sequence(feeds)
    assert not [op for op in tf.compat.v1.get_default_graph().get_operations()
                if op.type in ('AddN', 'Add', 'AddV2')]
    with tf.compat.v1.Session() as session:
      got = session.run(total, dict(zip(feeds, values)))
  assert got.shape == np.shape(expected)
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize('adds', ['in_sequence', 'add'])
def test_integer_sums_build_no_bias_add(adds):
  """An integer statistic (a shard's row count) sums with an ordinary addition: integers
  add to the same value in any order, and a BiasAdd has no integer kernel on GPUs (a
  GPU-placed count would fail the step with soft placement off)."""
  with tf.Graph().as_default() as graph:
    counts = [tf.constant(3), tf.constant(4), tf.constant(5)]
    total = (fixed_sums.in_sequence(counts) if adds == 'in_sequence'
             else fixed_sums.add(fixed_sums.add(counts[0], counts[1]), counts[2]))
    assert not [op for op in graph.get_operations() if op.type == 'BiasAdd']
    with tf.compat.v1.Session() as session:
      assert session.run(total) == 12


def _weighted_model_fn(features, labels, mode, params):
  """A loss of the whole batch's sums (BERT's masked-LM form: sum(w * l) / sum(w))."""
  del params
  logits = tf.compat.v1.layers.dense(features['x'], testlib.NUM_CLASSES)
  losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  weights = features['w']
  loss = tf.reduce_sum(weights * losses) / (tf.reduce_sum(weights) + 1e-5)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_loss_statistics_are_summed_without_an_addn():
  """The towers' statistics of the whole batch's loss: no AddN of three or more values."""
  towered = replicate_model_fn(_weighted_model_fn, devices=testlib.cpu_devices(3))
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features = {'x': tf.compat.v1.placeholder(tf.float32, [None, testlib.NUM_FEATURES]),
                'w': tf.compat.v1.placeholder(tf.float32, [None])}
    towered(features, tf.compat.v1.placeholder(tf.int32, [None]), tf.estimator.ModeKeys.TRAIN,
            {}, testlib.run_config(3))
  sums = [op for op in graph.get_operations() if op.name.startswith('whole_batch_loss')]
  assert sums, 'no whole-batch loss was rebuilt from the towers\' statistics'
  assert not [op.name for op in sums if op.type == 'AddN' and len(op.inputs) > 2]
