"""A train() that resumes from a checkpoint reads its input where the checkpoint left off.

The checkpoint holds the training input's position (`estimator_towers/inputs/position.py`):
tf.data's state of the library's iterator and the global batches staged on the devices but
not yet consumed. So training in several `train()` calls, each a new graph and session
restored from the previous call's checkpoint, must equal ONE uninterrupted call on the same
input_fn: the reference is the model_fn decorated for one device
(`replicate_model_fn(model_fn, devices=['/cpu:0'])`) trained in one call, checkpointed at
every step; every variable and optimizer slot is compared within 1e-5 (testlib's rule), and
bit for bit where every call so far ran on the reference's topology (one device, or 3 towers
against a one-call run of 3 towers, staged or not).

The input is a seeded `shuffle(23) + repeat() + batch(5)`: a batch straddles each epoch
boundary, each epoch is shuffled anew, and the calls stop at global steps 2, 4, 6, 9 and 11
(10, 20, 30, 45 and 55 examples: never an epoch boundary), so a resume that restarted the
input, skipped a batch or lost the shuffle's state (seed, buffer, epoch) would show. Checked:
- chains of train() calls on one layout and across layouts: 1 device; 3 towers then
  2 devices x 2 micro-batches; staged_input_fn depth 2, then unstaged 3 towers, then depth 1
  (the staged batches are saved and replayed, whatever the next call's staging);
- a features-only dataset (no labels, a model_fn without a labels argument), staged and not;
- a model with dropout (keyed random draws) and Momentum's slots: the draws and the input
  continue together;
- an unseeded shuffle (no run is a reference): over two calls to the end of one epoch, every
  example trained exactly once;
- evaluate() and predict() after a partial train() read from the first element (numpy of the
  checkpoint's variables on the dataset's first batches), and do not move the training input;
- one WARNING at graph construction for an input the library cannot position (a generator,
  a tf.py_function, a stateful random op in a map, tensors from a one-shot iterator or a
  queue), which still trains and saves no position; none for a stateless random map (which
  is positioned) or constants (the same batch every step);
- a checkpoint without a position, or of another dataset (another batch size): one WARNING,
  and the input starts from its first element (the plain model_fn's two calls are the
  reference); a model_fn bringing its own Saver: one WARNING, and no position saved.
Every test here fails with resume_input=False (the old behaviour: every call reads its input
from the first element, and no warning is given). That a deep position restores as fast as a
shallow one is bench/'s to measure, not a test's.
"""

import functools
import itertools
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import testlib
import estimator_towers as et

NUM_EXAMPLES, BATCH = 23, 5
SHUFFLE_SEED = 11
STOPS = (2, 4, 6, 9, 11)   # where train() calls stop: 10, 20, 30, 45, 55 examples
X, Y = testlib.data(NUM_EXAMPLES, seed=5)
# name: (devices, micro_batches, staging_depth)
LAYOUTS = {'1 device': (1, 1, 0), '3 towers': (3, 1, 0), '2x2': (2, 2, 0),
           'staged 1': (3, 1, 1), 'staged 2': (3, 1, 2)}
THREE_TOWERS = {'3 towers', 'staged 1', 'staged 2'}   # one topology: bit-equal runs
DROPOUT_SEED = 7   # the graph's seed (RunConfig's tf_random_seed), which keys the draws
POSITION_KEY = testlib.POSITION_PREFIX + 'iterator'


def _input_fn(batch=BATCH, features_only=False):
  def fn():
    data = {'x': X, 'y': Y} if features_only else ({'x': X}, Y)
    return tf.data.Dataset.from_tensor_slices(data).shuffle(
        NUM_EXAMPLES, seed=SHUFFLE_SEED).repeat().batch(batch)
  return fn


def _features_only_model_fn(features, mode, params):
  """testlib.v1_model_fn, its labels read from the features (Estimator passes none)."""
  return testlib.v1_model_fn(features, features['y'], mode, params)


def _dropout_model_fn(features, labels, mode):
  """Dropout of the inputs and of the hidden layer, and Momentum (slots)."""
  x = tf.nn.dropout(features['x'], rate=0.3)
  hidden = tf.compat.v1.layers.dense(
      x, 4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  logits = tf.compat.v1.layers.dense(
      tf.nn.dropout(hidden, rate=0.5), testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


MODELS = {  # name: (model_fn, input_fn, params, RunConfig arguments, stops of its calls)
    'v1': (testlib.v1_model_fn, _input_fn(), None, {}, STOPS),
    'features only': (_features_only_model_fn, _input_fn(features_only=True), None, {},
                      STOPS[:3]),
    'dropout': (_dropout_model_fn, _input_fn(), None, {'tf_random_seed': DROPOUT_SEED},
                STOPS[:2]),
}


def _estimator(model, layout, model_dir=None, resume_input=True, stepwise=False):
  """The decorated model_fn of `layout`, and the input_fn it trains on (staged or not)."""
  model_fn, input_fn, params, config, _ = MODELS[model]
  devices, micro_batches, depth = LAYOUTS[layout]
  plan = et.make_plan(devices=testlib.cpu_devices(devices), micro_batches=micro_batches,
                      staging_depth=depth, resume_input=resume_input)
  make = testlib.stepwise_estimator if stepwise else testlib.make_estimator
  estimator = make(et.replicate_model_fn(model_fn, plan=plan), devices, model_dir,
                   params=params, **config)
  return estimator, et.staged_input_fn(input_fn, plan)


@functools.lru_cache(maxsize=None)
def _one_call(model, layout='1 device'):
  """{step: variables} of ONE train() call to the model's last stop, read at its stops; and
  its model_dir."""
  estimator, input_fn = _estimator(model, layout, stepwise=True)
  stops = MODELS[model][-1]
  by_step = dict(zip(stops, testlib.train_and_read(estimator, input_fn, at=stops)))
  return by_step, estimator.model_dir


def _checkpoint_copy(model_dir, step):
  """A new model_dir holding a copy of `model_dir`'s checkpoint of global step `step`."""
  target = tempfile.mkdtemp(prefix='et_')
  checkpoint = os.path.join(model_dir, f'model.ckpt-{step}')
  for path in tf.io.gfile.glob(checkpoint + '.*'):
    shutil.copy(path, target)
  tf.compat.v1.train.update_checkpoint_state(target, os.path.join(target, f'model.ckpt-{step}'))
  return target


def _assert_like_one_call(model, calls, model_dir, actual, step):
  """The variables after the calls so far equal the one-call reference's at `step`: bit for
  bit after a resume on the reference's topology throughout."""
  where = f'after the train() calls {calls} (to step {step})'
  try:
    testlib.assert_variables_close(actual, _one_call(model)[0][step])
    if len(calls) > 1 and (set(calls) <= THREE_TOWERS or set(calls) == {'1 device'}):
      layout = '1 device' if set(calls) == {'1 device'} else '3 towers'
      testlib.assert_variables_close(actual, _one_call(model, layout)[0][step], tol=0)
  except AssertionError as e:
    raise AssertionError(f'{where} in {model_dir}: {e}') from None


def _check_chain(model, layouts):
  """train() calls to the stops, one a layout, each a new Estimator on one model_dir."""
  model_dir = tempfile.mkdtemp(prefix='et_')
  for call, (layout, stop) in enumerate(zip(layouts, STOPS)):
    estimator, input_fn = _estimator(model, layout, model_dir)
    estimator.train(input_fn, max_steps=stop)
    actual = testlib.variables(estimator)
    assert actual['global_step'] == stop
    _assert_like_one_call(model, layouts[:call + 1], model_dir, actual, stop)


@pytest.mark.parametrize('layouts', [
    ('1 device', '1 device'),
    ('3 towers', '3 towers', '2x2', '2x2'),
    ('staged 2', 'staged 2', '3 towers', 'staged 1', 'staged 1'),
], ids=' then '.join)
def test_train_calls_equal_one_call(layouts):
  """Each call resumes the previous one's checkpoint: on its layout, or on another one (the
  position counts global batches, which any layout splits after reading)."""
  _check_chain('v1', layouts)


def test_features_only_input_resumes():
  """A dataset of feature dicts (labels None) and a model_fn without labels: unstaged on
  2 devices x 2 micro-batches, then staged (depth 1, 3 towers) twice."""
  _check_chain('features only', ('2x2', 'staged 1', 'staged 1'))


def test_dropout_and_input_resume_together():
  """Dropout masks are keyed by the global step and the example's place in the global
  batch, so they continue with the restored step while the input continues with its
  position: 3 towers, then 2 devices x 2 micro-batches, equal one call of one device."""
  _check_chain('dropout', ('3 towers', '2x2'))


def _counting_model_fn(features, labels, mode):
  """One SGD step (learning rate 1) adds 1 to `counts[id]` for every example id it trains."""
  del labels
  counts = tf.compat.v1.get_variable('counts', [NUM_EXAMPLES],
                                     initializer=tf.compat.v1.zeros_initializer())
  loss = -tf.reduce_sum(counts * tf.one_hot(features['id'], NUM_EXAMPLES))
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(1.0)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def test_an_unseeded_shuffle_resumes_its_own_order():
  """One epoch of an unseeded shuffle (its order random in each run, so no other run is a
  reference), staged at depth 2 on 3 towers: train(steps=2), then train() to the end of the
  input. The checkpoint holds the shuffle's seeds and buffer, so every id is trained exactly
  once (a restarted input would train the first call's ids again and miss others)."""
  plan = et.make_plan(devices=testlib.cpu_devices(3), loss_reduction='sum', staging_depth=2)
  estimator = testlib.make_estimator(et.replicate_model_fn(_counting_model_fn, plan=plan),
                                     num_cpus=3)

  def input_fn():
    ids = np.arange(NUM_EXAMPLES, dtype=np.int32)
    return tf.data.Dataset.from_tensor_slices(({'id': ids}, ids)).shuffle(
        NUM_EXAMPLES).batch(BATCH)

  staged = et.staged_input_fn(input_fn, plan)
  estimator.train(staged, steps=2)
  estimator.train(staged)
  np.testing.assert_array_equal(estimator.get_variable_value('counts'), np.ones(NUM_EXAMPLES))
  assert estimator.get_variable_value('global_step') == -(-NUM_EXAMPLES // BATCH)


def _first_batches(count):
  """The dataset's first `count` batches, read by tf.data alone (eagerly)."""
  return list(_input_fn()().take(count).as_numpy_iterator())


def _logits(variables, x):
  hidden = np.tanh(x @ variables['dense/kernel'] + variables['dense/bias'])
  return hidden @ variables['dense_1/kernel'] + variables['dense_1/bias']


def test_evaluate_and_predict_after_a_partial_train_read_from_the_first_element():
  """train() to step 2, evaluate() and predict() (their own graphs: no position) on the same
  input_fn, then train() to step 4: the evaluation and the predictions are those of the
  checkpoint's variables on the dataset's first batches, and the training goes on where the
  first call stopped."""
  model_dir = tempfile.mkdtemp(prefix='et_')
  estimator, input_fn = _estimator('v1', '1 device', model_dir)
  estimator.train(input_fn, max_steps=STOPS[0])
  trained = testlib.variables(estimator)
  _assert_like_one_call('v1', ('1 device',), model_dir, trained, STOPS[0])
  (x0, y0), (x1, y1) = [(features['x'], labels) for features, labels in _first_batches(2)]

  metrics = estimator.evaluate(input_fn, steps=2)
  losses = []
  for x, y in ((x0, y0), (x1, y1)):
    logits = _logits(trained, x)
    logits -= logits.max(1, keepdims=True)
    losses.append(np.mean(np.log(np.exp(logits).sum(1)) - logits[np.arange(len(y)), y]))
  testlib.assert_close(metrics['loss'], np.mean(losses), err_msg='evaluation loss')
  predicted = [p['logits'] for p in itertools.islice(
      estimator.predict(input_fn, yield_single_examples=True), 2 * BATCH)]
  testlib.assert_close(np.stack(predicted), _logits(trained, np.concatenate([x0, x1])),
                       err_msg='predicted logits')

  estimator.train(input_fn, max_steps=STOPS[1])
  _assert_like_one_call('v1', ('1 device', '1 device'), model_dir,
                        testlib.variables(estimator), STOPS[1])


# --- What cannot be positioned: one warning, and the first element -----------------------


def _map(function):
  def fn():
    dataset = tf.data.Dataset.from_tensor_slices(({'x': X}, Y))
    return dataset.map(lambda features, y: ({'x': function(features['x'])}, y)).batch(BATCH)
  return fn


def _generator():
  def fn():
    def examples():
      yield from zip(X, Y)
    return tf.data.Dataset.from_generator(examples, output_signature=(
        tf.TensorSpec([testlib.NUM_FEATURES], tf.float32), tf.TensorSpec([], tf.int32))
    ).map(lambda x, y: ({'x': x}, y)).batch(BATCH)
  return fn


def _one_shot_tensors():
  dataset = tf.data.Dataset.from_tensor_slices(({'x': X}, Y)).repeat().batch(BATCH)
  return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _constant_tensors():
  return {'x': tf.constant(X[:BATCH])}, tf.constant(Y[:BATCH])


UNPOSITIONED = {  # name: (input_fn, what the warning names)
    'generator': (_generator(), 'Dataset.from_generator'),
    'py_function': (_map(lambda x: tf.ensure_shape(
        tf.py_function(lambda v: v, [x], tf.float32), x.shape)), 'tf.py_function'),
    'stateful random map': (_map(lambda x: x + tf.random.uniform(tf.shape(x), seed=1)),
                            'RandomUniform (a stateful op'),
    'one-shot iterator': (_one_shot_tensors, 'not made by Estimator'),
    'queue': (tf.compat.v1.estimator.inputs.numpy_input_fn(
        {'x': X}, Y, batch_size=BATCH, shuffle=False, num_epochs=None),
              'the input_fn returns tensors'),
    'constants': (_constant_tensors, ''),  # the same batch at every step: nothing to position
    'stateless random map': (_map(lambda x: x + tf.random.stateless_uniform(
        tf.shape(x), seed=[1, 2])), None),
}


def _position_warnings(found, about='cannot be positioned'):
  return [w for w in found if about in w]


@pytest.mark.parametrize('name', sorted(UNPOSITIONED))
def test_an_input_that_cannot_be_positioned_warns_once_and_trains(name, monkeypatch):
  """One WARNING naming what holds state outside the checkpoint; training works and the
  checkpoint has no position. A stateless random map is positioned, without a warning;
  constants (the same batch at every step) need no position and get no warning."""
  input_fn, named = UNPOSITIONED[name]
  found = testlib.logged_warnings(monkeypatch)
  estimator = testlib.make_estimator(et.replicate_model_fn(testlib.v1_model_fn,
                                                           devices=['/cpu:0']))
  estimator.train(input_fn, max_steps=2)
  assert estimator.get_variable_value('global_step') == 2
  warnings = _position_warnings(found)
  keys = estimator.get_variable_names()
  if not named:
    assert not warnings, warnings
    assert (POSITION_KEY in keys) == (named is None), keys
    return
  assert len(warnings) == 1 and named in warnings[0], found
  assert POSITION_KEY not in keys, keys


@functools.lru_cache(maxsize=None)
def _plain_restarted(batch):
  """The plain model_fn (whose every train() call reads from the first element): to the first
  stop, then to the second on batches of `batch`."""
  first = testlib.make_estimator(testlib.v1_model_fn)
  first.train(_input_fn(), max_steps=STOPS[0])
  second = testlib.make_estimator(testlib.v1_model_fn,
                                  model_dir=_checkpoint_copy(first.model_dir, STOPS[0]))
  second.train(_input_fn(batch), max_steps=STOPS[1])
  return testlib.variables(second)


@pytest.mark.parametrize('case', ['no position', 'another batch size'])
def test_a_checkpoint_without_this_input_s_position_starts_from_the_first_element(
    case, monkeypatch):
  """A checkpoint written with resume_input=False, or one whose position is of another
  dataset (batches of 4 now, 5 then: tf.data would go on with the old pipeline): one WARNING
  at the restore, the variables restored, and the input read from its first element."""
  if case == 'no position':
    model_dir = tempfile.mkdtemp(prefix='et_')
    estimator, input_fn = _estimator('v1', '1 device', model_dir, resume_input=False)
    estimator.train(input_fn, max_steps=STOPS[0])
    assert POSITION_KEY not in estimator.get_variable_names()
    batch, reason = BATCH, 'holds no input position'
  else:
    model_dir = _checkpoint_copy(_one_call('v1')[1], STOPS[0])
    batch, reason = 4, 'not the one the checkpoint was written with'
  found = testlib.logged_warnings(monkeypatch)
  estimator = testlib.make_estimator(
      et.replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0']), model_dir=model_dir)
  estimator.train(_input_fn(batch), max_steps=STOPS[1])
  warnings = _position_warnings(found, 'without the input position')
  assert len(warnings) == 1 and reason in warnings[0], found
  testlib.assert_variables_close(testlib.variables(estimator), _plain_restarted(batch))


def test_a_model_fn_with_its_own_saver_warns_that_the_position_is_not_saved(monkeypatch):
  def model_fn(features, labels, mode, params):
    spec = testlib.v1_model_fn(features, labels, mode, params)
    return spec._replace(scaffold=tf.compat.v1.train.Scaffold(
        saver=tf.compat.v1.train.Saver(sharded=True)))

  found = testlib.logged_warnings(monkeypatch)
  estimator = testlib.make_estimator(et.replicate_model_fn(model_fn, devices=['/cpu:0']))
  estimator.train(_input_fn(), max_steps=2)
  warnings = _position_warnings(found, 'position is not saved')
  assert len(warnings) == 1 and 'brings its own Saver' in warnings[0], found
  assert estimator.get_variable_value('global_step') == 2
  assert POSITION_KEY not in estimator.get_variable_names()


class _CopiesACheckpointIn(tf.compat.v1.train.SessionRunHook):
  """Copies `source`'s latest checkpoint into `model_dir` after the graph is built."""

  def __init__(self, source, model_dir):
    self._source, self._model_dir = source, model_dir

  def begin(self):
    latest = tf.train.latest_checkpoint(self._source)
    for name in tf.io.gfile.glob(latest + '*'):
      shutil.copy(name, self._model_dir)
    shutil.copy(os.path.join(self._source, 'checkpoint'), self._model_dir)


def test_error_a_checkpoint_without_a_position_appears_after_the_graph_is_built():
  """The graph looked for a checkpoint to restore when it was built (to build a Saver of the
  variables alone only when it needs one); a key-less checkpoint that appears later is an
  error naming the fix, not a crash in RestoreV2."""
  plain = testlib.make_estimator(testlib.v1_model_fn)
  plain.train(_input_fn(), max_steps=1)
  towered = testlib.make_estimator(et.replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0']))
  with pytest.raises(RuntimeError, match='appeared after this training graph was built'):
    towered.train(_input_fn(), max_steps=2,
                  hooks=[_CopiesACheckpointIn(plain.model_dir, towered.model_dir)])
  towered.train(_input_fn(), max_steps=2)  # the next graph restores the variables alone
  assert towered.get_variable_value('global_step') == 2


@pytest.mark.parametrize('layout', ['1 device', 'staged 2'])
def test_a_resume_logs_once_what_it_restored(layout, monkeypatch):
  """One INFO line at the restore: the checkpoint, its step, the position's step and where
  the input reads on (the staged batches it holds first), read here from the checkpoint."""
  from estimator_towers.base import logs  # pylint: disable=g-import-not-at-top
  model_dir = tempfile.mkdtemp(prefix='et_')
  estimator, input_fn = _estimator('v1', layout, model_dir)
  estimator.train(input_fn, max_steps=STOPS[0])
  checkpoint = tf.train.latest_checkpoint(model_dir)
  pending = tf.train.load_checkpoint(checkpoint).get_variable_to_shape_map()[
      testlib.POSITION_PREFIX + 'pending'][0]
  assert pending == LAYOUTS[layout][2]
  said = []
  monkeypatch.setattr(logs, 'info', lambda fmt, *a: said.append(fmt % a))
  estimator, input_fn = _estimator('v1', layout, model_dir)
  estimator.train(input_fn, max_steps=STOPS[1])
  staged = f', its {pending} staged global batch(es) first' if pending else ''
  expected = (f'estimator_towers: resumed training from {checkpoint} (global step {STOPS[0]}) '
              f'with the input position of step {STOPS[0]}: the input reads on after the '
              f'global batch of step {STOPS[0]}{staged}.')
  assert [m for m in said if 'resumed' in m] == [expected], said
