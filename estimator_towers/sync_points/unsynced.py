"""Batch norms left per tower (or per micro-batch), said out loud.

Without synchronisation each shard's batch norms normalise it with the
shard's own statistics, which makes a step differ from one device's. That
happens in two cases, each told at graph construction, never silently:

- `sync_batch_norm=False` on several shards (towers, micro-batches or
  workers): the user's opt-out. One warning per graph lists the batch norms
  the first tower built (their name scopes).
- `sync_batch_norm` left unset with `micro_batches` > 1: the global batch's
  statistics would need every micro-batch's activations at once, which is
  what micro-batches avoid, so there is no exact default. The first batch
  norm a tower builds in TRAIN is an error that names the choice
  (`sync_batch_norm=False`); a model without batch norm trains as before.

With one shard (one device, no micro-batches, one worker) the shard is the
global batch: nothing to say. Which calls are batch norms is
`batch_norm_calls`'s; the synchronised path is `batch_norm`'s.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.sync_points import batch_norm_calls as calls
from estimator_towers.towers import tower_context

OPT_OUT = 'opt_out'   # sync_batch_norm=False on several shards: a warning naming the layers
REFUSE = 'refuse'     # sync_batch_norm unset with micro-batches: a batch norm is an error


class Unsynced:
  """Per-shard batch statistics: nothing to synchronise; what they mean is said.

  Args:
    graph: the TRAIN graph (None with `reason` None).
    primary: the index of the first tower, whose batch norms are named.
    reason: None (one shard: nothing to say), `OPT_OUT` or `REFUSE`.
    micro_batches: the plan's micro-batches per device.
  """

  def __init__(self, graph: tf.Graph | None = None, primary: int = 0,
               reason: str | None = None, micro_batches: int = 1):
    self._graph = graph
    self._primary = primary
    self._reason = reason
    self._micro_batches = micro_batches
    self._names: list[str] = []

  def syncing(self) -> Any:
    """While active, the batch norms the first tower builds are noted (or refused)."""
    if self._reason is None:
      return contextlib.nullcontext()
    return interception.batch_norm_calls(self._fused, self._moments)

  def check_complete(self) -> None:
    """After the first tower: the opt-out's warning, once per graph, if it built batch norms."""
    if self._reason != OPT_OUT or not self._names:
      return
    shards = 'tower' if self._micro_batches == 1 else 'micro-batch'
    fix = ('Leave sync_batch_norm unset (the default) for the global batch\'s statistics, '
           'as on one device.' if self._micro_batches == 1 else
           'With micro_batches=1 and sync_batch_norm unset (the default) they would use '
           'the global batch\'s statistics, as on one device.')
    logs.warning_once_per_graph(
        f'sync_batch_norm=False (--nosync_batch_norm): {len(self._names)} batch norm(s) '
        f'normalise each {shards}\'s shard with its own statistics, so training differs '
        f'from one device and depends on the devices and micro-batches: '
        f'{", ".join(self._names)}. {fix}', self._graph)

  def copy_reason(self) -> None:
    return None

  def shared_ops(self) -> set:
    return set()

  def copied(self, primary: int, tower: int, counterpart: Callable) -> None:
    pass

  def joined_by(self, primary: int, tower: int) -> dict:
    return {}

  def copied_pass(self, primary: int, tower: int, counterpart: Callable, ops: set) -> None:
    pass

  # -- The intercepted calls ---------------------------------------------------

  def _fused(self, original, x, scale, offset, mean, variance, epsilon=0.0001,
             exponential_avg_factor=1, data_format='NHWC', is_training=True,
             name=None):
    if is_training and self._in_primary():
      layer = calls.calling_layer()
      if calls.is_batch_norm(layer, check_options=False):
        self._built(calls.name_of(layer, name))
    return original(x, scale, offset, mean, variance, epsilon=epsilon,
                    exponential_avg_factor=exponential_avg_factor,
                    data_format=data_format, is_training=is_training, name=name)

  def _moments(self, original, x, axes, shift=None, name=None, keep_dims=None,
               keepdims=None):
    keep = bool(keep_dims if keepdims is None else keepdims)
    x = tf.convert_to_tensor(x)
    if self._in_primary() and calls.over_batch_axis(x, axes):
      layer = calls.calling_layer()
      if calls.is_batch_norm(layer, check_options=False):
        self._built(calls.name_of(layer, name))
    return original(x, axes, shift=shift, name=name, keep_dims=keep)

  def _in_primary(self) -> bool:
    if tf.compat.v1.get_default_graph() is not self._graph:
      return False
    context, build = tower_context.peek()
    return bool(build) and context.index == self._primary

  def _built(self, name: str) -> None:
    """The first tower built the batch norm `name`: noted, or refused."""
    if self._reason == REFUSE:
      k = self._micro_batches
      raise calls.BatchNormSyncError(
          f'Batch norm {name!r} with micro_batches={k}: the global batch\'s statistics '
          f'need every micro-batch\'s activations at once, which micro-batches avoid. '
          f'Choose sync_batch_norm=False (--nosync_batch_norm): each micro-batch '
          f'normalises with its own statistics, and the result then depends on the '
          f'devices and micro-batches; or micro_batches=1, where batch norm uses the '
          f'global batch\'s statistics by default.')
    if name not in self._names:
      self._names.append(name)
