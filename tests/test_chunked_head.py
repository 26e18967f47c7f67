"""Micro-batches of a head made of rows: row chunks, one at a time per device (`chunked_head`).

Exactness against plain training on the whole batch is
tests/test_cross_example.py's (`test_micro_batches_equal_plain_on_the_whole_batch`
runs this head); here, what makes it small: no tensor of the step holds the
whole batch's B x B matrix, every one the head makes with B columns has at
most a chunk's rows, and a device's chunks run one after another (forward,
then backward, each chunk computed again after the previous chunk's
gradient).
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_estimator.python.estimator.mode_keys import ModeKeys

import cross_example_models as patterns
import testlib
import estimator_towers as et

BATCH = 18   # micro-batches of 6 (1 x 3) or 5/4 (2 x 2); chunks of 2 or 2/3 rows
WIDTH = 4    # the encoders' output: the gathered columns transposed are WIDTH x BATCH


def _model_fn(pattern, features, labels, mode):
  loss, _ = pattern(features['x'], labels)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _graph(name, num_devices, micro_batches):
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    towered = et.replicate_model_fn(functools.partial(_model_fn, getattr(patterns, name)),
                                    devices=testlib.cpu_devices(num_devices),
                                    micro_batches=micro_batches)
    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, patterns.F).astype(np.float32)
    y = np.arange(BATCH, dtype=np.int32) % 3
    spec = towered({'x': tf.compat.v1.placeholder_with_default(x, [None, patterns.F])},
                   tf.compat.v1.placeholder_with_default(y, [None]), ModeKeys.TRAIN, None, None)
  return graph, spec


def _chunk_ops(graph, phase):
  """chunk index -> its MatMul ops ('forward' or 'backward': the chunk computed again)."""
  found = {}
  for op in graph.get_operations():
    match = re.match(rf'chunked_head/{phase}/chunk_(\d+)/', op.name)
    if match and op.type == 'MatMul':
      found.setdefault(int(match.group(1)), []).append(op)
  return found


def _ancestors(op):
  seen, pending = set(), [op]
  while pending:
    x = pending.pop()
    if x.name in seen:
      continue
    seen.add(x.name)
    pending.extend(t.op for t in x.inputs)
    pending.extend(x.control_inputs)
  return seen


@pytest.mark.parametrize('name,layout', [('in_batch_softmax', (1, 3)), ('clip', (2, 2))])
def test_no_tensor_of_the_step_has_more_than_a_chunk_of_rows_against_the_batch(name, layout):
  """Run the step's every rank-2 float tensor: none is B x B; the head's with B columns have
  at most a chunk's rows (ceil(B / (N k) / k)), but the columns' transpose."""
  num_devices, micro_batches = layout
  graph, spec = _graph(name, num_devices, micro_batches)
  assert _chunk_ops(graph, 'forward'), 'the head did not run in chunks'
  with graph.as_default():
    tensors = [t for op in graph.get_operations() for t in op.outputs
               if t.dtype == tf.float32 and t.shape.rank == 2 and op.type not in (
                   'VarHandleOp', 'Const', 'Placeholder', 'PlaceholderWithDefault')
               and not op.name.startswith('save')]
    shapes = [tf.shape(t) for t in tensors]
    config = tf.compat.v1.ConfigProto(device_count={'CPU': num_devices})
    with tf.compat.v1.Session(config=config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      found = session.run(shapes + [spec.train_op])[:-1]
  chunk = -(-BATCH // (num_devices * micro_batches * micro_batches))
  square = [t.name for t, s in zip(tensors, found) if list(s) == [BATCH, BATCH]]
  assert not square, square
  wide = {t.name: list(s) for t, s in zip(tensors, found)
          if t.op.name.startswith('chunked_head/') and s[1] == BATCH
          and s[0] > chunk and s[0] != WIDTH}
  assert not wide, wide


@pytest.mark.parametrize('layout', [(1, 3), (2, 2)])
def test_a_devices_chunks_run_one_after_another(layout):
  """Each forward chunk after the previous one of its device; each chunk computed again
  after the previous one's gradient, the first after every forward chunk."""
  num_devices, micro_batches = layout
  graph, _ = _graph('in_batch_softmax', num_devices, micro_batches)
  forward, backward = _chunk_ops(graph, 'forward'), _chunk_ops(graph, 'backward')
  chunks = num_devices * micro_batches * micro_batches
  assert sorted(forward) == sorted(backward) == list(range(chunks)), (forward, backward)
  per_device = chunks // num_devices   # chunk k on device k // per_device
  for k in range(chunks):
    before = _ancestors(backward[k][0])
    assert all(op.name in before for ops in forward.values() for op in ops), k
    if k % per_device:
      assert forward[k - 1][0].name in _ancestors(forward[k][0]), k
      grads = [op.name for op in graph.get_operations()
               if op.name.startswith(f'chunked_head/backward/chunk_{k - 1}_gradients/')]
      assert any(g in before for g in grads), k
