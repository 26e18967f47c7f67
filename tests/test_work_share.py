"""Never serial in silence: a TRAIN graph's heavy ops per device, and a head run once.

The reference is an independent count of the towered graph's heavy ops
(tests/heavy_ops.py: by op type and device, not the library's own count).
A model whose first op is one the row reader does not know (an RFFT, per
example) runs everything after it once, on the whole batch, on the first
device: exact, but that device holds most of the step's heavy ops, and a
warning must say so with the figures the graph shows; `cross_example='refuse'`
makes it an error. An MLP gets the per-device counts at INFO and no warning.
"""

import re

from absl import flags
import numpy as np
import pytest
import tensorflow as tf

import cross_example_models as patterns
import heavy_ops
import testlib
import estimator_towers as et
from estimator_towers.base import logs

X = {'x': np.random.RandomState(0).randn(12, 6).astype(np.float32)}
Y = np.arange(12, dtype=np.int32) % 3


def _model_fn(features, labels, mode, unknown_first=False, pattern=None):
  x = features['x']
  if pattern is not None:
    loss, _ = pattern(x, labels)
  else:
    if unknown_first:
      x = tf.math.real(tf.signal.rfft(x))   # per example, but an op the reader does not know
    h = tf.compat.v1.layers.dense(x, 8, activation=tf.nn.relu)
    h = tf.compat.v1.layers.dense(h, 8, activation=tf.nn.relu)
    logits = tf.compat.v1.layers.dense(h, 3)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


@pytest.fixture
def said(monkeypatch):
  """Every INFO and WARNING line the library logs, as (level, message)."""
  monkeypatch.setattr(logs, '_warned', set())
  lines = []
  monkeypatch.setattr(logs, 'info', lambda fmt, *a: lines.append(('I', fmt % a)))
  monkeypatch.setattr(logs, 'warning', lambda fmt, *a: lines.append(('W', fmt % a)))
  return lines


def _graph(model, **plan):
  def model_fn(features, labels, mode):
    return _model_fn(features, labels, mode, **model)
  return heavy_ops.train_graph(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3), **plan), X, Y)


def _assert_even_and_logged(graph, said):
  """The graph's heavy ops (tests/heavy_ops.py's count) are the same on its 3 devices, the
  library logged exactly those counts, and warned of nothing."""
  counts = heavy_ops.per_device(graph)
  assert set(counts) == {'CPU:0', 'CPU:1', 'CPU:2'} and len(set(counts.values())) == 1, counts
  lines = [m for level, m in said if 'heavy ops' in m]
  assert lines == [
      'estimator_towers: train graph\'s heavy ops (matrix products, einsums, convolutions and '
      'their gradients) per device: '
      + ', '.join(f'/device:CPU:{i} {counts[f"CPU:{i}"]} (33%)' for i in range(3)) + '.'], said
  assert not [m for level, m in said if level == 'W'], said


def test_every_train_graph_logs_its_heavy_ops_per_device(said):
  _assert_even_and_logged(_graph({}), said)


def _conv_model_fn(features, labels, mode):
  """A convolution first: TensorFlow builds its input's gradient, which no step reads."""
  image = tf.reshape(features['x'], [-1, 2, 3, 1])
  h = tf.compat.v1.layers.conv2d(image, 4, 2, padding='same', activation=tf.nn.relu)
  logits = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(h), 3)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_the_counts_are_of_the_ops_a_step_runs(said):
  """The first tower's first convolution's input gradient is in the graph (the other towers
  are copies of what a step runs, without it) but no step runs it: not counted, so every
  device holds the same count, and no warning."""
  graph = heavy_ops.train_graph(
      et.replicate_model_fn(_conv_model_fn, devices=testlib.cpu_devices(3)), X, Y)
  built = [op for op in graph.get_operations() if op.type == 'Conv2DBackpropInput']
  assert len(built) == 1 and heavy_ops._device(built[0]) == 'CPU:0'  # pylint: disable=protected-access
  _assert_even_and_logged(graph, said)


def test_an_unknown_op_that_sends_work_to_one_device_warns_with_its_share(said):
  graph = _graph({'unknown_first': True})
  counts = heavy_ops.per_device(graph)   # the independent count of the same graph
  total = sum(counts.values())
  first, rest = counts['CPU:0'], [counts.get('CPU:1', 0), counts.get('CPU:2', 0)]
  assert first > 2 * max(rest), counts   # the serial head is there
  warned = [m for level, m in said if level == 'W' and 'RFFT' in m]
  assert len(warned) == 1, said
  share = (first - max(rest)) / total
  assert (f'/device:CPU:0 holds {first} of the step\'s {total} heavy ops' in warned[0]
          and f'the others /device:CPU:1 {rest[0]}, /device:CPU:2 {rest[1]}' in warned[0]
          and f'so {share:.0%} of the step\'s heavy work runs on one device' in warned[0]), (
              warned, counts)
  assert re.search(r"RFFT op 'rfft' \(an op the library does not know .*\) mixes the batch's "
                   r"rows as far as the library can tell, so everything from it to the loss "
                   r"runs once, on the whole batch, on /device:CPU:0", warned[0]), warned
  assert "the library does not know it yet" in warned[0] and (
      "cross_example='refuse' to make this an error" in warned[0]), warned


def test_a_known_mixing_op_run_once_warns_with_the_pointer_to_split_heads(said):
  """An in-batch softmax plus a penalty on the whole B x B matrix: the single head."""
  _graph({'pattern': patterns.in_batch_regularised})
  warned = [m for level, m in said if level == 'W' and 'runs once' in m]
  assert len(warned) == 1 and "MatMul op" in warned[0] and (
      'made of rows (an in-batch softmax, a top-k) are split per tower' in warned[0]), said


def test_cross_example_refuse_makes_a_head_run_once_an_error(said):
  with pytest.raises(ValueError, match=re.escape(
      "cross_example='refuse': the loss sparse_softmax_cross_entropy_loss/value:0 depends on "
      "RFFT op 'rfft'")) as raised:
    _graph({'unknown_first': True}, cross_example='refuse')
  assert "it would run once, on the whole batch, on /device:CPU:0" in str(raised.value)
  assert "or pass cross_example='auto' to train it that way" in str(raised.value)


def test_cross_example_refuse_leaves_data_parallel_models_alone(said):
  graph = _graph({}, cross_example='refuse')
  assert heavy_ops.least_share(graph, heavy_ops.train_graph(
      lambda f, l, m, p, c: _model_fn(f, l, m), X, Y), 3) == 1.0
  # An in-batch softmax is split per tower (row-wise): not refused either.
  _graph({'pattern': patterns.in_batch_softmax}, cross_example='refuse')


def _max_of_losses(x, y):
  """A max over the batch of per-example losses: its head (B scalars) runs once, no heavy op."""
  _, xent = patterns.logits_and_xent(x, y)
  return tf.reduce_mean(xent) + 0.5 * tf.reduce_max(xent), []


def test_cross_example_refuse_leaves_a_head_without_heavy_ops_alone(said):
  graph = _graph({'pattern': _max_of_losses}, cross_example='refuse')
  assert len(set(heavy_ops.per_device(graph).values())) == 1, heavy_ops.per_device(graph)
  assert not [m for level, m in said if level == 'W'], said


def test_cross_example_must_be_auto_or_refuse():
  with pytest.raises(ValueError, match=re.escape(
      "cross_example must be one of ('auto', 'refuse'), got 'never'")):
    et.make_plan(num_gpus=0, cross_example='never')


def test_cross_example_flag_and_config():
  fv = flags.FlagValues()
  et.define_flags(fv)
  fv(['prog', '--num_cpu_devices=2', '--cross_example=refuse'])
  assert et.config_from_flags(fv).plan.cross_example == 'refuse'
  assert et.make_config(num_cpu_devices=2).plan.cross_example == 'auto'
