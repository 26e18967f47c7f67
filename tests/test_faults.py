"""An input pipeline error always surfaces as that error; never as the end of input.

The dataset has three batches (11, 11 and 7 examples: the last is smaller than
8 towers). One batch (first, middle or last) carries a NaN that
`tf.debugging.check_numerics(..., 'injected fault')` in the pipeline turns into
an InvalidArgumentError. The plain Estimator raises it in every mode; towered,
staged or not, with every backend and depth, 3 and 8 towers, train, evaluate
and predict must raise it too, 20 times out of 20: a run that stops early
without an error, returns fewer predictions or reports metrics would be the
input failure passing for the end of the data (an intermittent race, hence the
repeats). The removed multi_device_iterator backend failed here: with 8 towers
and depth 1, the fault in the last batch passed silently in 14 of 20 training
runs. `test_batch_size_check_is_raised_every_time` does the same for the
library's own run-time batch-size check.

20 repeats of 3 positions in 3 modes and every configuration are too many for
full Estimator calls (~2 s each), so each configuration's graph is built once,
exactly as Estimator builds it, and run by `estimator_graph.EstimatorGraph`
through MonitoredSession as Estimator runs it (hooks, session creation,
OutOfRangeError taken as the end of input); the fault's position is a variable
read by the pipeline. `test_estimator_raises_the_input_error` checks the same
with Estimator itself, and every configuration also runs without a fault and
must then consume all 29 examples (so the harness would notice a run that ends
early).
"""

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_graph import EstimatorGraph
from estimator_towers import make_plan
from estimator_towers import replicate_model_fn
from estimator_towers import staged_input_fn
from estimator_towers.inputs import staging

ModeKeys = tf.estimator.ModeKeys
NUM_EXAMPLES, BATCH = 29, 11  # Batches of 11, 11 and 7.
NUM_BATCHES = 3
REPEATS = 20
MESSAGE = 'injected fault'
CONFIGS = [('unstaged', 0)] + [(backend, depth) for backend in sorted(staging.BACKENDS)
                               for depth in (1, 2)]


def model_fn(features, labels, mode):
  """A linear model; predictions and an eval metric carry the example ids."""
  weights = tf.compat.v1.get_variable('w', [3, 1],
                                      initializer=tf.compat.v1.zeros_initializer())
  outputs = tf.matmul(features['x'], weights)[:, 0]
  if mode == ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'id': features['id'], 'y': outputs})
  loss = tf.reduce_sum(tf.square(outputs - labels))
  if mode == ModeKeys.EVAL:
    ones = tf.ones_like(outputs, tf.bool)
    seen = tf.compat.v1.metrics.true_positives(ones, ones)  # examples evaluated
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={'seen': seen})
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.01)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss,
      train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


class FaultyInput:
  """An input_fn whose batch number `fault` (a variable; -1: none) holds a NaN."""

  def __init__(self, fixed_fault=None):
    self._fixed = fixed_fault
    self._set = None

  def __call__(self):
    if self._fixed is None:
      fault = tf.compat.v1.Variable(-1, collections=[], trainable=False, use_resource=True,
                                    dtype=tf.int64, name='fault')
      self._value = tf.compat.v1.placeholder(tf.int64, [])
      self._set = fault.assign(self._value)
    else:
      fault = tf.constant(self._fixed, tf.int64)
    ids = np.arange(NUM_EXAMPLES, dtype=np.int32)
    x = np.ones((NUM_EXAMPLES, 3), np.float32)
    dataset = tf.data.Dataset.from_tensor_slices(
        ({'id': ids, 'x': x}, np.zeros(NUM_EXAMPLES, np.float32))).batch(BATCH)

    def inject(index, element):
      features, labels = element
      nan = tf.where(tf.equal(index, tf.convert_to_tensor(fault)), np.nan, 0.0)
      x = tf.debugging.check_numerics(features['x'] + nan, MESSAGE)
      return {'id': features['id'], 'x': x}, labels

    return dataset.enumerate().map(inject)

  def set_fault(self, session, batch: int) -> None:
    session.run(self._set, {self._value: batch})


def towered(num_towers, backend, depth):
  plan = make_plan(devices=testlib.cpu_devices(num_towers), loss_reduction='sum',
                   staging_depth=depth,
                   staging_backend='staging_area' if backend == 'unstaged' else backend)
  return replicate_model_fn(model_fn, plan=plan), plan


def consumed(mode, result):
  """Examples processed by a run: train returns steps, evaluate metrics, predict batches."""
  if mode == ModeKeys.TRAIN:
    return result
  if mode == ModeKeys.EVAL:
    return result['seen']
  return sorted(i for batch in result for i in batch['id'])


@pytest.mark.timeout(240)
@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT])
@pytest.mark.parametrize('backend,depth', CONFIGS)
@pytest.mark.parametrize('num_towers', [3, 8])
def test_input_error_is_raised_every_time(num_towers, backend, depth, mode):
  model, plan = towered(num_towers, backend, depth)
  inputs = FaultyInput()
  graph = EstimatorGraph(model, staged_input_fn(inputs, plan), mode, num_cpus=num_towers)
  try:
    silent = {}
    for batch in range(NUM_BATCHES):
      inputs.set_fault(graph.session, batch)
      for _ in range(REPEATS):
        try:
          result = graph.run()
        except tf.errors.InvalidArgumentError as e:
          assert MESSAGE in e.message, e.message
        else:
          silent.setdefault(batch, []).append(consumed(mode, result))
    assert not silent, f'input error passed silently (batch: what the run consumed): {silent}'
    inputs.set_fault(graph.session, -1)  # No fault: the whole dataset.
    expected = {ModeKeys.TRAIN: NUM_BATCHES, ModeKeys.EVAL: NUM_EXAMPLES,
                ModeKeys.PREDICT: list(range(NUM_EXAMPLES))}[mode]
    assert consumed(mode, graph.run()) == expected
  finally:
    graph.close()


def mismatched_input_fn():
  """Feature 'extra' has one row more than the others in the last batch (7 vs 8)."""
  ids = np.arange(NUM_EXAMPLES, dtype=np.int32)
  features = tf.data.Dataset.from_tensor_slices(
      {'id': ids, 'x': np.ones((NUM_EXAMPLES, 3), np.float32)}).batch(BATCH)
  extra = tf.data.Dataset.from_tensor_slices(np.zeros(NUM_EXAMPLES + 1, np.float32)).batch(BATCH)
  labels = tf.data.Dataset.from_tensor_slices(np.zeros(NUM_EXAMPLES, np.float32)).batch(BATCH)
  return tf.data.Dataset.zip((features, extra, labels)).map(
      lambda f, e, l: (dict(f, extra=e), l))


@pytest.mark.timeout(240)
@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL, ModeKeys.PREDICT])
@pytest.mark.parametrize('backend,depth', CONFIGS)
def test_batch_size_check_is_raised_every_time(backend, depth, mode):
  """The library's own run-time check (staged: in the put) fails like an input error."""
  model, plan = towered(8, backend, depth)
  graph = EstimatorGraph(model, staged_input_fn(mismatched_input_fn, plan), mode, num_cpus=8)
  try:
    for _ in range(REPEATS):
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match='must have the same batch size') as raised:
        graph.run()
      assert 'extra' in raised.value.message
  finally:
    graph.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize('backend', sorted(staging.BACKENDS))
def test_estimator_raises_the_input_error(backend):
  """Estimator itself, 8 towers, depth 2, the fault in the last batch."""
  model, plan = towered(8, backend, 2)
  est = testlib.make_estimator(model, num_cpus=8)
  fn = staged_input_fn(FaultyInput(fixed_fault=NUM_BATCHES - 1), plan)
  with pytest.raises(tf.errors.InvalidArgumentError, match=MESSAGE):
    est.train(fn)
  with pytest.raises(tf.errors.InvalidArgumentError, match=MESSAGE):
    est.evaluate(fn)
  with pytest.raises(tf.errors.InvalidArgumentError, match=MESSAGE):
    list(est.predict(fn))
