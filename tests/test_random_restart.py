"""A run stopped and resumed draws what an uninterrupted run draws (keyed random draws).

A keyed draw is set by the op, the global step (read from the checkpoint when a
new `train()` call restores it) and the example's position in the global batch,
not by the state of a stateful op's stream, which a new session starts again.
So training 2 steps with `Estimator.train`, then 2 more in a second `train()`
call (a new graph and session, restored from the checkpoint, whose input position
makes the one input_fn go on with the batches the first call did not reach) must
equal 4 steps in one call: the reference is the
model_fn decorated for one device (`devices=['/cpu:0']`), and the resumed run
is on one device, on 3 towers and in 2 micro-batches. The model
(`collective_task.random_draws_model_fn`) draws Gaussian noise of tf.shape(x),
dropout and a scalar per step; its initializers are seeded by hand, and the
graph has a seed (RunConfig's tf_random_seed), so that per-shard draws are
deterministic too: with `random_draws='per_shard'` the resumed run draws the
first steps' values again, and differs (shown here). That the draws do change
with the step (so that a resume restarting them would show) is checked too, and
that the step they are keyed by is read before the model_fn's writes of it
(`assert_the_step_is_read_before_written`, used by tests/test_bert.py too).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import collective_task
import estimator_graph
import testlib
import estimator_towers as et

BATCH = 6      # 2 examples a tower on 3 towers, 3 a micro-batch
STEPS = 4
SEED = 7       # the graph's seed (RunConfig(tf_random_seed=...))
PARAMS = {'learning_rate': 0.1}
LAYOUTS = {'one device': (1, 1), '3 towers': (3, 1), '2 micro-batches': (1, 2)}
X, Y = testlib.data(BATCH * STEPS, seed=3)


def _input_fn():
  """The run's STEPS batches."""
  return tf.data.Dataset.from_tensor_slices(({'x': X}, Y)).batch(BATCH)


def _train(num_devices, micro_batches, calls, random_draws='keyed'):
  """Variables after `train()` calls of `calls` steps each on one input_fn (each call a new
  graph and session, restored from the checkpoint with the input's position, so it reads the
  batches that follow the previous call's)."""
  model_fn = et.replicate_model_fn(
      collective_task.random_draws_model_fn, devices=testlib.cpu_devices(num_devices),
      micro_batches=micro_batches, random_draws=random_draws)
  estimator = testlib.make_estimator(model_fn, num_devices, params=PARAMS,
                                     tf_random_seed=SEED)
  for steps in calls:
    estimator.train(_input_fn, steps=steps)
  values = testlib.variables(estimator)
  assert values['global_step'] == STEPS
  return values


@functools.lru_cache(maxsize=None)
def _one_call(random_draws='keyed'):
  """One device, 4 steps in one train() call."""
  return _train(1, 1, (STEPS,), random_draws)


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_a_resumed_run_draws_what_one_call_draws(layout):
  """2 + 2 steps in two train() calls equal 4 steps of one device in one call."""
  resumed = _train(*LAYOUTS[layout], calls=(2, 2))
  testlib.assert_variables_close(resumed, _one_call())


def test_per_shard_draws_start_again_with_a_new_session():
  """random_draws='per_shard': the stateful ops' streams start again with the second call's
  session, so the resumed run differs from one call, which is deterministic (a graph seed):
  the difference is the restart's."""
  one_call = _one_call('per_shard')
  testlib.assert_variables_close(_train(1, 1, (STEPS,), 'per_shard'), one_call)
  resumed = _train(1, 1, (2, 2), 'per_shard')
  moved = max(np.max(np.abs(resumed[n] - one_call[n])) for n in one_call)
  assert moved > 1e-3, moved


def test_the_draws_change_with_the_global_step():
  """One device, PREDICT: the dropout mask of the same batch at global step 0, 2, then 0 again
  (the step set in the session): a new mask at step 2, the first one again at step 0."""
  def model_fn(features, mode):
    kept = tf.nn.dropout(tf.ones_like(features['x']), rate=0.5) > 0
    return tf.estimator.EstimatorSpec(mode, predictions={'kept': kept})

  graph = estimator_graph.EstimatorGraph(
      et.replicate_model_fn(model_fn, devices=['/cpu:0']),
      lambda: tf.data.Dataset.from_tensor_slices({'x': X}).batch(BATCH * STEPS),
      tf.estimator.ModeKeys.PREDICT)
  step = tf.compat.v1.train.get_global_step(graph.graph)
  try:
    masks = [graph.run()[0]['kept']]   # at step 0, the variables' initial values
    for value in (2, 0):
      with graph.graph.as_default():   # its initializer fed (the graph is finalized)
        step.load(value, graph.session)
      masks.append(graph.run()[0]['kept'])
  finally:
    graph.close()
  assert 0.3 < masks[0].mean() < 0.7, masks[0].mean()
  assert (masks[1] != masks[0]).mean() > 0.3
  np.testing.assert_array_equal(masks[2], masks[0])


def assert_the_step_is_read_before_written(graph):
  """The reads of the global step that key `graph`'s draws come before every other op given
  the step that may write it: an assign, or a call of a function body (a v2 tf.cond), which
  would otherwise run in no order with them (a step could draw with the next step's key)."""
  step = tf.compat.v1.train.get_global_step(graph)
  users = {op.name: op for op in graph.get_operations()
           if any(t.op is step.handle.op for t in op.inputs) and op is not step.initializer}
  draws = [op.name for op in graph.get_operations() if op.type.startswith('StatelessRandom')]
  keying = _waited_for(graph, draws).intersection(users)
  writes = [name for name, op in users.items() if name not in keying and (
      op.type.startswith('Assign') or op.type in ('If', 'StatelessIf'))]
  assert keying and writes, (keying, writes)
  for write in writes:
    assert keying <= _waited_for(graph, [write]), (write, sorted(keying))


def _waited_for(graph, names):
  """The names of the ops that ops `names` wait for (inputs and control inputs), theirs too."""
  return {node.name for node in tf.compat.v1.graph_util.extract_sub_graph(
      graph.as_graph_def(), names).node}


def test_a_write_of_the_step_in_a_cond_waits_for_the_step_s_read():
  """The global step advanced inside a tf.cond (a v2 If, the write in its body): on 2 towers
  the call waits for the reads of the step that key the draws, as an assign does."""
  def model_fn(features, labels, mode):
    x = tf.nn.dropout(features['x'], rate=0.5)
    w = tf.compat.v1.get_variable('w', [testlib.NUM_FEATURES, testlib.NUM_CLASSES],
                                  initializer=tf.compat.v1.zeros_initializer())
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, x @ w))
    step = tf.compat.v1.train.get_global_step()
    advance = tf.cond(tf.reduce_sum(features['x']) > 0, lambda: step.assign_add(1),
                      lambda: step.assign_add(1))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(train_op, advance))

  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(2))(
        {'x': tf.constant(X[:BATCH])}, tf.constant(Y[:BATCH]), tf.estimator.ModeKeys.TRAIN)
  assert [op for op in graph.get_operations() if op.type in ('If', 'StatelessIf')
          and not op.name.startswith('keyed_draws')], 'no tf.cond of the model_fn'
  assert_the_step_is_read_before_written(graph)
