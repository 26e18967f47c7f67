"""Keyed random draws: every kind of random op, on every layout, draws what one device draws.

With `random_draws='keyed'` (the default) a random op's values are set by the
example's position in the global batch and the global step, not by the
device that computes it (`estimator_towers/draws/keyed.py`). The reference of
every test here is the same model_fn decorated for one device
(`replicate_model_fn(fn, devices=['/cpu:0'])`, keyed too): its draws differ
from the undecorated model_fn's own stream, so the plain model_fn is no
reference. Each layout must equal it within `testlib.TOLERANCE`:

- PREDICT: a model_fn that returns each kind of draw per example (stateful
  uniform, normal, truncated normal and uniform int; stateless uniform and
  normal, the V2 path, `tf.compat.v1.random.stateless_uniform` being the same
  function, and the v1-only `stateless_multinomial`; categorical; gamma of
  batch rows and of a fixed shape; `tf.nn.dropout` v2 and v1,
  `tf.compat.v1.layers.dropout`, Keras Dropout and GaussianNoise;
  `tf.image.random_flip_left_right` on a 4-D batch; a scalar per step) on 3
  towers, 1 device x 3 micro-batches and 2 x 2, over batches of 10 (4/3/3 on 3
  towers) and 2 (1/1/0: an empty shard). PREDICT concatenates the towers'
  predictions in input order, so each example's draw is compared directly.
  Under a graph-level seed, an op seed the model_fn gives stays the op's own
  where the graph's counter gave the same number to an earlier op. A draw
  shaped by a reshape to the shard's static batch size (BERT's shapes under
  `drop_remainder=True`) draws as one device too.
- TRAIN: a small model of the main kinds, every variable and slot after 1 and
  3 steps, under a graph-level seed only and under op seeds, with labels and
  features only (a dict, a plain Tensor); time-major dropout, a mixup by
  `tf.random.shuffle` of the batch's positions and a shuffle of hidden rows
  (which passes no gradient, as `RandomShuffle`): all mix the batch's rows,
  so the whole-batch head draws them; an in-batch softmax with dropout
  before the embeddings in micro-batches (the cached-gradient head's first
  pass draws them again).
- EVAL: Monte-Carlo dropout (active in EVAL), metrics and loss on 3 towers.
- The refusals (a random op in a function body, `tf.random.Generator`,
  Poisson and gamma draws of batch rows, flat rows of data-dependent counts,
  an unknown `random_draws`), one test per message. Random ops inside while
  loops are keyed by the iteration: tests/test_loop_draws.py.

The towered side draws with `RANDOM_DRAWS`: set it to 'per_shard' (each tower
draws on its own, the behaviour before keyed draws) to see these tests fail;
`test_per_shard_draws_differ_from_one_device` checks that they can.

Graphs are built and run by `estimator_graph.EstimatorGraph` (one graph per
layout, cached per module), and initial values are constants: initializers
draw as TensorFlow does, by op seeds that follow op creation order.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import cross_example_models as patterns
import estimator_towers as et
import testlib
from estimator_graph import EstimatorGraph

ModeKeys = tf.estimator.ModeKeys

# The towered side's draws ('per_shard': each tower draws its shard on its own).
RANDOM_DRAWS = 'keyed'

T, H = 3, 4            # an example: a [T, H] sequence (a T x H image for the flips)
CLASSES = 3
BATCH = 10
NUM_EXAMPLES = 22      # batches of 10, 10, 2: the last leaves a shard empty
GRAPH_SEED = 7
# name -> (devices, micro-batches): 4/3/3 then 1/1/0; 4/3/3 then 1/1/0 on one device;
# 3/2 + 3/2 then 1/0 + 1/0; 5/5 then 1/1.
LAYOUTS = {'3_towers': (3, 1), '1x3': (1, 3), '2x2': (2, 2), '1x2': (1, 2)}
DRAW_LAYOUTS = ('3_towers', '1x3', '2x2')


def _data(seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(NUM_EXAMPLES, T, H).astype(np.float32)
  return x, rng.randint(0, CLASSES, NUM_EXAMPLES).astype(np.int32)


def _input_fn(inputs='labels', graph_seed=None, x=None):
  """Batches of BATCH: ({'x': x}, y) ('labels'), {'x': x} ('dict') or x ('tensor').

  `graph_seed`: the graph-level seed, set in the graph before the model_fn is
  called (what Estimator does with RunConfig(tf_random_seed=...)).
  """
  data_x, y = _data()
  x = data_x if x is None else x

  def input_fn():
    if graph_seed is not None:
      tf.compat.v1.set_random_seed(graph_seed)
    slices = {'labels': ({'x': x}, y), 'dict': {'x': x}, 'tensor': x}[inputs]
    return tf.data.Dataset.from_tensor_slices(slices).batch(BATCH)
  return input_fn


def _decorated(model_fn, layout=None, random_draws=None):
  """One device (layout None, keyed: the reference) or the towered model_fn of `layout`."""
  if layout is None:
    return et.replicate_model_fn(model_fn, devices=['/cpu:0'])
  num_devices, micro_batches = LAYOUTS[layout]
  return et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                               micro_batches=micro_batches,
                               random_draws=random_draws or RANDOM_DRAWS)


def _num_cpus(layout):
  return 1 if layout is None else LAYOUTS[layout][0]


def _constant(shape, seed):
  values = np.random.RandomState(seed).uniform(-0.5, 0.5, shape).astype(np.float32)
  return tf.compat.v1.constant_initializer(values)


def _dense(x, units, seed, activation=None):
  return tf.compat.v1.layers.dense(x, units, activation,
                                   kernel_initializer=_constant([x.shape[-1], units], seed))


def _momentum_spec(mode, loss):
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _assert_all_close(actual: dict, expected: dict, what: str):
  assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
  for name in expected:
    testlib.assert_close(actual[name], expected[name], err_msg=f'{what}: {name}')


# --- PREDICT: each kind of draw, per example ---------------------------------------

def _draws(x):
  """Every kind of draw, each a [batch, ...] prediction."""
  b = tf.shape(x)[0]
  flat = tf.reshape(x, [b, T * H])
  ones = tf.ones_like(flat)
  return {
      'uniform': tf.random.uniform(tf.shape(flat)),
      'normal': tf.random.normal(tf.shape(flat), seed=3),
      'truncated_normal': tf.random.truncated_normal(tf.shape(flat)),
      'uniform_int': tf.random.uniform(tf.shape(flat), maxval=1000, dtype=tf.int32),
      'stateless_uniform': tf.random.stateless_uniform(tf.shape(flat), seed=[1, 2]),
      'stateless_normal': tf.random.stateless_normal(tf.shape(flat), seed=[3, 4]),
      'v1_stateless_multinomial': tf.compat.v1.random.stateless_multinomial(flat, 4, [5, 6]),
      'categorical': tf.random.categorical(flat, 5),
      'gamma_rows': tf.random.gamma([b], 1.5),
      'gamma_fixed_shape': tf.zeros([b, 1]) + tf.random.gamma([2], 2.0),
      'dropout': tf.nn.dropout(ones, rate=0.4),
      'v1_dropout': tf.compat.v1.nn.dropout(ones, keep_prob=0.7),
      'layers_dropout': tf.compat.v1.layers.dropout(ones, 0.5, training=True),
      'keras_dropout': tf.keras.layers.Dropout(0.3)(ones, training=True),
      'keras_gaussian_noise': tf.keras.layers.GaussianNoise(1.0)(flat, training=True),
      'flip': tf.image.random_flip_left_right(x[..., None]),
      'time_major_dropout': tf.transpose(
          tf.nn.dropout(tf.transpose(x, [1, 0, 2]), rate=0.5), [1, 0, 2]),
      'per_step': tf.zeros([b]) + tf.random.uniform([]),
  }


def _draws_model_fn(features, mode):
  return tf.estimator.EstimatorSpec(mode, predictions=_draws(features['x']))


# Time-major dropout's draw in PREDICT: see test_time_major_dropout_predicts_as_one_device.
_ROWS_ON_AXIS_1 = ('time_major_dropout',)


def _predict(model_fn, layout=None, random_draws=None):
  graph = EstimatorGraph(_decorated(model_fn, layout, random_draws), _input_fn('dict'),
                         ModeKeys.PREDICT, num_cpus=_num_cpus(layout))
  try:
    batches = graph.run()
  finally:
    graph.close()
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@functools.lru_cache(maxsize=None)
def _predicted(layout=None, random_draws=None):
  return _predict(_draws_model_fn, layout, random_draws)


@pytest.mark.core_equivalence
@pytest.mark.parametrize('layout', DRAW_LAYOUTS)
def test_every_kind_of_draw_predicts_as_one_device(layout):
  expected = {k: v for k, v in _predicted().items() if k not in _ROWS_ON_AXIS_1}
  actual = {k: v for k, v in _predicted(layout).items() if k not in _ROWS_ON_AXIS_1}
  _assert_all_close(actual, expected, layout)


def test_a_draw_without_batch_rows_is_one_value_on_every_tower():
  """A scalar per step and a gamma of a fixed shape: every example of a batch has the same."""
  expected, actual = _predicted(), _predicted('3_towers')
  for name in ('per_step', 'gamma_fixed_shape'):
    for first, end in ((0, BATCH), (BATCH, 2 * BATCH), (2 * BATCH, NUM_EXAMPLES)):
      batch = actual[name][first:end]
      np.testing.assert_array_equal(batch, np.broadcast_to(batch[0], batch.shape), err_msg=name)
    testlib.assert_close(actual[name], expected[name], err_msg=name)


def _sampled_model_fn(features, mode):
  """Sampled-softmax candidates (no batch rows), given to every example."""
  x = features['x']
  ids = tf.cast(tf.abs(x[:, 0, :1]) * 10, tf.int64)
  sampled, _, _ = tf.random.log_uniform_candidate_sampler(ids, 1, 5, True, 50)
  return tf.estimator.EstimatorSpec(mode, predictions={
      'sampled': tf.tile(sampled[None], [tf.shape(x)[0], 1])})


def test_sampled_candidates_are_one_device_s_on_every_tower():
  """The candidate sampler's op is seeded the same on every tower: one device's candidates."""
  expected, actual = _predict(_sampled_model_fn), _predict(_sampled_model_fn, '3_towers')
  np.testing.assert_array_equal(actual['sampled'], expected['sampled'])
  first = actual['sampled'][:BATCH]
  np.testing.assert_array_equal(first, np.broadcast_to(first[0], first.shape))


@pytest.mark.parametrize('layout', DRAW_LAYOUTS)
def test_time_major_dropout_predicts_as_one_device(layout):
  """x transposed to [T, B, H], dropped out and transposed back."""
  name = 'time_major_dropout'
  testlib.assert_close(_predicted(layout)[name], _predicted()[name], err_msg=name)


def test_per_shard_draws_differ_from_one_device():
  """Drawn per shard, towers 1 and 2 draw their own values (what the tests above rule out)."""
  expected, actual = _predicted(), _predicted('3_towers', 'per_shard')
  for name in ('uniform', 'dropout', 'stateless_normal', 'per_step'):
    towers_1_and_2 = slice(4, BATCH)
    assert not np.allclose(actual[name][towers_1_and_2], expected[name][towers_1_and_2]), name


def _seeded_after_unseeded_model_fn(features, mode):
  """An op seed that is also the one the graph's seed counter gave an earlier op."""
  x = features['x']
  # On one device (and tower 0) the counter gives the unseeded op 0: nothing before the
  # model_fn asks it for an op seed. Towers 1 and 2 start counting after tower 0.
  unseeded = tf.random.uniform(tf.shape(x))
  seeded = tf.random.uniform(tf.shape(x), seed=0)
  return tf.estimator.EstimatorSpec(mode, predictions={'unseeded': unseeded, 'seeded': seeded})


def test_an_op_seed_equal_to_a_counted_one_draws_as_one_device():
  """Under a graph-level seed, an op seed the model_fn gives is the op's own, even where the
  graph's counter gave it to an earlier op (which tower 0 and one device had taken for the
  counter's, and towers 1 and 2 not: their counters start later)."""
  results = []
  for layout in (None, '3_towers'):
    graph = EstimatorGraph(_decorated(_seeded_after_unseeded_model_fn, layout),
                           _input_fn('dict', graph_seed=GRAPH_SEED), ModeKeys.PREDICT,
                           num_cpus=_num_cpus(layout))
    results.append(graph.run()[0])
    graph.close()
  _assert_all_close(results[1], results[0], '3_towers')


# --- TRAIN -----------------------------------------------------------------------------

def _train_model_fn(features, labels, mode, params):
  """The main kinds of draw in one model; `params['op_seeds']`: each op its own seed."""
  seed = (lambda s: s) if params['op_seeds'] else (lambda s: None)
  x = features['x'] if isinstance(features, dict) else features
  b = tf.shape(x)[0]
  x = tf.image.random_flip_left_right(x[..., None], seed=seed(1))[..., 0]
  flat = tf.reshape(x, [b, T * H])
  hidden = tf.nn.dropout(_dense(flat, 6, 1, tf.nn.tanh), rate=0.3, seed=seed(2))
  hidden = tf.keras.layers.GaussianNoise(0.5, seed=seed(3))(hidden, training=True)
  hidden = hidden * tf.random.uniform([], 0.5, 1.5, seed=seed(4))   # one scale per step
  out = _dense(hidden, CLASSES, 2)
  weights = tf.random.gamma([b], 2.0, seed=seed(5)) / 2.0
  if labels is None:   # features only: a reconstruction
    per_example = tf.reduce_sum(tf.square(out - flat[:, :CLASSES]), 1)
  else:
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=out)
  return _momentum_spec(mode, tf.reduce_mean(per_example * weights))


class _EachStep(tf.compat.v1.train.SessionRunHook):
  """Every global variable (slots included) after each step."""

  def __init__(self, variables: dict):
    self._variables = variables
    self.steps = []

  def after_run(self, run_context, run_values):
    del run_values
    self.steps.append(run_context.session.run(self._variables))


def _train(model_fn, layout=None, inputs='labels', graph_seed=None, params=None, x=None,
           random_draws=None):
  """Variables after steps 1 and 3 (batches of 10, 10, 2)."""
  graph = EstimatorGraph(_decorated(model_fn, layout, random_draws),
                         _input_fn(inputs, graph_seed, x), ModeKeys.TRAIN,
                         num_cpus=_num_cpus(layout), params=params)
  with graph.graph.as_default():
    each = _EachStep({v.op.name: v for v in tf.compat.v1.global_variables()})
  graph.hooks.append(each)
  try:
    assert graph.run() == 3
  finally:
    graph.close()
  return each.steps[0], each.steps[2]


# name -> (inputs, graph seed, op seeds)
TRAIN_CASES = {'graph_seed': ('labels', GRAPH_SEED, False),
               'op_seeds-features_a_dict': ('dict', None, True),
               'op_seeds-features_a_tensor': ('tensor', None, True)}


@functools.lru_cache(maxsize=None)
def _trained(case, layout=None):
  inputs, graph_seed, op_seeds = TRAIN_CASES[case]
  return _train(_train_model_fn, layout, inputs, graph_seed, {'op_seeds': op_seeds})


@pytest.mark.core_equivalence
@pytest.mark.parametrize('case,layout', [
    ('graph_seed', '3_towers'), ('graph_seed', '1x3'), ('graph_seed', '2x2'),
    ('op_seeds-features_a_dict', '3_towers'), ('op_seeds-features_a_tensor', '2x2')])
def test_training_draws_as_one_device(case, layout):
  """Flip, dropout, Gaussian noise, a scale per step and gamma weights, after 1 and 3 steps."""
  for actual, expected in zip(_trained(case, layout), _trained(case)):
    testlib.assert_variables_close(actual, expected)


def test_built_towers_draw_as_one_device(monkeypatch):
  """Towers built by calling the model_fn again (not copied from tower 0's ops) draw the same."""
  from estimator_towers import replicate  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(replicate, '_tower_copies', lambda *args: None)
  built = _train(_train_model_fn, '3_towers', 'labels', GRAPH_SEED, {'op_seeds': False})
  for actual, expected in zip(built, _trained('graph_seed')):
    testlib.assert_variables_close(actual, expected)


def _time_major_model_fn(features, labels, mode):
  x = tf.transpose(features['x'], [1, 0, 2])     # [T, B, H]
  x = tf.transpose(tf.nn.dropout(x, rate=0.5), [1, 0, 2])
  logits = _dense(tf.reshape(x, [-1, T * H]), CLASSES, 2)
  return _momentum_spec(mode, tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)))


def _mixup_model_fn(features, labels, mode):
  """Each example mixed with another of the batch (a shuffle), by a weight drawn per step."""
  b = tf.shape(features['x'])[0]
  hidden = _dense(tf.reshape(features['x'], [b, T * H]), 6, 1, tf.nn.tanh)
  onehot = tf.one_hot(labels, CLASSES)
  partner = tf.random.shuffle(tf.range(b))
  weight = tf.random.uniform([], 0.2, 0.8)
  mixed = weight * hidden + (1 - weight) * tf.gather(hidden, partner)
  targets = weight * onehot + (1 - weight) * tf.gather(onehot, partner)
  logits = _dense(mixed, CLASSES, 2)
  return _momentum_spec(mode, tf.reduce_mean(
      tf.nn.softmax_cross_entropy_with_logits(labels=targets, logits=logits)))


def _shuffled_rows_model_fn(features, labels, mode):
  """Mixup of the hidden rows themselves: the shuffle passes no gradient (as RandomShuffle)."""
  b = tf.shape(features['x'])[0]
  hidden = _dense(tf.reshape(features['x'], [b, T * H]), 6, 1, tf.nn.tanh)
  mixed = 0.7 * hidden + 0.3 * tf.random.shuffle(hidden)
  logits = _dense(mixed, CLASSES, 2)
  return _momentum_spec(mode, tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)))


# Draws of rows that a mixing op reads (a transpose, a gather by a shuffle's positions, the
# shuffle itself): the whole-batch head draws them, on the whole batch.
MIXING_MODELS = {'time_major_dropout': _time_major_model_fn, 'mixup_by_shuffle': _mixup_model_fn,
                 'shuffled_rows': _shuffled_rows_model_fn}


@functools.lru_cache(maxsize=None)
def _mixing_trained(name, layout=None):
  return _train(MIXING_MODELS[name], layout)


@pytest.mark.parametrize('layout', ['3_towers', '2x2'])
@pytest.mark.parametrize('name', sorted(MIXING_MODELS))
def test_draws_the_batch_mixes_train_as_one_device(name, layout):
  for actual, expected in zip(_mixing_trained(name, layout), _mixing_trained(name)):
    testlib.assert_variables_close(actual, expected)


# --- EVAL: Monte-Carlo dropout -----------------------------------------------------------

def _mc_dropout_model_fn(features, labels, mode):
  """Dropout in every mode (Monte-Carlo dropout); EVAL's metrics read the dropped out logits."""
  b = tf.shape(features['x'])[0]
  hidden = tf.nn.dropout(_dense(tf.reshape(features['x'], [b, T * H]), 8, 1, tf.nn.tanh), 0.5)
  logits = _dense(hidden, CLASSES, 2)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  probabilities = tf.nn.softmax(logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
      'accuracy': tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1)),
      'mean_probability': tf.compat.v1.metrics.mean(probabilities),
      'auc': tf.compat.v1.metrics.auc(tf.equal(labels, 0), probabilities[:, 0])})


def _evaluate(layout=None):
  graph = EstimatorGraph(_decorated(_mc_dropout_model_fn, layout), _input_fn(), ModeKeys.EVAL,
                         num_cpus=_num_cpus(layout))
  try:
    return graph.run()
  finally:
    graph.close()


def test_monte_carlo_dropout_evaluates_as_one_device():
  _assert_all_close(_evaluate('3_towers'), _evaluate(), '3_towers')


def _static_reshape_predicted(layout=None):
  """Dropout of a reshape to the shard's static batch size (BERT's `get_shape_list`)."""
  def model_fn(features, mode):
    x = features['x']
    flat = tf.reshape(x, [x.shape[0], T * H])   # the static batch size, a Python int
    return tf.estimator.EstimatorSpec(mode, predictions={'dropout': tf.nn.dropout(flat, 0.5)})
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    spec = _decorated(model_fn, layout)({'x': tf.constant(_data()[0][:BATCH])}, None,
                                        ModeKeys.PREDICT, None, None)
    config = tf.compat.v1.ConfigProto(device_count={'CPU': _num_cpus(layout)})
    with tf.compat.v1.Session(config=config) as session:
      return session.run(spec.predictions['dropout'])


def test_a_draw_of_a_static_batch_size_predicts_as_one_device():
  """A static batch: the shard's size in a reshape is a constant, which the draw's reader must
  know for the shard's size (before: mixing, each tower drew rows 0..n of one draw)."""
  testlib.assert_close(_static_reshape_predicted('3_towers'), _static_reshape_predicted())


# --- An in-batch softmax with dropout before the embeddings, in micro-batches ------------

def _in_batch_softmax_model_fn(features, labels, mode):
  loss, _ = patterns.dropout_before_the_cut(features['x'], labels)
  return _momentum_spec(mode, loss)


def _embeddings_input():
  return np.random.RandomState(3).randn(NUM_EXAMPLES, patterns.F).astype(np.float32)


@functools.lru_cache(maxsize=None)
def _in_batch_softmax(layout=None):
  return _train(_in_batch_softmax_model_fn, layout, x=_embeddings_input())


@pytest.mark.parametrize('layout', ['3_towers', '1x2', '2x2'])
def test_in_batch_softmax_with_dropout_before_the_embeddings_trains_as_one_device(layout):
  for actual, expected in zip(_in_batch_softmax(layout), _in_batch_softmax()):
    testlib.assert_variables_close(actual, expected)


def test_in_batch_softmax_with_dropout_drawn_per_shard_is_refused_in_micro_batches():
  with pytest.raises(ValueError, match=r"micro_batches > 1 cannot train the loss .* exactly: "
                                       r"it mixes the batch's rows.*through the stateful op "
                                       r".*RandomUniform \(RandomUniform\)"):
    _train(_in_batch_softmax_model_fn, '2x2', x=_embeddings_input(), random_draws='per_shard')


# --- Refusals ------------------------------------------------------------------------------

def _build(draw):
  """The towered PREDICT graph of a model_fn that returns `draw(x)` (built, not run)."""
  def model_fn(features, mode):
    return tf.estimator.EstimatorSpec(mode, predictions={'draw': draw(features['x'])})
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    x = tf.compat.v1.placeholder_with_default(_data()[0][:BATCH], [None, T, H])
    _decorated(model_fn, '3_towers')({'x': x}, None, ModeKeys.PREDICT, None, None)


_FIX = r"Fix: .*; or set random_draws='per_shard'"


def test_error_a_random_op_in_a_tf_function():
  @tf.function
  def noisy(y):
    return y + tf.random.normal(tf.shape(y))
  with pytest.raises(ValueError, match=r'the random op random_standard_normal .* cannot be: it '
                                       r'is built inside a function body.*' + _FIX):
    _build(noisy)


def test_error_a_random_generator():
  def draw(x):
    return tf.random.Generator.from_seed(1).normal(tf.shape(x))
  with pytest.raises(ValueError, match=r'cannot be: a tf.random.Generator draws from the state '
                                       r'of a variable.*' + _FIX):
    _build(draw)


def test_error_a_poisson_draw_of_batch_rows():
  def draw(x):
    return tf.random.poisson(tf.shape(x)[:1], 3.0)
  with pytest.raises(ValueError, match=r'the random op random_poisson_v2 .* cannot be: a '
                                       r'Poisson draw has no counter to set by the example, and '
                                       r'this one has the batch\'s rows.*' + _FIX):
    _build(draw)


def test_error_a_gamma_draw_of_alpha_of_batch_rows():
  def draw(x):
    return tf.random.gamma([2], tf.abs(x) + 1.0)
  with pytest.raises(ValueError, match=r'the random op random_gamma .* cannot be: its alpha has '
                                       r'the batch\'s rows.*' + _FIX):
    _build(draw)


def test_error_dropout_of_flat_rows_of_data_dependent_counts():
  def draw(x):
    kept = tf.boolean_mask(x, x[..., 0] > 0)    # [tokens, H]: a count per example by value
    return tf.reduce_sum(tf.nn.dropout(kept, rate=0.5)) + tf.zeros(tf.shape(x)[:1])
  with pytest.raises(ValueError, match=r'cannot be: its shape is that of flat rows whose count '
                                       r'per example only the values decide.*' + _FIX):
    _build(draw)


def test_error_an_unknown_random_draws_setting():
  with pytest.raises(ValueError, match=r"random_draws must be one of \('keyed', 'per_shard'\), "
                                       r"got 'bogus': use \"keyed\""):
    et.replicate_model_fn(_draws_model_fn, devices=['/cpu:0'], random_draws='bogus')


def test_error_a_draw_of_a_mixed_shape_in_a_towered_predict():
  def draw(x):
    pairs = tf.matmul(x[:, 0, :], x[:, 0, :], transpose_b=True)   # [B, B]: mixes the rows
    return tf.reduce_sum(tf.nn.dropout(pairs, rate=0.5), -1)
  with pytest.raises(ValueError, match=r'cannot be: its shape \(.*\) depends on the batch in a '
                                       r'way the library cannot follow \(mixed\), and in PREDICT '
                                       r'each tower draws its own shard.*' + _FIX):
    _build(draw)


def test_error_dropout_of_a_sparse_tensors_entries():
  """A SparseTensor's entries are flat rows whose count per example only the values decide."""
  def model_fn(features, mode):
    values = features['ids'].values                    # a SparseTensor's entries: flat rows
    flat = tf.reshape(tf.tile(tf.cast(values, tf.float32)[:, None], [1, 2]), [-1, 2])
    noise = tf.nn.dropout(tf.ones_like(flat), rate=0.5)
    return tf.estimator.EstimatorSpec(mode, predictions={'n': tf.reduce_sum(noise) + 0.0 * tf.zeros(
        tf.shape(features['ids'])[:1])})
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    ids = tf.sparse.from_dense(tf.constant([[1, 0], [2, 3], [0, 4]], tf.int64))
    with pytest.raises(ValueError, match=r'cannot be: its shape is that of flat rows whose count '
                                         r'per example only the values decide.*' + _FIX):
      _decorated(model_fn, '3_towers')({'ids': ids}, None, ModeKeys.PREDICT, None, None)


def test_a_candidate_sampler_warns_that_its_stream_restarts(monkeypatch):
  warnings = testlib.logged_warnings(monkeypatch)

  def model_fn(features, mode):
    ids = tf.cast(tf.abs(features['x'][:, 0, :1]) * 10, tf.int64)
    sampled, _, _ = tf.random.log_uniform_candidate_sampler(ids, 1, 5, True, 50)
    return tf.estimator.EstimatorSpec(mode, predictions={
        'ids': ids[:, 0] + 0 * tf.reduce_sum(sampled)})
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    x = tf.compat.v1.placeholder_with_default(_data()[0][:BATCH], [None, T, H])
    _decorated(model_fn, '3_towers')({'x': x}, None, ModeKeys.PREDICT, None, None)
  assert any('the candidate sampler log_uniform_candidate_sampler draws the same candidates on '
             'every tower' in w and 'restarts with each session' in w for w in warnings), warnings


def _random_normaliser_model_fn(features, labels, mode):
  """sum(l * w) / sum(w) of random weights: a normaliser made of draws, not a count."""
  logits = tf.compat.v1.layers.dense(tf.reduce_mean(features['x'], 1), 3,
                                     kernel_initializer=tf.compat.v1.constant_initializer(0.1))
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  w = tf.random.uniform(tf.shape(xent), 0.5, 1.5)
  loss = tf.reduce_sum(xent * w) / tf.reduce_sum(w)
  train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.mark.parametrize('layout', ['3_towers', '1x2', '2x2'])
def test_a_normaliser_of_random_weights_trains_as_one_device(layout):
  for actual, expected in zip(_train(_random_normaliser_model_fn, layout),
                              _train(_random_normaliser_model_fn)):
    testlib.assert_variables_close(actual, expected)


def test_error_a_stateless_draw_of_another_algorithm():
  def draw(x):
    return tf.random.stateless_uniform(tf.shape(x), seed=[1, 2], alg='threefry')
  with pytest.raises(ValueError, match=r'the random op stateless_random_uniform_v2 .* cannot be: '
                                       r'its algorithm is not Philox.*' + _FIX):
    _build(draw)
