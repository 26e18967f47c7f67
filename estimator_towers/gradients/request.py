"""A gradient request: one call of `tf.gradients` or `GradientTape.gradient`, flattened.

Whatever the model_fn calls to get gradients (`tf.gradients`,
`Optimizer.compute_gradients` / `minimize`, Keras legacy `get_gradients`, a
tape) reaches TensorFlow's graph gradients function or the tape's; both are
read into one `Request` (ys, xs, their initial gradients and the remaining
options), answered by a flat list of gradients and packed back into the shape
the caller expects. A ref variable's ref tensor among the xs (what
`compute_gradients` asks about under `disable_resource_variables()`) is read as
its variable: TensorFlow differentiates a ref variable with respect to that
same tensor, so the request is with respect to variables under either kind.
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
    return Request(kind, ys, _ref_variables_read(xs), grad_ys, options)
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


_VARIABLE_COLLECTIONS = (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                         tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
                         tf.compat.v1.GraphKeys.MODEL_VARIABLES,
                         tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)


def is_ref_variable(x: Any) -> bool:
  """Whether `x` is a ref variable (`disable_resource_variables()`), updated in place."""
  return isinstance(x, tf.Variable) and _is_ref(x.op.outputs[0])


def _is_ref(t: tf.Tensor) -> bool:
  return t.dtype != t.dtype.base_dtype


def _ref_variables_read(xs: list) -> list:
  """`xs`, each ref variable's ref tensor (its `VariableV2`'s output) replaced by the variable."""
  refs = [x for x in xs if isinstance(x, tf.Tensor) and _is_ref(x)]
  if not refs:
    return xs
  graph = refs[0].graph
  by_ref = {}
  for name in _VARIABLE_COLLECTIONS:
    for v in graph.get_collection(name):
      if is_ref_variable(v):
        by_ref.setdefault(v.op.outputs[0].ref(), v)
  return [by_ref.get(x.ref(), x) if isinstance(x, tf.Tensor) else x for x in xs]


def pack(request: Request, grads: list) -> Any:
  """The answer in the shape the caller expects."""
  if request.kind == 'tape':
    return tf.nest.pack_sequence_as(request.structure, grads)
  return grads
