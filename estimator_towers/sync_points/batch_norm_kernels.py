"""The fused batch-norm kernels of a synchronised batch norm, and its registered gradient.

TensorFlow's fused kernels with one call's epsilon and data format
(`FusedKernel`: the inference kernel that normalises a shard with the
global statistics, and its gradient), and the gradient of the IdentityN
that carries a synchronised fused batch norm (`register_gradient`): it
looks the call's gradient up in `pending_gradients` by graph and op name,
where `batch_norm` put it. The rule: this module holds TensorFlow's kernels
and the registry only; what the gradient computes (the exchange of the two
per-channel sums) is `batch_norm`'s.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

# The gradient of a synchronised batch norm: an IdentityN carries it (the fused path's of
# (y, x, scale, offset), the grid's moments' of (mean, M2, x)); the function, given the
# gradients of the IdentityN's outputs, is looked up by graph and op name.
GRADIENT = 'EstimatorTowersSyncBatchNorm'
pending_gradients: 'weakref.WeakKeyDictionary[tf.Graph, dict]' = weakref.WeakKeyDictionary()
_registered = []


def register_gradient() -> None:
  if not _registered:
    tf.RegisterGradient(GRADIENT)(_sync_gradient)
    _registered.append(GRADIENT)


def _sync_gradient(op: tf.Operation, *grads) -> list:
  grad = pending_gradients.get(op.graph, {}).get(op.name)
  if grad is None:
    raise LookupError(
        f'{op.name} is a synchronised batch norm that estimator_towers built in another '
        f'graph (this one was copied or imported); its gradient exists only in the graph '
        f'the towers were built in. Differentiate that graph, or build the towered '
        f'model_fn again in this one.')
  return grad(*grads)


class FusedKernel:
  """TensorFlow's fused batch-norm kernels, with one call's epsilon and data format."""

  def __init__(self, original, epsilon: float, data_format: str):
    self._original, self.epsilon, self._format = original, epsilon, data_format

  def apply(self, x, scale, offset, mean, variance):
    """scale * (x - mean) / sqrt(variance + epsilon) + offset per channel; reserve space 3."""
    y, _, _, _, _, reserve = self._original(
        x, scale, offset, mean, variance, epsilon=self.epsilon, exponential_avg_factor=1,
        data_format=self._format, is_training=False)
    return y, reserve

  def gradient(self, dy, x, scale, mean, variance, reserve):
    """scale / s * dy, sum(dy * (x - mean) / s) and sum(dy), s = sqrt(variance + epsilon).

    Channels first off a GPU: TensorFlow's CPU kernel of this gradient (without
    oneDNN) takes channels last only, so dy and x are transposed to it and dx back.
    """
    data_format = self._format
    if data_format.startswith('NC') and 'GPU' not in (x.device or '').upper():
      rank = x.shape.rank
      last = [0] + list(range(2, rank)) + [1]
      dy, x, data_format = tf.transpose(dy, last), tf.transpose(x, last), 'NHWC' if (
          rank == 4) else 'NDHWC'
    dx, dscale, doffset, _, _ = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=mean, reserve_space_2=variance,
        reserve_space_3=reserve, epsilon=self.epsilon, data_format=data_format,
        is_training=False)
    if data_format != self._format:
      dx = tf.transpose(dx, [0, x.shape.rank - 1] + list(range(1, x.shape.rank - 1)))
    return dx, dscale, doffset


def channel_axis(x: tf.Tensor, data_format: str) -> int:
  """The channel axis of a fused batch norm's input."""
  return 1 if data_format.startswith('NC') else x.shape.rank - 1
