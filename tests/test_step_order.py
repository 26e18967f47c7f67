"""The step's keyed draws read the global step before any write of it, in every run.

Keyed draws key a step by the global step read when it starts
(`draws/step_order.py`): every op that may write the step waits for that read,
by a graph edge. The graph tests build each kind of write a model_fn or a hook
makes (BERT's assign grouped with its update, a hook's fetched `assign_add`, a
`tf.function`, a v2 and a v1 cond, a v1 while loop, a ref variable, a second
handle to the step) and check, on the GraphDef (an independent walk), that
each writer waits for the read. The run tests repeat training many times in one
graph (the variables set back to their first values between repeats) under
contention (eight inter-op threads on two cores, beside the other test
process): BERT with its dropout on 3 towers, 2 micro-batches and 2 x 2, and a
dropout model whose step a hook advances, against the model_fn decorated for
one device, whose step the optimizer advances after its update. Without the
order, the hook's increment races the read, and the draws of a step are made
with the next step's key (seen on the code before the order: the hook model
differed on most repeats, through a handle of its own). BERT's runs did not
differ on that code here, nor with no order at all (in this harness and under
Estimator.train): its step's read ran first in every repeat, so the graph
tests are what fail when BERT's assign is not ordered.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf

import bert_model
import estimator_graph
import testlib
import estimator_towers as et

LAYOUTS = {'3 towers': (3, 1), '1x2 micro-batches': (1, 2), '2x2': (2, 2)}
# BERT's runs: the towers under 'collective', as the reported runs that differed (its
# replicas are local variables, which `_Repeats` sets back too).
BERT_STRATEGIES = {'3 towers': 'collective', '1x2 micro-batches': 'auto', '2x2': 'collective'}
REPEATS = 8
STEPS = 3


class _Advance(tf.compat.v1.train.SessionRunHook):
  """A user's hook that advances the global step: its `assign_add` fetched beside the train op
  (built in `begin`, as hooks build their ops)."""

  def begin(self):
    self._advance = tf.compat.v1.assign_add(tf.compat.v1.train.get_global_step(), 1)

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._advance)


class _SecondHandle(tf.compat.v1.train.SessionRunHook):
  """A hook that writes the step through a handle of its own (the same shared name)."""

  def begin(self):
    handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name='global_step',
                                    name='second_handle')
    self._advance = tf.raw_ops.AssignAddVariableOp(resource=handle,
                                                   value=tf.constant(1, tf.int64))

  def before_run(self, run_context):
    return tf.compat.v1.train.SessionRunArgs(self._advance)


def _dropout_model_fn(advance):
  """A dense model with dropout on its input and hidden layer; its step advanced by the
  optimizer after the update (`None`), or by the hook `advance()`, whose fetched increment
  runs in no order with anything."""
  def model_fn(features, labels, mode):
    x = tf.nn.dropout(features['x'], rate=0.5)
    hidden = tf.compat.v1.layers.dense(
        x, 16, tf.nn.relu, kernel_initializer=tf.compat.v1.constant_initializer(
            np.random.RandomState(1).randn(testlib.NUM_FEATURES, 16) * 0.5))
    logits = tf.compat.v1.layers.dense(
        tf.nn.dropout(hidden, rate=0.3), testlib.NUM_CLASSES,
        kernel_initializer=tf.compat.v1.constant_initializer(
            np.random.RandomState(2).randn(16, testlib.NUM_CLASSES) * 0.5))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    if advance is not None:
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=optimizer.minimize(loss),
                                        training_hooks=[advance()])
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


class _Repeats(tf.compat.v1.train.SessionRunHook):
  """Records every variable after each step; after every `STEPS` steps sets them all (the
  global step, slots and collective's replicas too) back to their values at session start:
  one graph, many runs."""

  def begin(self):
    self._variables = [v for v in tf.compat.v1.global_variables() + tf.compat.v1.local_variables()
                       if not v.op.name.startswith('input_position')]
    self._feeds = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in self._variables]
    self._reset = tf.group([v.assign(p) for v, p in zip(self._variables, self._feeds)])
    self.runs, self._steps = [[]], 0

  def after_create_session(self, session, coord):
    self._first = session.run(self._variables)

  def after_run(self, run_context, run_values):
    session = run_context.session
    values = session.run(self._variables)
    self.runs[-1].append({v.op.name: x for v, x in zip(self._variables, values)
                          if v.op.name != 'global_step' and '/replica_' not in v.op.name})
    self._steps += 1
    if self._steps % STEPS == 0:
      session.run(self._reset, dict(zip(self._feeds, self._first)))
      self.runs.append([])


def _runs(model_fn, input_fn, num_devices, repeats):
  graph = estimator_graph.EstimatorGraph(model_fn, lambda: input_fn().take(STEPS * repeats),
                                         tf.estimator.ModeKeys.TRAIN, num_cpus=num_devices)
  graph.session.close()   # contention: eight inter-op threads (the tests' sessions have two)
  config = testlib.session_config(num_devices, operation_timeout_in_ms=60000)
  config.inter_op_parallelism_threads = 8
  graph.session = tf.compat.v1.Session(graph=graph.graph, config=config)
  repeats_hook = _Repeats()
  graph.hooks.insert(0, repeats_hook)
  try:
    assert graph.run() == STEPS * repeats
  finally:
    graph.close()
  return repeats_hook.runs[:repeats]


def _assert_every_run_equals(runs, reference):
  differed = []
  for k, run in enumerate(runs):
    for step, (values, expected) in enumerate(zip(run, reference)):
      try:
        testlib.assert_variables_close(values, expected)
      except AssertionError as error:
        differed.append((k, step, str(error).splitlines()[0]))
        break
  assert not differed, f'{len(differed)} of {len(runs)} runs differed: {differed[:3]}'


def _xy_input_fn():
  x, y = testlib.data(12 * STEPS, seed=5)
  return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(12).repeat()


@functools.lru_cache(maxsize=None)
def _one_device_reference(model):
  """One run of `model` ('dropout': its step advanced by the optimizer; 'bert') decorated
  for one device: the steps' variables, shared by the layouts and hooks compared with it."""
  if model == 'dropout':
    return _runs(et.replicate_model_fn(_dropout_model_fn(None), devices=['/cpu:0']),
                 _xy_input_fn, 1, 1)[0]
  return _runs(et.replicate_model_fn(bert_model.model_fn(dropout=True), devices=['/cpu:0']),
               _bert_input_fn, 1, 1)[0]


HOOKS = {'its own handle': lambda: _SecondHandle(), 'the step\'s handle': lambda: _Advance()}


@pytest.mark.parametrize('hook', sorted(HOOKS))
@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_a_hook_s_increment_of_the_step_waits_for_the_draws_key(layout, hook):
  """The step advanced by a hook's fetched assign_add (through the step's handle, or a handle
  of its own), in no order with the train op: every run equals one device whose optimizer
  advances the step after its update (before the order, through its own handle: 8, 8 and 1
  of 8 runs differed)."""
  reference = _one_device_reference('dropout')
  num_devices, micro_batches = LAYOUTS[layout]
  towered = et.replicate_model_fn(_dropout_model_fn(HOOKS[hook]),
                                  devices=testlib.cpu_devices(num_devices),
                                  micro_batches=micro_batches)
  _assert_every_run_equals(_runs(towered, _xy_input_fn, num_devices, REPEATS), reference)


def _bert_input_fn():
  return bert_model.input_fn(12)()


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_bert_with_dropout_equals_one_device_in_every_run(layout):
  """BERT's own model_fn, its dropout and `global_step.assign(global_step + 1)` unchanged,
  its towers under 'collective': every repeat equals the model_fn decorated for one device."""
  reference = _one_device_reference('bert')
  num_devices, micro_batches = LAYOUTS[layout]
  towered = et.replicate_model_fn(bert_model.model_fn(dropout=True),
                                  devices=testlib.cpu_devices(num_devices),
                                  micro_batches=micro_batches,
                                  variable_strategy=BERT_STRATEGIES[layout])
  _assert_every_run_equals(_runs(towered, _bert_input_fn, num_devices, REPEATS), reference)


_READS = ('ReadVariableOp', 'VarIsInitializedOp', 'IsVariableInitialized', 'VariableShape')


def _waited_for(graph_def, name):
  """The names of the ops op `name` waits for (inputs and control inputs), theirs too."""
  return {node.name for node in tf.compat.v1.graph_util.extract_sub_graph(
      graph_def, [name]).node}


def _assert_every_writer_waits_for_the_read(graph):
  """Every op that takes a handle (or ref) of the global step, reads aside, waits for the
  ops that key the draws (the step's read: the handle's users the draws wait for)."""
  step = tf.compat.v1.train.get_global_step(graph)
  owners = [op for op in graph.get_operations() if op.type in ('VarHandleOp', 'VariableV2')
            and op.name.split('/')[-1] in ('global_step', 'second_handle')]
  takers = {op.name for owner in owners for op in owner.outputs[0].consumers()
            if op.type not in _READS and not (op.type == 'Identity' and
                                              op.outputs[0].dtype != tf.resource)
            and op is not step.initializer}
  graph_def = graph.as_graph_def()
  draws = [op.name for op in graph.get_operations() if op.type.startswith('StatelessRandom')]
  keying = set().union(*[_waited_for(graph_def, d) for d in draws]) & {
      op.name for owner in owners for op in owner.outputs[0].consumers()}
  writers = takers - keying
  assert keying and writers, (keying, takers)
  for writer in writers:
    assert keying <= _waited_for(graph_def, writer), (writer, sorted(keying))


def _v1_control_flow(build):
  def wrapped(step):
    tf.compat.v1.disable_control_flow_v2()
    try:
      return build(step)
    finally:
      tf.compat.v1.enable_control_flow_v2()
  return wrapped


def _after(write, value):
  with tf.control_dependencies([write]):
    return tf.identity(value)


def _in_tf_function(step):
  @tf.function
  def advance():
    return step.assign_add(1)
  return advance()


WRITES = {
    'assign grouped (BERT)': lambda step: step.assign(step + 1),
    'a hook\'s fetch': lambda step: _Advance(),
    'a second handle': lambda step: _SecondHandle(),
    'tf.function': _in_tf_function,
    'v2 cond': lambda step: tf.cond(step >= 0, lambda: step.assign_add(1),
                                    lambda: step.assign_add(2)),
    'v1 cond': _v1_control_flow(lambda step: tf.cond(
        step >= 0, lambda: step.assign_add(1), lambda: step.assign_add(2))),
    'v1 while loop': _v1_control_flow(lambda step: tf.while_loop(
        lambda i: i < 1, lambda i: _after(step.assign_add(1), i + 1), [tf.constant(0)])),
    'a ref variable': lambda step: tf.compat.v1.assign_add(step, 1),
}


def _write_model_fn(write, chief=False):
  """A dropout model whose step `write` advances (a hook it returns: a training hook, or a
  chief-only one with `chief`)."""
  def model_fn(features, labels, mode):
    x = tf.nn.dropout(features['x'], rate=0.5)
    logits = tf.compat.v1.layers.dense(x, testlib.NUM_CLASSES)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    made = write(tf.compat.v1.train.get_global_step())
    if isinstance(made, tf.compat.v1.train.SessionRunHook):
      return tf.estimator.EstimatorSpec(
          mode, loss=loss, train_op=train_op, training_hooks=[] if chief else [made],
          training_chief_hooks=[made] if chief else [])
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(train_op, made))
  return model_fn


def _train_graph_with_hooks_begun(model_fn, ref_step=False, num_devices=2, chief_last=False):
  """The TRAIN graph as Estimator builds it, up to its hooks' begin() (before the session):
  the chief hooks first, as MonitoredTrainingSession begins them, or last (`chief_last`), as
  a distribute coordinator's chief does."""
  x, y = testlib.data(8)
  with tf.Graph().as_default() as graph:
    if ref_step:
      tf.compat.v1.get_variable(
          'global_step', [], tf.int64, tf.compat.v1.zeros_initializer(), trainable=False,
          use_resource=False, collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                                           tf.compat.v1.GraphKeys.GLOBAL_STEP])
    else:
      tf.compat.v1.train.create_global_step()
    towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices))
    spec = towered({'x': tf.constant(x)}, tf.constant(y), tf.estimator.ModeKeys.TRAIN)
    hooks, chief = list(spec.training_hooks), list(spec.training_chief_hooks)
    for hook in hooks + chief if chief_last else chief + hooks:
      hook.begin()
  return graph


@pytest.mark.parametrize('write', sorted(WRITES))
def test_every_kind_of_write_of_the_step_waits_for_its_read(write):
  """On 2 towers and on one device (decorated): each writer of the global step waits for the
  read that keys the draws, in the graph the session runs."""
  for num_devices in (2, 1):
    graph = _train_graph_with_hooks_begun(_write_model_fn(WRITES[write]),
                                          ref_step=write == 'a ref variable',
                                          num_devices=num_devices)
    _assert_every_writer_waits_for_the_read(graph)


@pytest.mark.parametrize('chief_last', [False, True], ids=['chief first', 'chief last'])
def test_a_chief_hook_s_increment_of_the_step_waits_for_its_read(chief_last):
  """A chief-only hook's fetched assign_add, its begin() before or after the training
  hooks' (a distribute coordinator's chief begins it last): it waits for the read."""
  graph = _train_graph_with_hooks_begun(_write_model_fn(lambda step: _Advance(), chief=True),
                                        chief_last=chief_last)
  _assert_every_writer_waits_for_the_read(graph)


def test_a_function_with_a_handle_of_its_own_to_the_step_is_refused():
  """A function body that makes its own handle to the global step writes it out of sight:
  refused at graph construction, naming the op and the fix."""
  @tf.function
  def advance():
    handle = tf.raw_ops.VarHandleOp(dtype=tf.int64, shape=[], shared_name='global_step')
    tf.raw_ops.AssignAddVariableOp(resource=handle, value=tf.constant(1, tf.int64))
    return tf.constant(0)

  with pytest.raises(ValueError, match=r'VarHandleOp .* in the function .*advance.* cannot: '
                                       r'it makes its own handle to the global step'):
    _train_graph_with_hooks_begun(_write_model_fn(lambda step: advance()))
