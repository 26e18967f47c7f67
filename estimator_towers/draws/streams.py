"""Rows [r, r + n) of a counter-based random draw, drawn alone.

The rule. A draw of shape [B, *row_shape] is the output of a TensorFlow
stateless V2 op asked for that whole shape with a key, a counter and the
Philox algorithm (alg=1); its rows are the examples in global batch order,
row i being flat elements [i * R, (i + 1) * R) for R = prod(row_shape). A
shard that holds rows [r, r + n) draws them alone, bit-equal to
`whole[r:r + n]`: the same op asked for the elements from the shard's first
one on, with the counter advanced to where the whole draw reaches them.

The kernels (tensorflow/core/kernels/random_op_cpu.h, FillPhiloxRandomTask)
fill the flat output by groups of `group_size(kind, dtype)` elements; group g
is computed from the Philox generator skipped to counter + g * s, where `s`
(`group_skip`) is the number of 128-bit Philox steps the kernel gives a group:

- 'uniform', 'normal' (StatelessRandomUniformV2, StatelessRandomNormalV2:
  half, bfloat16, float32, float64), 'uniform_int'
  (StatelessRandomUniformIntV2(minval, maxval): int32, int64) and
  'uniform_full_int' (StatelessRandomUniformFullIntV2: int32, int64, uint32,
  uint64): one Philox step a group; a group is 4 elements of 32 bits or
  less, 2 of 64 bits (random_distributions.h).
- 'truncated_normal' (StatelessTruncatedNormalV2: half, bfloat16, float32,
  float64): a group may take any number of samples (rejection), so the
  kernel reserves kReservedSamplesPerOutput = 256 uint32 samples per element
  (random_op_cpu.h): a group of 4 (2 for float64) skips 4 * 256 / 4 = 256
  (2 * 256 / 4 = 128) Philox steps.
- 'gamma' (StatelessRandomGammaV3(shape, key, counter, alg, alpha): half,
  float32, float64): each element is its own group, and the kernel skips
  kReservedSamplesPerOutput = 256 Philox steps (not samples: 1024 uint32)
  per element (stateless_random_gamma_op.cc). Its elements are numbered
  alpha first: sample s of alpha element j is number j * S + s, where
  S = B * R / k is the samples per alpha for alpha of k elements.

So element e of the draw is element e - q * group_size of the op asked for
the elements from the start of e's group q on, with the counter advanced by
q * group_skip: the shard asks for its elements plus the fewer than
group_size before them in their first group (at most one group more than it
needs), and slices those off. One stateless op per call, plus small int ops.
The counter is 128 bits (two uint64 words, low first); `advance` adds with
the carry from the low word into the high one, as the kernel's own Skip
does, and wraps at 2**128 like Skip.

Gamma. V3's output is its `shape` argument (not shape + alpha.shape), which
must end with alpha's shape: the draw is [B, *row_shape] with row_shape
ending with alpha's shape. Since the numbering is alpha first, a shard's
elements of one alpha element are one run, but the runs of different alpha
elements lie S apart:
- alpha of one element (a scalar, [1]): one op, the counter advanced by
  256 * r * R;
- alpha of shape [n, *row_shape], the shard's rows of an alpha of shape
  [B, *row_shape] (one alpha per element): flat order, one op, likewise;
- alpha of k > 1 elements shared by every row: k ops, one per alpha element
  (asked for that element's n * R / k samples, the counter advanced by
  256 * (j * S + r * R / k)), which needs `batch` (B). No single op can do
  it: the elements of one op are one run of numbers.

Exact: every kind and dtype above, every r, n and row_shape (empty, holding
0), bit for bit, on CPU; the kernels split work by groups and are made so
the output does not depend on the split (thread count). Not exact or not
done: StatelessRandomUniformIntV2 has no kernel for uint32 and uint64
(TF 2.15), so there is no whole draw either; those are refused (TypeError).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from estimator_towers.base import shapes

__all__ = ['DTYPES', 'KINDS', 'advance', 'draw', 'draw_rows', 'group_size', 'group_skip']

KINDS = ('uniform', 'normal', 'truncated_normal', 'uniform_int', 'uniform_full_int', 'gamma')

_FLOATS = (tf.half, tf.bfloat16, tf.float32, tf.float64)
# The dtypes each kind's op has a (CPU) kernel for.
DTYPES = {
    'uniform': _FLOATS,
    'normal': _FLOATS,
    'truncated_normal': _FLOATS,
    'uniform_int': (tf.int32, tf.int64),
    'uniform_full_int': (tf.int32, tf.int64, tf.uint32, tf.uint64),
    'gamma': (tf.half, tf.float32, tf.float64),
}

# uint32 samples per Philox step (one 128-bit output of the generator).
_PHILOX_SAMPLES = 4
# kReservedSamplesPerOutput, what a kernel reserves for each element of a
# distribution that takes a variable number of samples: uint32 samples for the
# truncated normal (random_op_cpu.h), Philox steps for gamma
# (stateless_random_gamma_op.cc).
_RESERVED_SAMPLES_PER_OUTPUT = 256


def group_size(kind: str, dtype: tf.DType) -> int:
  """The elements the kernel of `kind` computes together from one counter position."""
  _check(kind, dtype)
  if kind == 'gamma':
    return 1
  return _PHILOX_SAMPLES // 2 if tf.as_dtype(dtype).size == 8 else _PHILOX_SAMPLES


def group_skip(kind: str, dtype: tf.DType) -> int:
  """The Philox counter steps between one group of `kind` and the next."""
  size = group_size(kind, dtype)
  if kind == 'truncated_normal':  # reserved uint32 samples per element, 4 to a step
    return size * _RESERVED_SAMPLES_PER_OUTPUT // _PHILOX_SAMPLES
  if kind == 'gamma':  # the gamma kernel skips its reserve in Philox steps
    return _RESERVED_SAMPLES_PER_OUTPUT
  return 1


def _check(kind: str, dtype: tf.DType) -> None:
  if kind not in KINDS:
    raise ValueError(f'kind {kind!r} is not one of {KINDS}.')
  dtype = tf.as_dtype(dtype)
  if dtype not in DTYPES[kind]:
    raise TypeError(f'{kind} draws {", ".join(d.name for d in DTYPES[kind])}, not {dtype.name} '
                    f'(TensorFlow has no kernel for it).')


def advance(counter: tf.Tensor, steps: tf.Tensor) -> tf.Tensor:
  """The 128-bit Philox counter (2 x uint64, low word first) plus `steps` (int64 >= 0), with carry.

  The words are added as int64 (two's complement: the same bits as uint64's
  sum); the carry is whether the low word's sum is below it, compared as
  unsigned (both with the sign bit flipped). No uint64 arithmetic, which not
  every device has a kernel for. Wraps at 2**128 like the kernel's Skip.
  """
  with tf.name_scope('advance'):
    low, high = tf.unstack(tf.bitcast(tf.convert_to_tensor(counter, tf.uint64), tf.int64), num=2)
    total = low + tf.cast(steps, tf.int64)
    sign = tf.constant(-2**63, tf.int64)
    carry = tf.cast(tf.less(tf.bitwise.bitwise_xor(total, sign),
                            tf.bitwise.bitwise_xor(low, sign)), tf.int64)
    return tf.bitcast(tf.stack([total, high + carry]), tf.uint64)


def draw(kind: str, shape: tf.Tensor, dtype: tf.DType, key: tf.Tensor, counter: tf.Tensor,
         minval: Any = None, maxval: Any = None, alpha: Any = None) -> tf.Tensor:
  """The whole draw of `shape`: the stateless V2 op of `kind` (Philox) at `counter`.

  Rows [r, r + n) of a [B, ...] draw whose rows hold a multiple of
  `group_size` elements are this draw of [n, ...] at the counter advanced by
  `r * elements_per_row // group_size * group_skip` (see the module doc).
  """
  _check(kind, dtype)
  if kind == 'uniform_int':
    minval, maxval = tf.convert_to_tensor(minval, dtype), tf.convert_to_tensor(maxval, dtype)
  if kind == 'gamma':
    alpha = tf.convert_to_tensor(alpha, dtype)
  return _op(kind, shape, tf.as_dtype(dtype), key, counter, minval, maxval, alpha)


def _op(kind: str, shape: tf.Tensor, dtype: tf.DType, key: tf.Tensor, counter: tf.Tensor,
        minval: Any = None, maxval: Any = None, alpha: tf.Tensor | None = None) -> tf.Tensor:
  """The stateless V2 op of `kind` asked for `shape` (Philox)."""
  common = dict(shape=shape, key=key, counter=counter, alg=1)
  if kind == 'uniform':
    return tf.raw_ops.StatelessRandomUniformV2(dtype=dtype, **common)
  if kind == 'normal':
    return tf.raw_ops.StatelessRandomNormalV2(dtype=dtype, **common)
  if kind == 'truncated_normal':
    return tf.raw_ops.StatelessTruncatedNormalV2(dtype=dtype, **common)
  if kind == 'uniform_int':
    return tf.raw_ops.StatelessRandomUniformIntV2(minval=minval, maxval=maxval, **common)
  if kind == 'uniform_full_int':
    return tf.raw_ops.StatelessRandomUniformFullIntV2(dtype=dtype, **common)
  return tf.raw_ops.StatelessRandomGammaV3(alpha=alpha, **common)


def draw_rows(kind: str, rows: tf.Tensor, row_shape: tf.Tensor, dtype: tf.DType,
              key: tf.Tensor, counter: tf.Tensor, position: tf.Tensor,
              minval: Any = None, maxval: Any = None, alpha: Any = None,
              batch: Any = None) -> tf.Tensor:
  """Rows [position, position + rows) of the [B, *row_shape] draw of `kind`: [rows, *row_shape].

  rows: int scalar tensor (may be 0). row_shape: int32/int64 1-D tensor (may
  be empty: one element per row; may contain 0). key [1] uint64 and counter
  [2] uint64 as given by StatelessRandomGetKeyCounter. position: int64 scalar
  tensor (may be a Python int). kind and dtype: `KINDS`, `DTYPES`;
  'uniform_int' takes `minval` and `maxval` (scalars of `dtype`).

  'gamma' takes `alpha` (StatelessRandomGammaV3, whose output is its `shape`
  argument): `row_shape` is the whole per-row shape of the draw and ends
  with alpha's shape (the whole draw is V3 asked for [B, *row_shape] with
  that alpha); or alpha is [rows, *row_shape], this shard's rows of an alpha
  of shape [B, *row_shape]. A shared alpha of more than one element needs
  `batch` (B, an int scalar): see the module's docstring.
  """
  _check(kind, dtype)
  dtype = tf.as_dtype(dtype)
  with tf.name_scope(f'draw_rows_{kind}'):
    rows = tf.cast(rows, tf.int64)
    shape = tf.cast(row_shape, tf.int64)
    position = tf.cast(position, tf.int64)
    per_row = tf.reduce_prod(shape)
    if kind == 'gamma':
      flat = _gamma_rows(rows, shape, dtype, key, counter, position, alpha, batch)
    else:
      if kind == 'uniform_int':
        if minval is None or maxval is None:
          raise ValueError('uniform_int draws need minval and maxval.')
        minval = tf.convert_to_tensor(minval, dtype)
        maxval = tf.convert_to_tensor(maxval, dtype)
      flat = _aligned(kind, rows * per_row, position * per_row, dtype, key, counter,
                      minval, maxval)
    out = tf.reshape(flat, tf.concat([tf.reshape(rows, [1]), shape], 0))
    out.set_shape(_static_shape(rows, row_shape))
    return out


def _aligned(kind: str, size: tf.Tensor, first: tf.Tensor, dtype: tf.DType, key: tf.Tensor,
             counter: tf.Tensor, minval: Any, maxval: Any) -> tf.Tensor:
  """Flat elements [first, first + size) of the draw: one op from the start of first's group."""
  group = group_size(kind, dtype)
  if group == 1:
    start_group, offset = first, None
  else:
    offset = tf.math.floormod(first, group)
    start_group = tf.math.floordiv(first, group)
  counter = advance(counter, start_group * group_skip(kind, dtype))
  if offset is None:
    return _op(kind, tf.reshape(size, [1]), dtype, key, counter, minval, maxval)
  drawn = _op(kind, tf.reshape(offset + size, [1]), dtype, key, counter, minval, maxval)
  return tf.slice(drawn, tf.reshape(offset, [1]), tf.reshape(size, [1]))


def _gamma_rows(rows: tf.Tensor, shape: tf.Tensor, dtype: tf.DType, key: tf.Tensor,
                counter: tf.Tensor, position: tf.Tensor, alpha: Any, batch: Any) -> tf.Tensor:
  """The shard's gamma elements, flat (see the module's docstring for the numbering)."""
  if alpha is None:
    raise ValueError('gamma draws need alpha.')
  alpha = tf.convert_to_tensor(alpha, dtype)
  row_rank = shapes.dim(shape)
  if alpha.shape.rank is None or row_rank is None:
    raise ValueError(f'gamma draws need alpha of a known rank and row_shape of a static '
                     f'length; got alpha {alpha.shape}, row_shape of length {row_rank}.')
  per_row = tf.reduce_prod(shape)
  skip = group_skip('gamma', dtype)
  count = alpha.shape.num_elements()
  if alpha.shape.rank == row_rank + 1 or count == 1:
    # An alpha per element of the shard's rows, or one alpha: numbered in flat order.
    counter = advance(counter, position * per_row * skip)
    alpha = tf.reshape(alpha, [] if count == 1 else [-1])
    return _op('gamma', tf.reshape(rows * per_row, [1]), dtype, key, counter, alpha=alpha)
  if count is None:
    raise ValueError(f'gamma draws with an alpha shared by the rows need its shape static; '
                     f'got {alpha.shape}.')
  if count == 0:
    return tf.zeros([0], dtype)  # row_shape ends with alpha's shape: no elements
  if batch is None:
    raise ValueError(f'a gamma draw whose alpha ({alpha.shape}) has {count} elements shared '
                     f'by every row needs batch (B): its elements are numbered alpha first.')
  per_alpha = tf.math.floordiv(per_row, count)  # samples of each alpha in a row
  total = tf.cast(batch, tf.int64) * per_alpha  # S, samples of each alpha in the whole draw
  size = tf.reshape(rows * per_alpha, [1])
  parts = []
  for j, value in enumerate(tf.unstack(tf.reshape(alpha, [count]), num=count)):
    steps = (j * total + position * per_alpha) * skip
    parts.append(_op('gamma', size, dtype, key, advance(counter, steps), alpha=value))
  return tf.reshape(tf.stack(parts, axis=1), [-1])


def _static_shape(rows: tf.Tensor, row_shape: Any) -> tf.TensorShape:
  """[rows, *row_shape] as far as they are known when the graph is built."""
  known_rows = tf.get_static_value(rows)
  known_rows = None if known_rows is None else int(known_rows)
  row_shape = tf.convert_to_tensor(row_shape)
  known_row = tf.get_static_value(row_shape)
  if known_row is not None:
    return tf.TensorShape([known_rows] + [int(d) for d in known_row])
  if shapes.dim(row_shape) is None:
    return tf.TensorShape(None)
  return tf.TensorShape([known_rows] + [None] * shapes.dim(row_shape))
