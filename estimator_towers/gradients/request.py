"""A gradient request: one call of `tf.gradients` or `GradientTape.gradient`, flattened.

Whatever the model_fn calls to get gradients (`tf.gradients`,
`Optimizer.compute_gradients` / `minimize`, Keras legacy `get_gradients`, a
tape) reaches TensorFlow's graph gradients function or the tape's; both are
read into one `Request` (ys, xs, their initial gradients and the remaining
options), answered by a flat list of gradients and packed back into the shape
the caller expects.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import tensorflow as tf

from estimator_towers.base import interception

_GRAPH_SIGNATURE = inspect.signature(interception.graph_gradients)
_TAPE_SIGNATURE = inspect.signature(interception.tape_gradient)


@dataclasses.dataclass
class Request:
  """One gradient request, flattened.

  Attributes:
    kind: 'graph' (tf.gradients and everything built on it) or 'tape'.
    ys: the tensors differentiated.
    xs: the tensors or variables differentiated with respect to.
    grad_ys: the user's initial gradients per y (None entries: ones).
    options: the remaining arguments of the graph gradients function.
    structure: for 'tape', the nest structure of the sources.
  """
  kind: str
  ys: list
  xs: list
  grad_ys: list
  options: dict
  structure: Any = None

  @property
  def wants_variables(self) -> bool:
    return any(isinstance(x, tf.Variable) for x in self.xs)

  @property
  def stops(self) -> list:
    """The tensors the caller stopped the backward pass at."""
    return as_list(self.options.get('stop_gradients') or [])


def as_list(value: Any) -> list:
  return list(value) if isinstance(value, (list, tuple)) else [value]


def parse(kind: str, args: tuple, kwargs: dict) -> Request:
  """A Request from the arguments of an intercepted call."""
  if kind == 'graph':
    bound = _GRAPH_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    options = dict(bound.arguments)
    ys, xs = as_list(options.pop('ys')), as_list(options.pop('xs'))
    grad_ys = options.pop('grad_ys')
    grad_ys = [None] * len(ys) if grad_ys is None else as_list(grad_ys)
    return Request(kind, ys, xs, grad_ys, options)
  bound = _TAPE_SIGNATURE.bind(*args, **kwargs)
  bound.apply_defaults()
  arguments = bound.arguments
  ys = tf.nest.flatten(arguments['target'])
  output_gradients = arguments['output_gradients']
  grad_ys = ([None] * len(ys) if output_gradients is None
             else tf.nest.flatten(output_gradients))
  options = {'unconnected_gradients': arguments['unconnected_gradients']}
  return Request(kind, ys, tf.nest.flatten(arguments['sources']), grad_ys, options,
                 structure=arguments['sources'])


def pack(request: Request, grads: list) -> Any:
  """The answer in the shape the caller expects."""
  if request.kind == 'tape':
    return tf.nest.pack_sequence_as(request.structure, grads)
  return grads
