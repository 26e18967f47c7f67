"""Cuts after the mixing ops (estimator_towers.batch_mixing): mixup at the input, attention
over the batch's hidden rows as a sync point.

The reference is the plain model_fn on the whole batch (same initial values):
every variable and slot within 1e-5 after 1 and 3 steps, on batches of 10, 10
and 2 (3 towers: shards 4/3/3, then 1/1/0, one empty at run time), towers
copied from the first or built, features a Tensor or a dict, labels mixed or
absent; inputs centred on the batch's mean, read by the first layer; attention
`h + softmax(h h^T) h` between two layers. The graph: the mixing ops run on the
whole batch on the first device, the network after them on each tower's device
on its own rows (no whole-batch head).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import cross_example_models as patterns
import testlib
import estimator_towers as et
from estimator_towers import replicate as towers
from estimator_towers.heads import batch_mixing

ModeKeys = tf.estimator.ModeKeys
BATCH = 10
NUM_EXAMPLES = 22   # batches of 10, 10 and 2


def _features(structure, x):
  if structure == 'tensor':
    return x
  if structure == 'two_features':
    return {'a': x[:, :3], 'b': x[:, 3:]}
  return {'x': x}


def _model_fn(structure, features, labels, mode):
  if structure == 'no_labels':
    assert labels is None
    x = features['x']
    labels = tf.cast(x[:, 0] > 0, tf.int32) + tf.cast(x[:, 1] > 0, tf.int32)
  if structure == 'two_features':
    loss, _ = patterns.mixup_features(features, labels)
  elif structure == 'centred':
    loss, _ = patterns.batch_centred(features['x'], labels)
  elif structure == 'attention':
    loss, _ = patterns.attention(features['x'], labels)
  else:
    loss, _ = patterns.mixup(features if structure == 'tensor' else features['x'], labels)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _input_fn(structure):
  rng = np.random.RandomState(3)
  x = rng.randn(NUM_EXAMPLES, patterns.F).astype(np.float32)
  y = (np.arange(NUM_EXAMPLES) % 3).astype(np.int32)
  if structure == 'no_labels':
    return lambda: tf.data.Dataset.from_tensor_slices(_features(structure, x)).batch(BATCH)
  return lambda: tf.data.Dataset.from_tensor_slices((_features(structure, x), y)).batch(BATCH)


class _GraphOf(tf.compat.v1.train.SessionRunHook):
  def begin(self):
    self.graph = tf.compat.v1.get_default_graph()


def _train(model_fn, structure, num_devices=1, **plan):
  """The variables after steps 1 and 3 of one train() call, and the graph."""
  if num_devices > 1:
    model_fn = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices), **plan)
  est = testlib.stepwise_estimator(model_fn, num_cpus=num_devices)
  hook = _GraphOf()
  after_1, after_3 = testlib.train_and_read(est, _input_fn(structure), hooks=[hook])
  return after_1, after_3, hook.graph


def _copied(graph, tower):
  """Tower `tower`'s backward pass is a copy of tower 0's (tower_copies)."""
  return any(op.name.startswith(f'tower_{tower}/') and '_grad/' in op.name
             for op in graph.get_operations())


@functools.lru_cache(maxsize=None)
def _plain(structure):
  after_1, after_3, _ = _train(functools.partial(_model_fn, structure), structure)
  return after_1, after_3


@pytest.mark.parametrize('layout', ['copied', 'built'])
@pytest.mark.parametrize('structure', ['dict', 'tensor', 'two_features', 'no_labels', 'centred',
                                       'attention'])
def test_cut_equals_plain_on_the_whole_batch(structure, layout, monkeypatch):
  """3 towers, 1 step on shards 4/3/3, then 2 more, the last on 1/1/0 (an empty shard)."""
  if layout == 'built':
    monkeypatch.setattr(towers, '_tower_copies', lambda *args: None)
  plain_1, plain_3 = _plain(structure)
  towered_1, towered_3, graph = _train(functools.partial(_model_fn, structure), structure, 3)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  if structure in ('attention', 'centred') and layout == 'copied':
    # Each tower its own copy of the variables: a tower's backward pass alone would miss
    # what its variables owe to the other towers' losses through the cut.
    replicated_1, replicated_3, _ = _train(functools.partial(_model_fn, structure), structure,
                                           3, variable_strategy='replicated')
    testlib.assert_variables_close(replicated_1, plain_1)
    testlib.assert_variables_close(replicated_3, plain_3)
  # The backward passes: copies of tower 0's, but one pass where the towers' rows meet in
  # the cut (attention: each tower's hidden rows get the gradient of every tower's loss).
  assert _copied(graph, 1) == _copied(graph, 2) == (layout == 'copied' and
                                                    structure != 'attention')
  names = [op.name for op in graph.get_operations()]
  assert any(n.startswith('batch_mixing/') for n in names)
  assert not any(n.startswith('whole_batch_head/') for n in names)


def _graph(structure='dict', num_devices=3, name=None):
  """A towered TRAIN graph on one batch of 10 (its size unknown when built)."""
  x = np.random.RandomState(0).randn(BATCH, patterns.F).astype(np.float32)
  y = np.arange(BATCH, dtype=np.int32) % 3
  if name is None:
    model_fn = functools.partial(_model_fn, structure)
  else:
    def model_fn(features, labels, mode):
      loss, _ = patterns.PATTERNS[name][0](features['x'], labels)
      train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
          loss, tf.compat.v1.train.get_global_step())
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices))
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    features = _features(structure, tf.compat.v1.placeholder_with_default(x, [None, patterns.F]))
    spec = towered(features, tf.compat.v1.placeholder_with_default(y, [None]), ModeKeys.TRAIN,
                   None, None)
  return graph, spec


@pytest.mark.parametrize('structure,mixing', [('dict', 'ReverseV2'), ('attention', 'MatMul')])
def test_the_towers_run_the_network_on_their_own_rows(structure, mixing):
  """The mixing ops on the whole batch on the first device (mixup's reverses of the inputs,
  attention's two products of the hidden rows); each tower's next layer on its device, on
  its shard's rows (4, 3, 3); no whole-batch head."""
  graph, _ = _graph(structure)
  ops = graph.get_operations()
  assert not [op for op in ops if op.name.startswith('whole_batch_head/')]
  whole = [op for op in ops if op.name.startswith('batch_mixing') and op.type == mixing]
  assert len(whole) == 2 and {op.device for op in whole} == {'/device:CPU:0'}
  layers = [graph.get_operation_by_name(f'{prefix}logits/MatMul')
            for prefix in ('', 'tower_1/', 'tower_2/')]
  assert [op.device for op in layers] == [f'/device:CPU:{k}' for k in range(3)]
  with graph.as_default():
    shapes = [tf.shape(op.inputs[0]) for op in layers]
    with tf.compat.v1.Session(config=testlib.run_config(3).session_config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      rows = [int(s[0]) for s in session.run(shapes)]
      whole_rows = session.run(tf.shape(whole[-1].outputs[0]))[0]
  assert rows == [4, 3, 3] and whole_rows == BATCH


def test_mixing_left_after_a_mid_network_cut_is_the_whole_batch_heads():
  """An in-batch softmax: cut after q d^T, its labels tf.range(B) would still mix; nothing
  is cut and the head (row-wise) runs from the embeddings."""
  graph, _ = _graph(name='in_batch_softmax')
  names = [op.name for op in graph.get_operations()]
  assert not any(n.startswith('batch_mixing') for n in names)
  assert any(n.startswith(('whole_batch_head/', 'row_wise_head/')) for n in names)


def test_a_cut_tensor_without_a_row_per_example_stops_the_step(monkeypatch):
  """The run-time check behind the graph's rules: a cut tensor of other rows is an error.

  Here the rules are bypassed (the stacked views' difference from their mean
  has two rows per example), as a model the rules misjudged would be.
  """
  monkeypatch.setattr(batch_mixing, '_one_row_each', lambda op, found: True)

  def model_fn(features, labels, mode):
    x = features['x']
    views = tf.concat(tf.split(x, 2, -1), 0)
    centred = views - tf.reduce_mean(views, 0)
    loss = tf.reduce_mean(tf.square(patterns.dense(centred, 2, 'out')))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  est = testlib.make_estimator(et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)),
                               num_cpus=3)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"sub:0 mixes the batch.{0,2}s rows at the input and is computed "
                           r"on the whole batch before the shards are cut, so it must have one "
                           r"row per example of the batch"):
    est.train(_input_fn('dict'), steps=1)


def test_a_later_request_that_builds_the_towers_again_is_an_error():
  """A second loss made after the first minimize: the towers are built again for it, with
  an input stage of their own that tower 0 no longer has."""
  def model_fn(features, labels, mode):
    loss, _ = patterns.mixup(features['x'], labels)
    step = tf.compat.v1.train.get_global_step()
    first = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with tf.control_dependencies([first]):
      second = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(0.5 * loss, step)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=second)

  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3))
  x = np.random.RandomState(0).randn(BATCH, patterns.F).astype(np.float32)
  with tf.Graph().as_default(), pytest.raises(
      ValueError, match=r"tower 1 was built again for a later gradient request .* its input "
                        r"stage mixes the batch's rows, while tower 0 reads the rows its first "
                        r"request cut on the whole batch: the towers would differ. Compute the "
                        r"later losses before the first gradient request"):
    tf.compat.v1.train.create_global_step()
    towered({'x': tf.compat.v1.placeholder_with_default(x, [None, patterns.F])},
            tf.compat.v1.placeholder_with_default(np.arange(BATCH, dtype=np.int32) % 3, [None]),
            ModeKeys.TRAIN, None, None)


@pytest.mark.parametrize('structure', ['dict', 'attention'])
def test_the_step_loss_is_plains(structure):
  """The reported loss (the towers' losses by the mean rule) is plain's on the whole batch."""
  x = np.random.RandomState(0).randn(BATCH, patterns.F).astype(np.float32)
  y = np.arange(BATCH, dtype=np.int32) % 3
  values = []
  for graph, spec in (_graph(structure), _plain_graph(structure, x, y)):
    with graph.as_default(), tf.compat.v1.Session(
        config=testlib.run_config(3).session_config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      values.append(session.run(spec.loss))
  testlib.assert_close(values[0], values[1])


def _plain_graph(structure, x, y):
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    spec = _model_fn(structure, {'x': tf.constant(x)}, tf.constant(y), ModeKeys.TRAIN)
  return graph, spec
