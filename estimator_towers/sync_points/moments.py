"""The towers' moments combined into the global batch's: Chan et al.'s parallel formula.

A shard's statistics are a row of a table (its count, or its shape, then
per-channel mean and M2 or variance); the towers' rows, joined at a sync
point, combine to the global count, mean and M2 by Chan et al.'s formula,
mu = sum(n_i mean_i) / n and M2 = sum(M2_i + n_i (mean_i - mu)^2), never by
E[x^2] - E[x]^2. `chan` and `local_moments` are the `tf.nn.moments` path's
(differentiable), `Arithmetic` the fused path's (few graph ops per layer and
tower). The rule: arithmetic on rows and tables only; which rows are
joined, and where, is `batch_norm`'s.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import fixed_sums
from estimator_towers.base import shapes
from estimator_towers.sync_points import batch_norm_kernels as kernels


def chan_row(statistics) -> tf.Tensor:
  """`chan`'s (mean, M2, count) as a row (count, mean, M2) of a table."""
  mean, m2, total = statistics
  return tf.concat([tf.reshape(total, [1]), mean, m2], 0)


def fused_row(statistics) -> tf.Tensor:
  """`Arithmetic.combined`'s result as a row (count, mean, Bessel-corrected variance)."""
  mean, _, corrected, total = statistics
  return tf.concat([tf.reshape(total, [1]), mean, corrected], 0)


def chan(table: tf.Tensor):
  """Global mean, M2 and count from a gather table's rows (count, mean, M2): Chan et al."""
  counts, means, m2s = _split_table(table)
  total = tf.reduce_sum(counts)
  mean = tf.reduce_sum(counts * means, 0) / tf.maximum(total, 1.0)
  m2 = tf.reduce_sum(m2s + counts * tf.math.squared_difference(means, mean), 0)
  return mean, m2, total


def _split_table(table: tf.Tensor, const: Callable = tf.constant) -> list:
  """A table's rows (count, C values, C values) as [rows, 1], [rows, C] and [rows, C]."""
  if shapes.dim(table, 1) is None:
    channels = (tf.shape(table)[1] - 1) // 2
    sizes = tf.stack([1, channels, channels])
  else:
    channels = (shapes.dim(table, 1) - 1) // 2
    sizes = const([1, channels, channels], tf.int32)
  return tf.split(table, sizes, const(1, tf.int32), num=3)


class Arithmetic:
  """One tower's per-channel arithmetic of the fused path, in few graph ops.

  Per layer and tower a sync point computes a few dozen small things (the
  shard's row, the combination, Bessel's correction, the backward scales).
  Graph construction and TensorFlow's graph optimisation take time per op,
  and the first version of this path doubled the towered graph (67 ops per
  layer and tower, 7,542 ops for ResNet-8 at N = 8 against 3,782 unsynced),
  so constants are made once per tower and the combination works on the
  whole gathered table at once. (Graph functions, one call op each, made
  construction cheaper but optimisation dearer: inlined, each call adds some
  30 nodes.)
  """

  def __init__(self, original):
    self._original = original
    self._constants: dict[Any, tf.Tensor] = {}

  def const(self, value, dtype=tf.float32) -> tf.Tensor:
    key = (repr(value), dtype)
    if key not in self._constants:
      self._constants[key] = tf.constant(value, dtype)
    return self._constants[key]

  def local_statistics(self, x, scale, epsilon, data_format):
    """The shard's row of the statistics' table: its shape, per-channel mean and variance.

    By the training kernel: its variance has Bessel's correction over the
    shard's count. The shape is given as floats (a constant where static).
    """
    channels = shapes.dim(x, kernels.channel_axis(x, data_format))
    if channels is None:  # known at run time only
      ones = tf.ones_like(scale, tf.float32)
      ones_zeros = (ones, ones * 0.0)
    else:
      ones_zeros = (self.const([1.0] * channels), self.const([0.0] * channels))
    empty = self.const([])
    _, mean, variance, _, _, _ = self._original(
        x, *ones_zeros, empty, empty, epsilon=epsilon, exponential_avg_factor=1,
        data_format=data_format, is_training=True)
    shape = (self.const([float(d) for d in x.shape.as_list()]) if x.shape.is_fully_defined()
             else tf.cast(tf.shape(x), tf.float32))
    return tf.concat([shape, mean, variance], self.const(0, tf.int32))

  def counted(self, rows: tf.Tensor, rank: int, axis: int, presents):
    """The towers' rows (shape, mean, variance) as counts [towers, 1], means and variances.

    A count is the product of the shape's dimensions but the channels' (at
    `axis`; in float32, exact up to 2^24 values per channel and shard, rounded
    like the statistics beyond), times the tower's presence factor (0 for an
    empty shard) when `presents` is given.
    """
    one = self.const(1, tf.int32)
    channels = shapes.dim(rows, 1) - rank if shapes.dim(rows, 1) is not None else None
    pieces = [axis, 1, rank - axis - 1] + ([channels // 2] * 2 if channels else [-1])
    parts = tf.split(rows, self.const([n for n in pieces if n], tf.int32), one,
                     num=len([n for n in pieces if n]))
    before = parts.pop(0) if axis else None
    parts.pop(0)  # the channel count
    after = parts.pop(0) if rank - axis - 1 else None
    means, variances = parts if channels else tf.split(parts[0], 2, one)
    others = [t for t in (before, after) if t is not None]
    others = others[0] if len(others) == 1 else tf.concat(others, one)
    counts = tf.reduce_prod(others, one, keepdims=True)
    if presents is not None:
      counts = counts * presents
    return counts, means, variances

  def split_table(self, table: tf.Tensor):
    """A table's rows (count, mean, variance) as counts [rows, 1], means and variances."""
    return _split_table(table, self.const)

  def combined(self, counts, means, variances):
    """Global mean, variance and Bessel-corrected variance, and count: Chan et al.

    With n_i, mean_i and M2_i = variance_i * max(n_i - 1, 0) the rows', n the
    global count and mu the global mean: mu = sum(n_i mean_i) / n and
    M2 = sum(M2_i + n_i (mean_i - mu)^2), without cancellation.
    """
    one, zero = self.const(1.0), self.const(0, tf.int32)
    total = tf.reduce_sum(counts, self.const([0, 1], tf.int32))
    safe = tf.maximum(total, one)
    mean = tf.reduce_sum(counts / safe * means, zero)
    m2 = tf.reduce_sum(variances * tf.maximum(counts - one, self.const(0.0)) + counts *
                       tf.math.squared_difference(means, mean), zero)
    return mean, m2 / safe, m2 / tf.maximum(total - one, one), total

  def global_statistics(self, counts, means, variances):
    """[global mean, variance] (one tensor: one transfer to each tower), the
    Bessel-corrected variance and the count."""
    mean, variance, corrected, total = self.combined(counts, means, variances)
    return tf.stack([mean, variance]), corrected, total

  def correction_factor(self, scale, variance, count, epsilon):
    """scale / (s n), s = sqrt(variance + epsilon): the forward's part of the correction."""
    inverse = tf.math.rsqrt(variance + self.const(epsilon)) / tf.maximum(count, self.const(1.0))
    return scale * inverse


def rows_sum(table: tf.Tensor, fixed: bool) -> tf.Tensor:
  """The sum of a table's rows (the towers' parts, in shard order); on the fixed shard
  grid (`fixed`) over the grid's summation tree, so that every topology adds them alike."""
  if not fixed:
    return tf.reduce_sum(table, 0)
  return fixed_sums.sum_in_order(tf.unstack(table))


def moments_input_gradient(y: tf.Tensor, axes: Sequence[int], mean: tf.Tensor,
                           count: tf.Tensor, mean_grad: tf.Tensor, m2_grad: tf.Tensor
                           ) -> tf.Tensor:
  """A shard's input gradient of the global mean and M2 over `axes` (flattened per the rest).

  With n the global count and mu the global mean, d mean / d y = 1 / n and
  d M2 / d y = 2 (y - mu) on every row, so `y`'s gradient is
  mean_grad / n + 2 m2_grad (y - mu), given the global batch's gradients of
  the two (every shard's part of them summed).
  """
  shape = dims(y, range(y.shape.rank), ones=axes)
  mu, g_mean, g_m2 = (tf.reshape(t, shape) for t in (mean, mean_grad, m2_grad))
  return g_mean / tf.maximum(count, 1.0) + 2.0 * g_m2 * (y - mu)


def local_moments(x: tf.Tensor, axes: Sequence[int]):
  """The shard's count, mean and M2 over `axes` (two passes), flattened per the rest."""
  flat = _rows(x, axes)
  count = tf.cast(tf.shape(flat)[0], x.dtype)
  mean = tf.reduce_mean(flat, 0)
  m2 = tf.reduce_sum(tf.math.squared_difference(flat, tf.stop_gradient(mean)), 0)
  return count, mean, m2


def dims(x: tf.Tensor, axes: Sequence[int], ones: Sequence[int] = ()) -> list:
  """The sizes of `x` along `axes` (Python ints where static), 1 for `ones`."""
  return [1 if a in ones else (shapes.dim(x, a) if shapes.dim(x, a) is not None else tf.shape(x)[a])
          for a in axes]


def _rows(x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
  """`x` as a matrix: one row per element of the reduced `axes`, a column per rest."""
  rest = [a for a in range(x.shape.rank) if a not in axes]
  width = 1
  for size in dims(x, rest):
    width = width * size
  perm = list(axes) + rest
  if perm != list(range(x.shape.rank)):
    x = tf.transpose(x, perm)
  return tf.reshape(x, [-1, width])
