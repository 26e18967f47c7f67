"""One set of variables for all towers, whatever API created them.

Tower 0 is built first, with plain names and no tower prefix: every variable it
creates (through `tf.compat.v1.get_variable`, `tf.compat.v1.layers`, Keras
layers, `tf.Variable`, metrics, optimizers) is created normally and recorded in
creation order. Later towers run the same model_fn under a variable creator that
hands back tower 0's i-th variable for their i-th creation request, with a fresh
`get_variable` store and fresh variable-scope name counters so that
`get_variable` and `tf.compat.v1.layers` ask for exactly the names tower 0 asked
for. A tower that asks for a different variable is an error.

With replicas (a `replica_device` for tower k), tower k gets its own copy of
each of tower 0's floating-point global variables instead: a local variable
named '<plain name>/replica_k' on its device, initialized from the original,
not saved in checkpoints. While tower k is built, the copies stand in for their
originals in TRAINABLE_VARIABLES, so the model_fn's optimizer computes tower
k's gradients with respect to the copies; `primary` maps them back, and
`refresh` copies the updated values into the replicas after each update.
Metric and other local variables stay shared, so metrics stay exact.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import tensorflow as tf

from estimator_towers.base import interception

GraphKeys = tf.compat.v1.GraphKeys
# TensorFlow's own collection names (GLOBAL_VARIABLES, ...): never a model_fn's cache.
_STANDARD_KEYS = frozenset(getattr(GraphKeys, a) for a in dir(GraphKeys)
                           if a.isupper() and isinstance(getattr(GraphKeys, a), str))

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


def _only_local(graph: tf.Graph, variable: tf.Variable) -> None:
  """Puts `variable` in LOCAL_VARIABLES and in no other variable collection."""
  keys = (GraphKeys.GLOBAL_VARIABLES, GraphKeys.TRAINABLE_VARIABLES,
          GraphKeys.LOCAL_VARIABLES)
  for key in keys:
    collection = graph.get_collection_ref(key)
    collection[:] = [v for v in collection if v is not variable]
  graph.add_to_collection(GraphKeys.LOCAL_VARIABLES, variable)


def _stand_in(graph: tf.Graph, original: tf.Variable, copy: tf.Variable) -> None:
  """`copy` takes `original`'s place in TRAINABLE_VARIABLES (while a tower is built)."""
  trainable = graph.get_collection_ref(GraphKeys.TRAINABLE_VARIABLES)
  for i, v in enumerate(trainable):
    if v is original:
      trainable[i] = copy


class VariableSharing:
  """Records tower 0's variables and gives them (or copies) to the other towers.

  Args:
    variable_device: called with (shape, dtype, name) of each new variable;
      returns the device string it is created on.
    replica_device: called with a tower index k > 0; returns the device of
      tower k's copies, or None for the shared variables. None: no copies.
  """

  def __init__(self, variable_device: Callable[[tf.TensorShape | None, tf.DType | None, str], str],
               replica_device: Callable[[int], str | None] | None = None):
    self._variable_device = variable_device
    self._replica_device = replica_device or (lambda tower: None)
    self.variables: list[tf.Variable] = []
    self._requested_names: list[str] = []  # before the graph made them unique
    self._primaries: dict[int, tf.Variable] = {}  # id(copy) -> original
    self._replicas: dict[int, tuple[tf.Variable, list[tf.Variable]]] = {}  # id(original) -> copies
    self._copies: dict[tuple[int, int], tf.Variable] = {}  # (id(original), tower) -> copy
    self._initial_reads: dict[int, tf.Tensor] = {}  # id(original) -> its copies' initial value
    self._suspended = 0  # > 0 while another tower is built inside tower 0
    # (first, end) positions in the graph's op list of the ops made to create
    # variables: tower 0 makes them, the other towers do not.
    self.creation_spans: list[tuple[int, int]] = []

  @contextlib.contextmanager
  def _creation_span(self) -> Iterator[None]:
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, 'outer_graph', None) is not None:  # a loop's body: lifted out
      graph = graph.outer_graph
    first = graph.version
    try:
      yield
    finally:
      self.creation_spans.append((first, graph.version))

  def copy_of(self, variable: tf.Variable, tower: int) -> tf.Variable | None:
    """Tower `tower`'s copy of `variable`, or None if it uses the variable itself."""
    return self._copies.get((id(variable), tower))

  @contextlib.contextmanager
  def suspended(self) -> Iterator[None]:
    """Tower 0's creator passes requests through (another tower is being built)."""
    self._suspended += 1
    try:
      yield
    finally:
      self._suspended -= 1

  def primary(self, variable: tf.Variable) -> tf.Variable:
    """The variable a tower's copy replicates; any other variable itself."""
    return self._primaries.get(id(variable), variable)

  def refresh(self, after_op: tf.Operation | tf.Tensor) -> tf.Operation | tf.Tensor:
    """An op that, after `after_op`, copies every original into its replicas.

    Each original is read once, on its device, and assigned to each copy on the
    copy's device. Returns `after_op` itself when there are no copies.
    """
    if not self._replicas:
      return after_op
    assigns = []
    with tf.name_scope('refresh_replicas'), tf.control_dependencies([after_op]):
      for original, copies in self._replicas.values():
        with tf.device(original.device):
          value = original.read_value()
        for copy in copies:
          with tf.device(copy.device):
            assigns.append(copy.assign(value, read_value=False))
      return tf.group(*assigns)

  def _replicate(self, next_creator: Callable, original: tf.Variable, tower: int,
                 device: str) -> tf.Variable:
    """Tower `tower`'s copy of `original` on `device`, a local variable."""
    graph = tf.compat.v1.get_default_graph()
    # The initial value is read once for all copies, on the original's device,
    # outside the tower's control flow and control dependencies, in the
    # original's name scope.
    initial_value = self._initial_reads.get(id(original))
    if initial_value is None:
      with tf.init_scope(), graph.name_scope(f'{original.op.name}/'), \
          tf.device(original.device), self._creation_span():
        initial_value = self._initial_reads[id(original)] = original.read_value()
    with graph.name_scope(None), tf.device(device), self._creation_span():  # not under tower_k/
      copy = next_creator(
          initial_value=initial_value, name=f'{original.op.name}/replica_{tower}',
          trainable=original.trainable, collections=[GraphKeys.LOCAL_VARIABLES],
          dtype=original.dtype.base_dtype, validate_shape=original.shape.is_fully_defined(),
          use_resource=True)
    _only_local(graph, copy)
    _stand_in(graph, original, copy)
    self._primaries[id(copy)] = original
    self._copies[(id(original), tower)] = copy
    self._replicas.setdefault(id(original), (original, []))[1].append(copy)
    return copy

  def replicas(self, tower: int, count: int) -> list[tuple[tf.Variable, tf.Variable]]:
    """Tower `tower`'s copies of tower 0's first `count` variables: (original, copy) pairs.

    What `reusing` would hand a built tower, for a tower that is copied
    instead (`tower_copies`): the copies are made now where they are missing.
    Empty without a replica device for the tower.
    """
    device = self._replica_device(tower)
    if device is None:
      return []
    graph = tf.compat.v1.get_default_graph()
    replicated = {id(v) for v in graph.get_collection(GraphKeys.GLOBAL_VARIABLES)
                  if v.dtype.base_dtype.is_floating}
    trainable = list(graph.get_collection(GraphKeys.TRAINABLE_VARIABLES))
    found = []
    with self.suspended():
      for variable in self.variables[:count]:
        if id(variable) in replicated:
          copy = self._copies.get((id(variable), tower))
          if copy is None:
            copy = self._replicate(lambda **kwargs: tf.compat.v1.Variable(**kwargs),
                                   variable, tower, device)
          found.append((variable, copy))
    graph.get_collection_ref(GraphKeys.TRAINABLE_VARIABLES)[:] = trainable  # no stand-ins
    return found

  @contextlib.contextmanager
  def creating(self) -> Iterator[None]:
    """Scope of tower 0: variables are created, placed and recorded."""

    def creator(next_creator, **kwargs):
      if self._suspended:
        return next_creator(**kwargs)
      device = self._variable_device(_requested_shape(kwargs),
                                     _requested_dtype(kwargs),
                                     kwargs.get('name') or 'Variable')
      with tf.device(device), self._creation_span():
        variable = next_creator(**kwargs)
      self.variables.append(variable)
      self._requested_names.append(_base_name(kwargs.get('name')))
      return variable

    with tf.compat.v1.variable_creator_scope(creator):
      yield

  def _cached_in_collections(self, graph: tf.Graph) -> dict:
    """Empties, and returns as they were, the model_fn's own collections of tower 0's
    variables (v1 shared embedding columns keep their table in one and create it only
    where it is empty): a tower built again asks for it, as tower 0 did."""
    created = {id(v) for v in self.variables}
    cached = {}
    for key in graph.get_all_collection_keys():
      items = graph.get_collection(key)
      if key not in _STANDARD_KEYS and items and all(id(v) in created for v in items):
        cached[key] = list(items)
        graph.clear_collection(key)
    return cached

  @contextlib.contextmanager
  def reusing(self, tower: int, scope: interception.VariableScope | None = None,
              expected: int | None = None, copies: bool = True) -> Iterator[None]:
    """Scope of tower `tower` > 0: creation requests return tower 0's variables.

    With a replica device for the tower, they return its copies of tower 0's
    floating-point global variables instead; copies stand in for their
    originals in TRAINABLE_VARIABLES until the scope ends.

    Args:
      tower: the tower index.
      scope: the variable scope the tower starts in (default: the current one).
      expected: how many variables the tower must have asked for when the
        scope ends (default: as many as tower 0 created).
      copies: False to hand back the variables themselves even under replicas.
    """
    position = [0]
    device = self._replica_device(tower) if copies else None
    graph = tf.compat.v1.get_default_graph()
    replicated = set()
    if device is not None:
      replicated = {id(v) for v in graph.get_collection(GraphKeys.GLOBAL_VARIABLES)
                    if v.dtype.base_dtype.is_floating}
    made: dict[int, tf.Variable] = {}  # id(copy) -> original, this tower's

    def creator(next_creator, **kwargs):
      i = position[0]
      name = kwargs.get('name')
      if i >= (len(self.variables) if expected is None else expected):
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
      if id(variable) not in replicated:
        return variable
      copy = self._copies.get((id(variable), tower))  # a micro-batch's device
      if copy is None:
        copy = self._replicate(next_creator, variable, tower, device)
      else:
        _stand_in(graph, variable, copy)
      made[id(copy)] = variable
      return copy

    cached = self._cached_in_collections(graph)
    try:
      with interception.fresh_variable_store(scope), \
          tf.compat.v1.variable_creator_scope(creator):
        yield
    finally:
      trainable = graph.get_collection_ref(GraphKeys.TRAINABLE_VARIABLES)
      trainable[:] = [made.get(id(v), v) for v in trainable]
      for key, items in cached.items():
        graph.get_collection_ref(key)[:] = items
    if position[0] != (len(self.variables) if expected is None else expected):
      missing = self.variables[position[0]]
      raise TowerMismatchError(
          f'Tower {tower} created fewer variables than tower 0 '
          f'({position[0]} instead of '
          f'{len(self.variables) if expected is None else expected}; the first one '
          f'it did not create is {missing.name!r}). All towers run the same '
          f'model_fn and must create the same variables in the same order.')
