"""Which intercepted calls are batch norms, and what to call them in a message.

The batch-norm interception (`interception.batch_norm_calls`) sees every
`fused_batch_norm_v3` and `tf.nn.moments` a tower builds. A call is a batch
norm when it computes statistics over the batch axis in training and the
layer that makes it (the nearest Keras or `tf.compat.v1.layers` layer on the
call stack) is a batch norm, or no layer does (a direct
`tf.compat.v1.nn.fused_batch_norm`, a hand-written batch norm on
`tf.nn.moments`). Keras' `LayerNormalization` runs on the fused kernel with
each example a channel: not a batch statistic. Both the synchronised path
(`batch_norm`) and the per-tower one (`unsynced`) ask this module.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import tensorflow as tf

# Layer options that make a batch norm's result depend on how the batch is
# split; the value that turns each off.
UNSYNCABLE = (('renorm', False), ('virtual_batch_size', None), ('adjustment', None))


class BatchNormSyncError(ValueError):
  """A batch norm that cannot be synchronised across towers."""


def calling_layer() -> Any:
  """The nearest Keras layer (or tf.compat.v1.layers layer) on the call stack.

  Called by an interception handler, itself called by `interception`'s
  wrapper: the search starts at the wrapper's caller.
  """
  frame = sys._getframe(3)  # pylint: disable=protected-access
  for _ in range(24):
    if frame is None:
      return None
    candidate = frame.f_locals.get('self')
    if hasattr(candidate, 'call') and hasattr(candidate, 'trainable_weights'):
      return candidate
    frame = frame.f_back
  return None


def is_batch_norm(layer: Any, check_options: bool = True) -> bool:
  """Whether the layer that asks for statistics is a batch norm.

  With `check_options`, a batch norm whose options make its result depend on
  how the batch is split (`UNSYNCABLE`) is an error naming the option.
  """
  if layer is None:
    return True
  if not all(hasattr(layer, name) for name in ('moving_mean', 'moving_variance')):
    return False
  for option, off in UNSYNCABLE if check_options else ():
    value = getattr(layer, option, off)
    if value is not off and value != off:
      raise BatchNormSyncError(
          f'Batch-norm layer {getattr(layer, "name", layer)!r} has '
          f'{option}={value!r}, which cannot be synchronised across towers '
          f'exactly (its result depends on how the batch is split). Remove '
          f'{option} ({option}={off!r}) or pass sync_batch_norm=False '
          f'(--nosync_batch_norm): per-tower statistics.')
  return True


def over_batch_axis(x: tf.Tensor, axes) -> bool:
  """Whether moments of `x` over `axes` include the batch axis 0."""
  rank = x.shape.rank
  return rank is not None and 0 in [int(a) % rank for a in np.ravel(axes)]


def name_of(layer: Any, name: str | None) -> str:
  """What a message calls the batch norm being built: its name scope (or layer, or op name)."""
  scope = tf.compat.v1.get_default_graph().get_name_scope()
  if scope:
    return scope
  if layer is not None and getattr(layer, 'name', None):
    return layer.name
  return name or 'FusedBatchNormV3'
