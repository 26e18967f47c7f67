"""Recurrent models on towers: every device runs its own rows through the loop, exactly.

The models (tests/loop_models.py: `dynamic_rnn`, `bidirectional_dynamic_rnn` with
`sequence_length`, `static_rnn`, `tf.scan`, `tf.map_fn`, a user's `tf.while_loop`, Keras'
LSTM, GRU, SimpleRNN and Bidirectional, a `tf.function` step called in graph mode, a seq2seq
decoder loop with attention) are read through their loops and calls (`rows/loops.py`), so
each tower runs the whole model on its shard (its loops and calls on its own device, the
gradients' loops not inlined: `placement/strategies.py`).
The reference is the undecorated model_fn on one device on the same data: after steps 1
and 2 every variable and Momentum slot within 1e-5, on 2 and 3 towers, 2x2 and 1x2
micro-batches; every device holds at least 0.9 of the plain graph's heavy ops (matrix
products and the like, a While loop counted as one heavy op plus its body's: `_heavy`),
and no warning is logged. Before loops were read each model ran from its first loop (or
time-major transpose) on one device (least share 0.1 to 0.5, a warning naming the op).
Under TF1 behaviour (`disable_v2_behavior()`: control flow v1 frames, TensorArrays):
tests/test_loop_frames.py.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re

import pytest
import tensorflow as tf

import estimator_graph
import heavy_ops
import loop_models
import testlib
import estimator_towers as et
from estimator_towers.base import logs

LAYOUTS = {'2_towers': (2, 1), '3_towers': (3, 1), '2x2': (2, 2), '1x2': (1, 2)}
_LOOPS = ('While', 'StatelessWhile')
_CALLS = _LOOPS + ('PartitionedCall', 'StatefulPartitionedCall', 'If', 'StatelessIf')


def _function_heavy(graph, node) -> int:
  """A function-calling op's heavy ops (`node`: its NodeDef): one for a While loop, plus its
  functions' own, read off their FunctionDefs (a tower copy's loop calls copies of tower 0's
  functions, which have no Python graph)."""
  count = 1 if node.op in _LOOPS else 0
  for value in node.attr.values():
    names = [value.func.name] if value.WhichOneof('value') == 'func' else [
        f.name for f in value.list.func]
    for name in names:
      function = graph._get_function(name)  # pylint: disable=protected-access
      for inner in getattr(getattr(function, 'definition', None), 'node_def', ()):
        if inner.op in heavy_ops.HEAVY:
          count += 1
        elif inner.op in _CALLS:
          count += _function_heavy(graph, inner)
  return count


def heavy(graph: tf.Graph, ops=heavy_ops.run_by_a_step) -> collections.Counter:
  """Heavy ops of `ops(graph)` per device ('CPU:k'; what a step runs, or for the plain
  graph what it needs: tests/heavy_ops.py), a While loop and its body's heavy ops counted
  on its device (tests/heavy_ops.py counts the graph's ops only, not a loop body's)."""
  counts = collections.Counter()
  for op in ops(graph):
    device = heavy_ops._device(op)  # pylint: disable=protected-access
    if op.type in heavy_ops.HEAVY:
      counts[device] += 1
    elif op.type in _CALLS:
      counts[device] += _function_heavy(graph, op.node_def)
  return counts


@contextlib.contextmanager
def _warnings():
  """The library's warnings logged in the block."""
  found, saved, warned = [], logs.warning, set(logs._warned)  # pylint: disable=protected-access
  logs._warned.clear()  # pylint: disable=protected-access
  logs.warning = lambda fmt, *a: found.append(fmt % a)
  try:
    yield found
  finally:
    logs.warning = saved
    logs._warned.clear()  # pylint: disable=protected-access
    logs._warned.update(warned)  # pylint: disable=protected-access


def _input_fn(name):
  features, labels, targets = loop_models.data()
  labels = targets if name == 'seq2seq' else labels
  return lambda: tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(
      loop_models.BATCH)


class _EachStep(tf.compat.v1.train.SessionRunHook):
  """Every global variable (slots included) after each step, for 2 steps."""

  def __init__(self, variables: dict):
    self._variables = variables
    self.steps = []

  def after_run(self, run_context, run_values):
    del run_values
    self.steps.append(run_context.session.run(self._variables))
    if len(self.steps) == 2:
      run_context.request_stop()


@functools.lru_cache(maxsize=None)
def _train(name, layout=None):
  """(variables after steps 1 and 2, heavy ops per device, warnings) of `name` (plain if no
  layout)."""
  model_fn = loop_models.MODELS[name]
  num_devices, micro_batches = LAYOUTS[layout] if layout else (1, 1)
  if layout:
    model_fn = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                                     micro_batches=micro_batches)
  with _warnings() as warned:
    graph = estimator_graph.EstimatorGraph(model_fn, _input_fn(name),
                                           tf.estimator.ModeKeys.TRAIN, num_cpus=num_devices)
  with graph.graph.as_default():
    each = _EachStep({v.op.name: v for v in tf.compat.v1.global_variables()})
  graph.hooks.append(each)
  try:
    graph.run()
  finally:
    graph.close()
  return each.steps, heavy(graph.graph, heavy_ops.run_by_a_step if layout else
                             heavy_ops.needed_by_a_step), warned


CASES = [(name, layout) for name in loop_models.MODELS for layout in LAYOUTS]


@pytest.mark.parametrize('name,layout', CASES, ids=[f'{n}-{l}' for n, l in CASES])
def test_towers_train_equal_to_plain_on_every_device(name, layout):
  steps, counts, warned = _train(name, layout)
  plain_steps, plain_counts, _ = _train(name)
  assert not warned, warned
  for actual, expected in zip(steps, plain_steps):
    testlib.assert_variables_close(actual, expected)
  num_devices = LAYOUTS[layout][0]
  plain = sum(plain_counts.values())
  least = min(counts.get(f'CPU:{i}', 0) for i in range(num_devices)) / plain
  assert least >= 0.9, (least, dict(counts), plain)


def _mixing_loop_model_fn(features, labels, mode, params=None, config=None):
  """A loop whose body mixes the batch (a max over the examples each step), its matrix
  products inside the loop only: the head on the whole batch holds no heavy op of the graph."""
  del labels, params, config
  x = features['x']
  w = tf.compat.v1.get_variable('w', [loop_models.D, loop_models.D],
                                initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  _, h = tf.while_loop(
      lambda i, h: i < loop_models.T,
      lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w) + tf.reduce_max(h, 0) + x[:, i])),
      [0, tf.zeros_like(x[:, 0])])
  loss = tf.reduce_mean(tf.square(h))
  return loop_models._spec(mode, loss)  # pylint: disable=protected-access


def test_a_loop_that_mixes_runs_once_and_says_so():
  """Its steps run once, on the whole batch, on the first device: the warning names the loop
  and gives the share (before: a loop's matrix products were not counted, so such a head held
  no heavy op and ran on one device in silence)."""
  features, labels, _ = loop_models.data()
  with _warnings() as warned:
    graph = heavy_ops.train_graph(
        et.replicate_model_fn(_mixing_loop_model_fn, devices=testlib.cpu_devices(2)),
        features, labels)
  counts = heavy(graph)
  assert counts['CPU:0'] > counts['CPU:1'], counts
  said = [w for w in warned if 'runs once' in w]
  assert len(said) == 1 and re.search(r"(Stateless)?While op '[^']*while' \(a while loop whose "
                                      r"body has Max op", said[0]), warned
  assert re.search(r'so \d+% of the step\'s heavy work runs on one device', said[0]), said
