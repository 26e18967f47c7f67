"""What a step with micro-batches holds at its peak, read from the step's own allocations.

Exactness is tests/test_micro_batches.py's and tests/test_cross_example.py's;
here, memory: one traced step (FULL_TRACE) gives every op's allocations and
deallocations (`memory.allocation_records`), and the timeline of their sum
gives the step's peak and the tensors alive then, by the op that allocated
them. With micro_batches=k at batch B, the peak may hold, beyond plain
training's at B / k: the gradient sums (one float32 per trained parameter)
and, for a loss that mixes the batch's rows, the cut tensors (the first
pass's representations and their cached gradient). Nothing else: not a
second micro-batch's activations (its forward pass running early, or the
first pass's copy of it not yet freed), not the head's whole-batch matrix.
The batch is a constant here (held by the session, not by the step), so the
whole batch's input is not counted.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_estimator.python.estimator.mode_keys import ModeKeys

import estimator_towers as et

BATCH = 2048
K = 4
INPUTS = 32
WIDTH = 128     # activations dominate: a micro-batch's 512 rows x 128 beside 128 x 128 weights
DEPTH = 3
DIM = 16


def _encoder(x, name):
  init = tf.compat.v1.glorot_uniform_initializer
  with tf.compat.v1.variable_scope(name):
    for i in range(DEPTH):
      x = tf.compat.v1.layers.dense(x, WIDTH, activation=tf.nn.relu,
                                    kernel_initializer=init(seed=i + 1), name=f'hidden_{i}')
    return tf.compat.v1.layers.dense(x, DIM, kernel_initializer=init(seed=99), name='out')


def _model_fn(loss_kind, features, labels, mode):
  del labels
  q = _encoder(features['query'], 'query')
  d = _encoder(features['doc'], 'doc')
  if loss_kind == 'in_batch_softmax':   # mixes the rows: cached gradients, chunked head
    q, d = tf.math.l2_normalize(q, -1), tf.math.l2_normalize(d, -1)
    logits = tf.matmul(q, d, transpose_b=True) / 0.05
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        tf.range(tf.shape(q)[0]), logits))
  else:   # per example
    loss = tf.reduce_mean(-tf.reduce_sum(q * d, -1))
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _live_at_peak(step_stats):
  """(peak bytes of the step's own tensors, {op name: its bytes alive then},
  the most micro-batches whose activations were alive at one moment: {op name: bytes} then)."""
  events = sorted((r.alloc_micros, r.alloc_bytes, n.node_name)
                  for d in step_stats.dev_stats for n in d.node_stats
                  for m in n.memory for r in m.allocation_records)
  live, by_op, peak, at_peak, together = 0, {}, 0, {}, {}
  for _, size, op in events:
    live += size
    by_op[op] = by_op.get(op, 0) + size
    if live > peak:
      peak, at_peak = live, dict(by_op)
    if size > 0 and _micro_batch(op) is not None:
      activations = {o: b for o, b in by_op.items() if b > 0 and _micro_batch(o) is not None}
      if len({_micro_batch(o) for o in activations}) > len(
          {_micro_batch(o) for o in together}):
        together = activations
  return peak, {op: b for op, b in at_peak.items() if b > 0}, together


def _traced_step(loss_kind, batch, micro_batches):
  """The step's peak, the tensors alive then, and the trained parameters' bytes."""
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    fn = functools.partial(_model_fn, loss_kind)
    if micro_batches > 1:
      fn = et.replicate_model_fn(fn, devices=['/cpu:0'], micro_batches=micro_batches)
    rng = np.random.RandomState(0)
    features = {name: tf.compat.v1.placeholder_with_default(
        rng.randn(batch, INPUTS).astype(np.float32), [None, INPUTS]) for name in ('query', 'doc')}
    spec = (fn(features, None, ModeKeys.TRAIN, None, None) if micro_batches > 1
            else fn(features, None, ModeKeys.TRAIN))
    params = sum(v.shape.num_elements() * 4 for v in tf.compat.v1.trainable_variables())
    config = tf.compat.v1.ConfigProto(device_count={'CPU': 1})
    with tf.compat.v1.Session(config=config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      session.run(spec.train_op)   # the first step builds the kernels
      metadata = tf.compat.v1.RunMetadata()
      session.run(spec.train_op, options=tf.compat.v1.RunOptions(
          trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=metadata)
  return (*_live_at_peak(metadata.step_stats), params)


def _micro_batch(op_name):
  """Whose forward activation an op's output is: (pass, micro-batch), None if not an activation."""
  first = re.match(r'cached_gradients/shard_(\d+)/Relu(_\d+)?$', op_name)   # copies' names
  if first:
    return ('first pass', int(first.group(1)))
  if not re.search(r'/hidden_\d+/Relu$', op_name):
    return None
  tower = re.match(r'(?:gradients_\d+/)?tower_(\d+)/', op_name)
  return ('second pass', int(tower.group(1)) if tower else 0)


@pytest.mark.parametrize('loss_kind', ['in_batch_softmax', 'per_example'])
def test_peak_holds_one_micro_batch_beyond_the_sums_and_the_cut(loss_kind):
  plain_peak, _, _, params = _traced_step(loss_kind, BATCH // K, 1)
  peak, live, together, _ = _traced_step(loss_kind, BATCH, K)
  cut = 2 * (2 * BATCH * DIM * 4) if loss_kind == 'in_batch_softmax' else 0
  owners = sorted({_micro_batch(op) for op in together})
  assert len(owners) <= 1, (
      f'activations of more than one micro-batch alive at once ({owners}): '
      + ', '.join(f'{op} {b}' for op, b in sorted(together.items())))
  # The sums and the cut in full, and one layer of each encoder of a
  # micro-batch for the order in which the two encoders' ops happen to run
  # (their backward passes interleave differently from step to step).
  slack = 2 * (BATCH // K) * WIDTH * 4
  bound = plain_peak + params + cut + slack
  assert peak <= bound, (
      f'peak {peak} bytes > plain at B/k {plain_peak} + the gradient sums {params} + the cut '
      f'{cut} + {slack}; alive at the peak: '
      + ', '.join(f'{op} {b}' for op, b in sorted(live.items(), key=lambda kv: -kv[1])[:20]))
