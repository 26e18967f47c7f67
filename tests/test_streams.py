"""`draws.streams`: rows [r, r + n) of a stateless draw, drawn alone, are the whole draw's rows.

For every kind and dtype, batch sizes B in BATCHES, row shapes in
ROW_SHAPES and every (r, n) with r + n <= B, `draw_rows` at position r (a
placeholder: one graph per kind, dtype and row shape) equals, bit for bit,
rows [r, r + n) of the V2 op asked for [B, *row_shape] with the same key and
counter; and so for a counter whose low word is 2**64 - 3, which carries
into the high word. `advance` is checked against Python's integers.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.draws import streams

tf1 = tf.compat.v1

BATCHES = (1, 5, 7, 8, 13)
ROW_SHAPES = ((), (1,), (3,), (2, 3), (4,), (0,))
NEAR_OVERFLOW = np.array([2**64 - 3, 17], np.uint64)
# The whole draw: the V2 op itself, asked for [B, *row_shape].
WHOLE = {
    'uniform': tf.raw_ops.StatelessRandomUniformV2,
    'normal': tf.raw_ops.StatelessRandomNormalV2,
    'truncated_normal': tf.raw_ops.StatelessTruncatedNormalV2,
    'uniform_int': tf.raw_ops.StatelessRandomUniformIntV2,
    'uniform_full_int': tf.raw_ops.StatelessRandomUniformFullIntV2,
    'gamma': tf.raw_ops.StatelessRandomGammaV3,
}
# alpha: 'scalar' (one alpha), 'shared' (alpha [3], the rows' last axis), 'rows' (one per element).
CASES = [(kind, dtype, 'scalar') for kind in streams.KINDS for dtype in streams.DTYPES[kind]]
CASES += [('gamma', dtype, alpha) for dtype in streams.DTYPES['gamma']
          for alpha in ('shared', 'rows')]


def _args(kind: str, dtype: tf.DType, alpha: str, row_shape: tuple) -> tuple[dict, dict]:
  """The kind's extra arguments, for the whole draw and for the shard (rows sliced later)."""
  if kind == 'uniform_int':
    bounds = dict(minval=tf.constant(-5, dtype), maxval=tf.constant(1_000_003, dtype))
    return bounds, dict(bounds)
  if kind != 'gamma':
    return {}, {}
  if alpha == 'scalar':
    value = tf.constant(0.8, dtype)
  elif alpha == 'shared':
    value = tf.constant([0.5, 1.0, 3.0], dtype)
  else:
    value = tf1.placeholder(dtype, (None,) + row_shape, name='alpha')
  return dict(alpha=value), dict(alpha=value)


def _build(kind: str, dtype: tf.DType, alpha: str, row_shape: tuple, feeds: dict) -> tuple:
  """(whole, part) for one row shape, with B, r, n, key and counter fed; alpha fed if 'rows'."""
  whole_args, part_args = _args(kind, dtype, alpha, row_shape)
  shape = tf.concat([[feeds['batch']], tf.constant(row_shape, tf.int64, [len(row_shape)])], 0)
  whole = WHOLE[kind](shape=shape, key=feeds['key'], counter=feeds['counter'], alg=1,
                      **({'dtype': dtype} if kind not in ('uniform_int', 'gamma') else {}),
                      **whole_args)
  if alpha == 'rows':
    feeds.setdefault('alphas', []).append(part_args['alpha'])
    part_args['alpha'] = part_args['alpha'][feeds['position']:feeds['position'] + feeds['rows']]
  part = streams.draw_rows(kind, feeds['rows'], tf.constant(row_shape, tf.int32), dtype,
                           feeds['key'], feeds['counter'], feeds['position'],
                           batch=feeds['batch'] if alpha == 'shared' else None, **part_args)
  return whole, part


def _row_shapes(alpha: str) -> tuple:
  return ((3,), (2, 3)) if alpha == 'shared' else ROW_SHAPES


def _same(a: np.ndarray, b: np.ndarray) -> bool:
  return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize('kind,dtype,alpha', CASES,
                         ids=[f'{k}-{d.name}-{a}' for k, d, a in CASES])
def test_rows_are_the_whole_draws_rows(kind, dtype, alpha):
  graph = tf1.Graph()
  with graph.as_default():
    feeds = {name: tf1.placeholder(tf.int64, [], name=name)
             for name in ('batch', 'position', 'rows')}
    feeds['key'] = tf1.placeholder(tf.uint64, [1], name='key')
    feeds['counter'] = tf1.placeholder(tf.uint64, [2], name='counter')
    seeded = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.constant([11, 42], tf.int64))
    pairs = [_build(kind, dtype, alpha, shape, feeds) for shape in _row_shapes(alpha)]
    alphas = feeds.get('alphas', [])
  with tf1.Session(graph=graph) as sess:
    key, counter = sess.run(seeded)
    names = ('batch', 'position', 'rows', 'key', 'counter')
    run = sess.make_callable(pairs, [feeds[name] for name in names] + alphas)
    rng = np.random.default_rng(0)
    checked = 0
    for batch in BATCHES:
      values = [rng.uniform(0.3, 3.0, (batch,) + shape).astype(dtype.as_numpy_dtype)
                for shape in _row_shapes(alpha)][:len(alphas)]
      for start_counter in (counter, NEAR_OVERFLOW):
        for position in range(batch + 1):
          # Every (r, n) with the drawn counter; n = B - r near the overflow.
          sizes = range(batch - position + 1) if start_counter is counter else [batch - position]
          for rows in sizes:
            for (whole, part), shape in zip(run(batch, position, rows, key, start_counter,
                                                *values), _row_shapes(alpha)):
              assert _same(part, whole[position:position + rows]), (
                  f'{kind} {dtype.name} B={batch} r={position} n={rows} row_shape={shape} '
                  f'counter={start_counter}')
              checked += 1
    assert checked == len(pairs) * sum((b + 1) * (b + 2) // 2 + b + 1 for b in BATCHES)


def test_group_facts_are_the_kernels():
  """Elements and Philox steps per group: random_op_cpu.h, stateless_random_gamma_op.cc."""
  facts = {(kind, dtype.name): (streams.group_size(kind, dtype), streams.group_skip(kind, dtype))
           for kind in streams.KINDS for dtype in streams.DTYPES[kind]}
  for dtype in ('float16', 'bfloat16', 'float32'):
    assert facts['uniform', dtype] == facts['normal', dtype] == (4, 1)
    assert facts['truncated_normal', dtype] == (4, 256)
  assert facts['uniform', 'float64'] == facts['normal', 'float64'] == (2, 1)
  assert facts['truncated_normal', 'float64'] == (2, 128)
  assert facts['uniform_int', 'int32'] == facts['uniform_full_int', 'uint32'] == (4, 1)
  assert facts['uniform_int', 'int64'] == facts['uniform_full_int', 'uint64'] == (2, 1)
  assert {facts['gamma', d] for d in ('float16', 'float32', 'float64')} == {(1, 256)}


@pytest.mark.parametrize('low,high,steps', [
    (0, 0, 5), (2**64 - 3, 17, 2), (2**64 - 3, 17, 3), (2**64 - 3, 17, 2**40 + 7),
    (2**64 - 1, 2**64 - 1, 1), (2**32 - 1, 0, 1), (123, 2**63, 2**63 - 1)])
def test_advance_adds_with_carry(low, high, steps):
  graph = tf1.Graph()
  with graph.as_default():
    counter = tf1.placeholder(tf.uint64, [2])
    advanced = streams.advance(counter, tf.constant(steps, tf.int64))
  with tf1.Session(graph=graph) as sess:
    got = sess.run(advanced, {counter: np.array([low, high], np.uint64)})
  total = (low + (high << 64) + steps) % 2**128
  assert [int(w) for w in got] == [total % 2**64, total >> 64]


def test_one_op_at_most_a_group_more():
  """One stateless op per call, asked for the shard's elements and fewer than a group more."""
  graph = tf1.Graph()
  with graph.as_default():
    position = tf1.placeholder(tf.int64, [])
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.constant([1, 2], tf.int64))
    part = streams.draw_rows('normal', 2, tf.constant([3]), tf.float32, key, counter, position)
    ops = [op for op in graph.get_operations() if op.type.startswith('StatelessRandom')]
    assert [op.type for op in ops] == ['StatelessRandomGetKeyCounter', 'StatelessRandomNormalV2']
    asked = tf.reduce_prod(ops[1].inputs[0])
  with tf1.Session(graph=graph) as sess:
    for r in range(9):
      n, elements = sess.run([asked, part], {position: r})
      assert 6 <= n < 6 + 4 and elements.shape == (2, 3)


def test_static_shape():
  graph = tf1.Graph()
  with graph.as_default():
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.constant([1, 2], tf.int64))
    known = streams.draw_rows('uniform', 3, tf.constant([2, 3]), tf.float32, key, counter, 4)
    rows = tf1.placeholder(tf.int32, [])
    fed = streams.draw_rows('uniform', rows, tf.constant([2, 3], tf.int64), tf.float32, key,
                            counter, tf1.placeholder(tf.int64, []))
    width = tf1.placeholder(tf.int32, [])
    partial = streams.draw_rows('uniform', rows, tf.stack([2, width]), tf.float32, key, counter, 0)
  assert known.shape.as_list() == [3, 2, 3]
  assert fed.shape.as_list() == [None, 2, 3]
  assert partial.shape.as_list() == [None, 2, None]


def test_refusals():
  with tf1.Graph().as_default():
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=tf.constant([1, 2], tf.int64))
    common = dict(rows=2, row_shape=tf.constant([3]), key=key, counter=counter, position=1)
    with pytest.raises(ValueError, match='kind'):
      streams.draw_rows('poisson', dtype=tf.float32, **common)
    with pytest.raises(TypeError, match='uint32'):  # no kernel for it
      streams.draw_rows('uniform_int', dtype=tf.uint32, minval=0, maxval=3, **common)
    with pytest.raises(ValueError, match='minval'):
      streams.draw_rows('uniform_int', dtype=tf.int32, **common)
    with pytest.raises(ValueError, match='batch'):
      streams.draw_rows('gamma', dtype=tf.float32, alpha=[1.0, 2.0, 3.0], **common)
