"""TensorBoard scalars across towers: each tower's own, and means over the global batch.

`tower_summaries(losses, sizes)` is called by the towered model_fn once every
tower is built (TRAIN and EVAL): it writes `towers/<k>/loss` and
`towers/<k>/shard_size` for each tower k, and completes the `global_mean`
scalars the towers recorded.

`global_mean(name, value)` is for the model_fn itself: a per-shard mean such
as the batch accuracy becomes, in a towered run, the mean over the global
batch (each tower's value weighted by its shard size) instead of tower 0's
shard alone. It works unchanged in a plain model_fn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Sequence
import weakref

import tensorflow as tf

from estimator_towers.placement import devices as devices_lib
from estimator_towers.towers import tower_context

_lock = threading.Lock()
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {name: _Mean}


@dataclasses.dataclass
class _Mean:
  scope: str                      # Reserved name scope of the combined tensor.
  values: dict                    # tower index -> that tower's scalar
  builds: dict                    # tower index -> the build that recorded it


def _summary_device(tensor: tf.Tensor) -> contextlib.AbstractContextManager:
  """Summaries of a tensor go on the host CPU of its device (no change if unpinned)."""
  if not tensor.device:
    return contextlib.nullcontext()
  return tf.device(devices_lib.host_device(tensor.device))


def _scalar_summary(tag: str, tensor: tf.Tensor) -> None:
  graph = tensor.graph
  with graph.name_scope(None), _summary_device(tensor):
    tf.compat.v1.summary.scalar(tag, tensor)


def _combined_name(scope: str) -> str:
  return f'{scope}/value:0'


def global_mean(name: str, value: tf.Tensor) -> str:
  """A scalar summary `name` of `value` averaged over the global batch.

  Call it in TRAIN (or EVAL) mode with a per-shard mean, before the
  optimizer call: in a towered model_fn each tower passes the value for its
  shard, and once all towers are built the summary holds
  sum_k size_k * value_k / sum_k size_k (towers with an empty shard count for
  nothing). In a plain model_fn, or with one tower, it is `value` itself.

  Args:
    name: the summary tag, e.g. 'train_accuracy'.
    value: a scalar, the mean over this tower's examples.

  Returns:
    The name of the combined scalar tensor, for hooks that take tensor names
    such as `tf.estimator.LoggingTensorHook` (the tensor itself may not exist
    yet when a tower other than the last one calls this).

  Raises:
    ValueError: if `value` is not a scalar, or the same tower uses `name` twice.

  Example:
      ```python
      accuracy = tf.reduce_mean(tf.cast(tf.equal(predictions, labels), tf.float32))
      name = estimator_towers.global_mean('train_accuracy', accuracy)  # before minimize()
      train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
      hooks = [tf.estimator.LoggingTensorHook({'train_accuracy': name}, every_n_iter=100)]
      ```
  """
  value = tf.convert_to_tensor(value)
  if value.shape.rank not in (None, 0):
    raise ValueError(f'global_mean({name!r}, value) needs a scalar (a mean over '
                     f'the batch), got shape {value.shape}.')
  graph = value.graph
  tower = tower_context.current_tower()
  with _lock:
    means = _pending.setdefault(graph, {})
    mean = means.get(name)
    if mean is None:
      with graph.name_scope(None):
        mean = _Mean(scope=graph.unique_name(f'global_mean/{name}'), values={},
                     builds={})
      means[name] = mean
    build = tower_context.current_build()
    if mean.builds.get(tower.index) == build:
      raise ValueError(
          f'global_mean({name!r}, ...) was called twice for tower {tower.index}; '
          f'give each scalar its own name.')
    mean.values[tower.index] = value  # A second build of a tower replaces its first.
    mean.builds[tower.index] = build
  if tower.num_towers == 1:
    _complete(graph, {0: 1}, [0])
  return _combined_name(mean.scope)


def _complete(graph: tf.Graph, sizes: dict, built: Sequence[int]) -> None:
  """Builds the pending global means of `graph`, weighting tower k by sizes[k].

  Raises:
    ValueError: if a tower in `built` recorded no value for a mean.
  """
  with _lock:
    means = _pending.pop(graph, {})
  for name, mean in means.items():
    missing = sorted(set(built) - set(mean.values))
    if missing:
      raise ValueError(
          f'global_mean({name!r}, ...) was called by tower(s) '
          f'{sorted(mean.values)} but not by tower(s) {missing}: towers other '
          f'than tower 0 are built only up to their first gradient request, so '
          f'call global_mean before the optimizer call (minimize, '
          f'compute_gradients, get_updates).')
    first = mean.values[min(mean.values)]
    with graph.name_scope(mean.scope + '/'), _summary_device(first):
      if len(mean.values) == 1:
        combined = tf.identity(first, name='value')
      else:
        total, weight = [], []
        for k, value in sorted(mean.values.items()):
          size = tf.cast(sizes[k], tf.float32)
          total.append(tf.where(size > 0, tf.cast(value, tf.float32) * size, 0.0))
          weight.append(size)
        combined = tf.identity(tf.add_n(total) / tf.maximum(tf.add_n(weight), 1.0),
                               name='value')
    _scalar_summary(name, combined)


def tower_summaries(losses: Sequence[tf.Tensor | None], sizes: Sequence) -> None:
  """Per-tower scalars under `towers/`, and the towers' `global_mean` scalars.

  Call it once per graph, after every tower is built.

  Args:
    losses: tower k's loss (the scalar its model_fn minimizes or returns), in
      tower order; None for a tower that was not built (a statically empty
      shard).
    sizes: tower k's shard size (int or int32 scalar Tensor), in tower order.

  Raises:
    ValueError: for lists of different lengths, or a global_mean that a built
      tower did not record (called after the optimizer call).
  """
  if len(losses) != len(sizes):
    raise ValueError(f'tower_summaries needs one loss and one size per tower, '
                     f'got {len(losses)} losses and {len(sizes)} sizes.')
  graph = tf.compat.v1.get_default_graph()
  for k, (loss, size) in enumerate(zip(losses, sizes)):
    if loss is None:
      continue
    loss = tf.convert_to_tensor(loss)
    _scalar_summary(f'towers/{k}/loss', loss)
    with _summary_device(loss):
      size = tf.cast(size, tf.float32)
    _scalar_summary(f'towers/{k}/shard_size', size)
  _complete(graph, dict(enumerate(sizes)),
            [k for k, loss in enumerate(losses) if loss is not None])


def of_built_towers(built: Sequence[int], losses: Sequence, sizes: Sequence) -> None:
  """`tower_summaries` for the built shards `built` (their `losses`) of all `sizes`."""
  by_tower = dict(zip(built, losses))
  tower_summaries([by_tower.get(k) for k in range(len(sizes))], sizes)
