"""One set of variables for all towers, whatever API created them.

Tower 0 is built first, with plain names and no tower prefix: every variable it
creates (through `tf.compat.v1.get_variable`, `tf.compat.v1.layers`, Keras
layers, `tf.Variable`, metrics, optimizers) is created normally and recorded in
creation order. Later towers run the same model_fn under a variable creator that
hands back tower 0's i-th variable for their i-th creation request, with a fresh
`get_variable` store and fresh variable-scope name counters so that
`get_variable` and `tf.compat.v1.layers` ask for exactly the names tower 0 asked
for. A tower that asks for a different variable is an error.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import tensorflow as tf
from tensorflow.python.ops import variable_scope as vs  # pylint: disable=g-direct-tensorflow-import


class TowerMismatchError(ValueError):
  """Towers built from the same model_fn created different variables."""


def _base_name(name: str | None) -> str:
  if not name:
    return 'Variable'
  return name.split(':')[0].rsplit('/', 1)[-1]


def _requested_shape(kwargs: dict) -> tf.TensorShape | None:
  shape = kwargs.get('shape')
  if shape is not None:
    return tf.TensorShape(shape)
  initial = kwargs.get('initial_value')
  if isinstance(initial, (tf.Tensor, tf.Variable)):
    return initial.shape
  return None


def _requested_dtype(kwargs: dict) -> tf.DType | None:
  dtype = kwargs.get('dtype')
  if dtype is not None:
    return tf.as_dtype(dtype).base_dtype
  initial = kwargs.get('initial_value')
  if isinstance(initial, (tf.Tensor, tf.Variable)):
    return initial.dtype.base_dtype
  return None


class VariableSharing:
  """Records tower 0's variables and gives them to the other towers.

  Args:
    variable_device: called with (shape, dtype, name) of each new variable;
      returns the device string it is created on.
  """

  def __init__(self, variable_device: Callable[[tf.TensorShape | None, tf.DType | None, str], str]):
    self._variable_device = variable_device
    self.variables: list[tf.Variable] = []
    self._requested_names: list[str] = []  # before the graph made them unique

  @contextlib.contextmanager
  def creating(self) -> Iterator[None]:
    """Scope of tower 0: variables are created, placed and recorded."""

    def creator(next_creator, **kwargs):
      device = self._variable_device(_requested_shape(kwargs),
                                     _requested_dtype(kwargs),
                                     kwargs.get('name') or 'Variable')
      with tf.device(device):
        variable = next_creator(**kwargs)
      self.variables.append(variable)
      self._requested_names.append(_base_name(kwargs.get('name')))
      return variable

    with tf.compat.v1.variable_creator_scope(creator):
      yield

  @contextlib.contextmanager
  def reusing(self, tower: int) -> Iterator[None]:
    """Scope of tower `tower` > 0: creation requests return tower 0's variables."""
    position = [0]

    def creator(next_creator, **kwargs):  # pylint: disable=unused-argument
      i = position[0]
      name = kwargs.get('name')
      if i >= len(self.variables):
        raise TowerMismatchError(
            f'Tower {tower} created more variables than tower 0: its '
            f'variable #{i} ({_base_name(name)!r}) has no counterpart. All '
            f'towers run the same model_fn and must create the same '
            f'variables in the same order; do not branch on anything that '
            f'differs between towers (such as the shard or device) when '
            f'creating variables.')
      variable = self.variables[i]
      shape, dtype = _requested_shape(kwargs), _requested_dtype(kwargs)
      same = (_base_name(name) == self._requested_names[i]
              and (shape is None or shape.is_compatible_with(variable.shape))
              and (dtype is None or dtype == variable.dtype.base_dtype))
      if not same:
        raise TowerMismatchError(
            f'Tower {tower} created a different variable than tower 0: its '
            f'variable #{i} is {_base_name(name)!r} (shape {shape}, dtype '
            f'{dtype}) but tower 0 created {variable.name!r} (shape '
            f'{variable.shape}, dtype {variable.dtype.base_dtype}). All towers '
            f'run the same model_fn and must create the same variables in '
            f'the same order; do not branch on anything that differs between '
            f'towers when creating variables.')
      position[0] += 1
      return variable

    scope_stores = tf.compat.v1.get_collection_ref(vs._VARSCOPESTORE_KEY)  # pylint: disable=protected-access
    saved_scope_stores = list(scope_stores)
    fresh = vs._VariableScopeStore()  # pylint: disable=protected-access
    fresh.current_scope = vs.get_variable_scope()
    scope_stores[:] = [fresh]
    try:
      with vs.with_variable_store(vs._VariableStore()), \
          tf.compat.v1.variable_creator_scope(creator):  # pylint: disable=protected-access
        yield
    finally:
      scope_stores[:] = saved_scope_stores
    if position[0] != len(self.variables):
      missing = self.variables[position[0]]
      raise TowerMismatchError(
          f'Tower {tower} created fewer variables than tower 0 '
          f'({position[0]} instead of {len(self.variables)}; the first one '
          f'it did not create is {missing.name!r}). All towers run the same '
          f'model_fn and must create the same variables in the same order.')
