"""Synchronised batch norm: batch statistics of the global batch, in every tower.

With `sync_batch_norm=True`, each batch normalisation a TRAIN model_fn builds
normalises its tower's shard with the mean and variance of the whole global
batch, so that a towered step equals the plain step for models whose only
cross-example operation is batch norm. A batch statistic is a sync point of
the towers, like a gradient request:

- Which computations: `tf.compat.v1.nn.fused_batch_norm(..., is_training=True)`
  (what Keras `BatchNormalization` and `tf.compat.v1.layers` use when fused,
  and tf_slim-style code calls directly) and `tf.nn.moments(x, axes)` with the
  batch axis 0 among `axes` (Keras' non-fused path and hand-written batch
  norm). Moments over other axes (layer norm) are per example and stay per
  tower.
- How: tower k sums its shard (`n_k` rows; an empty shard, which borrows a
  row in training, counts 0), the towers' sums meet in one collective
  all-reduce (`CollectiveReduce`, what MirroredStrategy uses between devices),
  then the sum of squared deviations from the global mean in a second: two
  all-reduces of C + 1 and C floats per layer and step, for C channels. The
  collective ops meet at run time, so the towers are still built one after
  another. The gradient of an all-reduce is the all-reduce of the incoming
  gradients, so the backward pass flows through the global statistics.
- What it returns is what the plain call returns on the whole batch: the
  fused call's batch variance carries Bessel's correction over the global
  count, as TensorFlow's kernel does, so Keras' moving averages (updated once
  per step from tower 0) follow the global statistics.

Options whose result cannot equal the plain batch norm on the whole batch
(`renorm`, `virtual_batch_size`, `adjustment` of a Keras layer) are errors when
sync is on.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Iterator, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import

from estimator_towers import interception
from estimator_towers import tower_context

# Layer options that make a batch norm's result depend on how the batch is
# split; the value that turns each off.
_UNSYNCABLE = (('renorm', False), ('virtual_batch_size', None), ('adjustment', None))

# Instance keys are unique per graph (collectives of one step must not share
# one); group keys identify a set of devices.
_next_instance_key: 'weakref.WeakKeyDictionary[tf.Graph, int]' = weakref.WeakKeyDictionary()
_GROUP_KEY_BASE = 0x5B00
# No timeout on the collectives: TensorFlow 2.15 keeps a sleeping thread per
# collective call for its timeout, so a timeout of T seconds holds about
# (sync points per step x steps per second x T) threads, which exhausted the
# process's threads within a minute of training (measured: 30,000 threads
# after 60 s of the example's ResNet-20, then an abort).


class BatchNormSyncError(ValueError):
  """A batch norm that cannot be synchronised across towers."""


def _instance_keys(graph: tf.Graph, count: int) -> list[int]:
  start = _next_instance_key.get(graph, 1)
  _next_instance_key[graph] = start + count
  return list(range(start, start + count))


class BatchNormSync:
  """The sync points of one towered TRAIN graph.

  Args:
    graph: the graph being built.
    devices: by tower index, the device of every tower that is built.
    present: by tower index, 1.0 (a Python float) or a float32 scalar Tensor
      that is 0 when the tower's shard is empty at run time.
  """

  def __init__(self, graph: tf.Graph, devices: dict[int, str], present: dict[int, Any]):
    if len(set(devices.values())) != len(devices):
      raise BatchNormSyncError(
          f'sync_batch_norm=True needs every tower on its own device, but the '
          f'towers run on {sorted(devices.values())}: statistics are exchanged '
          f'with collective ops, one per device. Give distinct devices (e.g. '
          f'--num_cpu_devices=N on a machine without GPUs instead of '
          f'--allow_cpu_fallback), or turn sync_batch_norm off.')
    self._graph = graph
    self._devices = devices
    self._present = present
    self._group_key = _GROUP_KEY_BASE + len(devices)
    self._keys: list[list[int]] = []      # per sync point: 4 instance keys
    self._calls: dict[int, int] = {}      # per tower: sync points made so far
    self._builds: dict[int, int] = {}     # per tower: the build that made them

  @contextlib.contextmanager
  def syncing(self) -> Iterator[None]:
    """While active, batch statistics built by a tower are global."""
    with interception.batch_norm_calls(self._fused, self._moments):
      yield

  def check_complete(self) -> None:
    """Raises if the towers did not all reach the same sync points."""
    counts = {k: self._calls.get(k, 0) for k in self._devices}
    if len(set(counts.values())) > 1:
      raise BatchNormSyncError(
          f'With sync_batch_norm=True every tower must build the same batch '
          f'norms, but the towers built {counts} (tower: count). Do not branch '
          f'on the tower or shard around batch normalisation.')

  # -- The intercepted calls ---------------------------------------------------

  def _tower(self) -> int | None:
    """The tower being built in this graph, or None (nothing to sync)."""
    if tf.compat.v1.get_default_graph() is not self._graph:
      return None
    index = tower_context.current_tower().index
    return index if index in self._devices and tower_context.current_build() else None

  def _fused(self, original, x, scale, offset, mean, variance, epsilon=0.0001,
             exponential_avg_factor=1, data_format='NHWC', is_training=True,
             name=None):
    tower = self._tower() if is_training else None
    if tower is None or not _is_batch_norm(_calling_layer()):
      return original(x, scale, offset, mean, variance, epsilon=epsilon,
                      exponential_avg_factor=exponential_avg_factor,
                      data_format=data_format, is_training=is_training, name=name)
    channels_first = data_format.startswith('NC')
    with tf.name_scope(name or 'SyncBatchNorm'):
      x32 = tf.cast(x, tf.float32)
      rank = x32.shape.rank
      axes = [a for a in range(rank) if a != (1 if channels_first else rank - 1)]
      batch_mean, batch_var, count = self._statistics(tower, x32, axes)
      shape = [1, -1] + [1] * (rank - 2) if channels_first else [-1]
      inv = tf.math.rsqrt(batch_var + epsilon) * tf.reshape(scale, [-1])
      y = (x32 - tf.reshape(batch_mean, shape)) * tf.reshape(inv, shape) + tf.reshape(
          offset, shape)
      # TensorFlow's kernel returns the variance with Bessel's correction over
      # the elements per channel (all towers' here), for moving averages.
      corrected = batch_var * (count / tf.maximum(count - 1.0, 1.0))
      batch_mean, corrected = tf.stop_gradient(batch_mean), tf.stop_gradient(corrected)
      if exponential_avg_factor not in (None, 1, 1.0):
        f = float(exponential_avg_factor)
        batch_mean = (1.0 - f) * mean + f * batch_mean
        corrected = (1.0 - f) * variance + f * corrected
      y = tf.cast(y, x.dtype)
      return y, batch_mean, corrected, batch_mean, corrected, corrected

  def _moments(self, original, x, axes, shift=None, name=None, keep_dims=None,
               keepdims=None):
    keep = bool(keep_dims if keepdims is None else keepdims)
    tower = self._tower()
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    batch_axis = rank is not None and 0 in [int(a) % rank for a in np.ravel(axes)]
    if tower is None or not batch_axis:
      return original(x, axes, shift=shift, name=name, keep_dims=keep)
    _is_batch_norm(_calling_layer())  # options that cannot be synchronised
    with tf.name_scope(name or 'sync_moments'):
      y = tf.cast(x, tf.float32) if x.dtype == tf.float16 else x
      axes = sorted(int(a) % rank for a in np.ravel(axes))
      mean, variance, _ = self._statistics(tower, y, axes)
      shape = _dims(y, [a for a in range(rank) if keep or a not in axes], ones=axes)
      mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
      if x.dtype == tf.float16:
        return tf.cast(mean, tf.float16), tf.cast(variance, tf.float16)
      return mean, variance

  # -- The statistics ----------------------------------------------------------

  def _statistics(self, tower: int, x: tf.Tensor, axes: Sequence[int]):
    """Mean, (biased) variance and element count over `axes` of the global batch.

    The results have the shape of `x` without `axes`, flattened to a vector.
    """
    keys = self._sync_point(tower)
    present = tf.cast(self._present[tower], x.dtype)
    flat = _rows(x, axes)
    count = tf.cast(tf.shape(flat)[0], x.dtype) * present
    local = tf.concat([tf.reduce_sum(flat, 0) * present, tf.reshape(count, [1])], 0)
    total = self._all_reduce(local, keys[0], keys[1])
    channels = tf.shape(local)[0] - 1
    count = total[-1]
    mean = total[:channels] / tf.maximum(count, 1.0)
    deviations = tf.math.squared_difference(flat, tf.stop_gradient(mean))
    squares = self._all_reduce(tf.reduce_sum(deviations, 0) * present, keys[2], keys[3])
    return mean, squares / tf.maximum(count, 1.0), count

  def _sync_point(self, tower: int) -> list[int]:
    """The instance keys of this tower's next sync point (shared by the towers)."""
    build = tower_context.current_build()
    if self._builds.setdefault(tower, build) != build:
      raise BatchNormSyncError(
          f'With sync_batch_norm=True each tower\'s model_fn is built once, '
          f'but tower {tower} was built again (a second gradient request, or '
          f'an EstimatorSpec loss other than the tensor gradients were asked '
          f'of, makes the library rebuild a tower). Return as the spec\'s loss '
          f'the tensor you pass to the optimizer, or turn sync_batch_norm off.')
    i = self._calls.get(tower, 0)
    self._calls[tower] = i + 1
    while len(self._keys) <= i:
      self._keys.append(_instance_keys(self._graph, 4))
    return self._keys[i]

  def _all_reduce(self, t: tf.Tensor, forward_key: int, backward_key: int) -> tf.Tensor:
    """Sum of `t` over the towers; its gradient is the sum of theirs."""
    size, group = len(self._devices), self._group_key

    @tf.custom_gradient
    def reduce(value):
      total = collective_ops.all_reduce(value, size, group, forward_key, 'Add', 'Id')

      def grad(upstream):
        return collective_ops.all_reduce(upstream, size, group, backward_key, 'Add', 'Id')
      return total, grad
    return reduce(t)


def _dims(x: tf.Tensor, axes: Sequence[int], ones: Sequence[int] = ()) -> list:
  """The sizes of `x` along `axes` (Python ints where static), 1 for `ones`."""
  return [1 if a in ones else (x.shape[a] if x.shape[a] is not None else tf.shape(x)[a])
          for a in axes]


def _rows(x: tf.Tensor, axes: Sequence[int]) -> tf.Tensor:
  """`x` as a matrix: one row per element of the reduced `axes`, a column per rest."""
  rest = [a for a in range(x.shape.rank) if a not in axes]
  width = 1
  for size in _dims(x, rest):
    width = width * size
  perm = list(axes) + rest
  if perm != list(range(x.shape.rank)):
    x = tf.transpose(x, perm)
  return tf.reshape(x, [-1, width])


def _calling_layer() -> Any:
  """The nearest Keras layer (or tf.compat.v1.layers layer) on the call stack."""
  frame = sys._getframe(3)  # pylint: disable=protected-access
  for _ in range(24):
    if frame is None:
      return None
    candidate = frame.f_locals.get('self')
    if hasattr(candidate, 'call') and hasattr(candidate, 'trainable_weights'):
      return candidate
    frame = frame.f_back
  return None


def _is_batch_norm(layer: Any) -> bool:
  """Whether the layer that asks for statistics is a batch norm.

  Keras' LayerNormalization computes per-example statistics with TensorFlow's
  fused batch-norm kernel (each example a channel): not a batch statistic.
  """
  if layer is None:
    return True
  if not all(hasattr(layer, name) for name in ('moving_mean', 'moving_variance')):
    return False
  for option, off in _UNSYNCABLE:
    value = getattr(layer, option, off)
    if value is not off and value != off:
      raise BatchNormSyncError(
          f'Batch-norm layer {getattr(layer, "name", layer)!r} has '
          f'{option}={value!r}, which cannot be synchronised across towers '
          f'exactly (its result depends on how the batch is split). Remove '
          f'{option} ({option}={off!r}) or turn sync_batch_norm off.')
  return True
