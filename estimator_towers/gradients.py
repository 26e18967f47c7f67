"""Deferring the user's optimizer calls and applying combined gradients once.

While towers are built, `apply_gradients` of `tf.compat.v1.train.Optimizer` and
of the Keras legacy `OptimizerV2` (which their `minimize` and `get_updates`
call) is intercepted: each call records its (gradient, variable) pairs and
returns a stand-in no-op that carries the user's control dependencies. After the
last tower, the k-th call of every tower is combined into one call: gradients
are weighted by their tower's share of the batch and summed on the variable's
device, then the real `apply_gradients` of tower 0's optimizer runs once, in
tower 0's name scope, with the user's original arguments (so `global_step`
advances by exactly one). Tower 0's stand-in is then made to wait for the real
update, so everything the user hung on its train_op runs in the single-device
order.

A tower that reads its own copies of the variables (the 'replicated' placement)
computes gradients with respect to the copies; they are recorded against the
variables the copies replicate, so the same variable's gradients from every
tower are combined and applied to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import tensorflow as tf
from tensorflow.python.training import optimizer as v1_optimizer  # pylint: disable=g-direct-tensorflow-import

try:  # Keras 2.15's legacy optimizer base class.
  from keras.src.optimizers.legacy import optimizer_v2 as _keras_optimizer_v2  # pylint: disable=g-import-not-at-top
  _OPTIMIZER_CLASSES = (v1_optimizer.Optimizer, _keras_optimizer_v2.OptimizerV2)
except ImportError:  # pragma: no cover - keras layout differs
  _OPTIMIZER_CLASSES = (v1_optimizer.Optimizer,)


class DivergentTowersError(ValueError):
  """Towers made different optimizer calls."""


@dataclasses.dataclass
class DeferredApply:
  """One intercepted `apply_gradients` call of one tower."""
  optimizer: Any
  grads_and_vars: list
  args: tuple
  kwargs: dict
  name_scope: str
  stand_in: tf.Operation


class GradientCollector:
  """Intercepts `apply_gradients` while towers are built.

  Args:
    primary: maps a variable a tower computed gradients for (its own copy of a
      replicated variable) to the variable that is updated; the identity when
      towers share the variables.
  """

  def __init__(self, primary: Callable[[tf.Variable], tf.Variable] | None = None):
    self._primary = primary or (lambda variable: variable)
    self.calls: list[list[DeferredApply]] = []
    self._tower: list[DeferredApply] | None = None

  @contextlib.contextmanager
  def collecting(self) -> Iterator[list[DeferredApply]]:
    """Scope of one tower: its `apply_gradients` calls are deferred."""
    tower: list[DeferredApply] = []
    self.calls.append(tower)
    self._tower = tower
    originals = {cls: cls.__dict__['apply_gradients'] for cls in _OPTIMIZER_CLASSES}
    for cls, original in originals.items():
      setattr(cls, 'apply_gradients', self._intercept(original))
    try:
      yield tower
    finally:
      for cls, original in originals.items():
        setattr(cls, 'apply_gradients', original)
      self._tower = None

  def _intercept(self, original: Callable) -> Callable:
    collector = self

    def apply_gradients(optimizer, grads_and_vars, *args, **kwargs):
      if collector._tower is None:
        return original(optimizer, grads_and_vars, *args, **kwargs)
      grads_and_vars = [(g, collector._primary(v)) for g, v in grads_and_vars]
      graph = tf.compat.v1.get_default_graph()
      stand_in = tf.no_op(name='deferred_apply_gradients')
      collector._tower.append(DeferredApply(
          optimizer=optimizer, grads_and_vars=grads_and_vars, args=args,
          kwargs=kwargs, name_scope=graph.get_name_scope(), stand_in=stand_in))
      return stand_in

    apply_gradients.__wrapped__ = original
    return apply_gradients

  def check_towers_agree(self) -> None:
    """Raises DivergentTowersError unless every tower made the same calls."""
    reference = self.calls[0]
    for k, tower in enumerate(self.calls[1:], start=1):
      if len(tower) != len(reference):
        raise DivergentTowersError(
            f'Tower {k} called apply_gradients/minimize {len(tower)} times but '
            f'tower 0 called it {len(reference)} times. Every tower runs the '
            f'same model_fn and must make the same optimizer calls; do not '
            f'branch on the shard or device around optimizer calls.')
      for c, (mine, ref) in enumerate(zip(tower, reference)):
        mine_vars = [v for _, v in mine.grads_and_vars]
        ref_vars = [v for _, v in ref.grads_and_vars]
        if [id(v) for v in mine_vars] != [id(v) for v in ref_vars]:
          raise DivergentTowersError(
              f'Optimizer call #{c} of tower {k} updates variables '
              f'{[v.name for v in mine_vars]} but the same call of tower 0 '
              f'updates {[v.name for v in ref_vars]}. Every tower must make '
              f'the same optimizer calls on the same variables.')

  def apply(self, weights: Sequence, nonempty: Sequence,
            aggregation_device: Callable[[tf.Variable], str]) -> list[tf.Operation]:
    """Builds the real updates; returns them (tower 0's stand-ins now wait on them)."""
    self.check_towers_agree()
    graph = tf.compat.v1.get_default_graph()
    updates = []
    for c, first in enumerate(self.calls[0]):
      combined = []
      for j, (_, variable) in enumerate(first.grads_and_vars):
        grads = [tower[c].grads_and_vars[j][0] for tower in self.calls]
        with tf.device(aggregation_device(variable)):
          with tf.name_scope('combine_gradients'):
            combined.append((combine(grads, weights, nonempty), variable))
      scope = first.name_scope + '/' if first.name_scope else ''
      with graph.name_scope(scope), \
          tf.control_dependencies(first.stand_in.control_inputs):
        update = first.optimizer.apply_gradients(combined, *first.args, **first.kwargs)
      update_op = update if isinstance(update, tf.Operation) else update.op
      first.stand_in._add_control_input(update_op)  # pylint: disable=protected-access
      updates.append(update_op)
    return updates


def _scale(grad: Any, weight: Any, nonempty: Any) -> Any:
  """weight * grad, or zeros when the tower's shard is empty (its grad may be NaN)."""
  values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
  unit = isinstance(weight, (int, float)) and weight == 1
  scaled = values if unit else values * tf.cast(weight, values.dtype)
  if nonempty is not True:
    scaled = tf.where(nonempty, scaled, tf.zeros_like(scaled))
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(scaled, grad.indices, grad.dense_shape)
  return scaled


def combine(grads: Sequence, weights: Sequence, nonempty: Sequence) -> Any:
  """Weighted sum of one variable's per-tower gradients (None where no tower has one).

  Args:
    grads: per-tower gradients (Tensor, IndexedSlices or None).
    weights: per-tower weights (Python floats or scalar Tensors).
    nonempty: per-tower booleans (Python or scalar Tensors); False drops the tower.
  """
  parts = [_scale(g, w, ne) for g, w, ne in zip(grads, weights, nonempty)
           if g is not None and ne is not False]
  if not parts:
    return None
  if len(parts) == 1:
    return parts[0]
  if all(isinstance(p, tf.IndexedSlices) for p in parts):
    return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                            tf.concat([p.indices for p in parts], 0),
                            parts[0].dense_shape)
  return tf.add_n([tf.convert_to_tensor(p) for p in parts])
