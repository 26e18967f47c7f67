"""Staged input: per-device shards prefetched onto their tower devices.

`staged_input_fn(input_fn, plan)` wraps an ordinary Estimator input_fn (one that
returns a `tf.data.Dataset` of global batches). The wrapper makes an iterator
and returns its host batch to Estimator unchanged. When the towered model_fn of
the same plan receives that batch, it calls `staged_shards`, which builds the
staging instead of splitting the host batch, and attaches the hook that drives
it to the returned spec (training, evaluation or prediction hooks), so that
users pass no hooks. The host batch is then never fetched, so nothing else pulls
from the input. A model_fn that is not towered simply uses the host batch.

The scheme (tf_cnn_benchmarks'; `staging_backend='staging_area'`, the only
backend): one put op pulls the next global batch from the iterator as an
Optional, splits it on the host with the towered model_fn's rule and puts shard
k into a StagingArea placed on tower k's device; tower k reads its shard with
that area's get op. `StagingHook` primes `staging_depth` puts when a session is
created, then runs one put in every step, in the same session.run as the
compute that consumes the oldest staged shards, so the copy of the next inputs
to each device overlaps the current step. At the end of input the put stages
nothing and returns False (it reads an Optional, so the end is never an
error); the hook counts the staged batches in Python, requests a stop after the
step that consumes the last one, and raises OutOfRangeError (MonitoredSession's
end of input) if a step would start with nothing staged (an empty dataset). So
no step loses or repeats a batch, none is left in an area, and no get waits on
an empty area.

Input errors: an error of the input pipeline (or of the host-side split, e.g.
the run-time batch-size check) fails the put, and with it the step (or the
session's creation, when it occurs while priming) with that error. The end of
input is only ever the put's False, never an error, so an input error is never
taken for the end of input.

A 'multi_device_iterator' backend (tf.data's MultiDeviceIterator) was removed:
MultiDeviceIterator hands a failed element to one device only and ends the
other devices' sequences, so a step could fail with OutOfRangeError and the
input error pass for the end of input; reading the devices in tower order fixed
that, but it stayed slower than this scheme on every measure (see
`REMOVED_BACKENDS`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.inputs import grid
from estimator_towers.inputs import sharding
from estimator_towers.settings import plan as plan_lib
from estimator_towers.settings import staging_backends

ModeKeys = tf.estimator.ModeKeys

# Arguments Estimator passes to an input_fn that names them.
_INPUT_FN_ARGS = ('mode', 'params', 'config', 'input_context')

# Per-graph registry of staged host batches, kept on the graph itself so that it
# dies with the graph and is never serialized into a MetaGraphDef (a collection
# of Python objects warns at every checkpoint).
_REGISTRY_ATTR = '_estimator_towers_staged_inputs'

# Which EstimatorSpec field carries the staging hook in each mode.
_HOOK_FIELDS = {
    ModeKeys.TRAIN: 'training_hooks',
    ModeKeys.EVAL: 'evaluation_hooks',
    ModeKeys.PREDICT: 'prediction_hooks',
}


@dataclasses.dataclass
class _HostBatch:
  """What staged_input_fn registers for the towered model_fn to find."""
  plan: plan_lib.DevicePlan
  iterator: Any  # tf.compat.v1.data.Iterator of the input_fn's dataset: the host batch.
  flat_features: tuple
  flat_labels: tuple | None
  staged: bool = False


def _registry(graph: tf.Graph) -> dict:
  registry = getattr(graph, _REGISTRY_ATTR, None)
  if registry is None:
    registry = {}
    setattr(graph, _REGISTRY_ATTR, registry)
  return registry


def _flat(structure: Any) -> tuple:
  return tuple(tf.nest.flatten(structure, expand_composites=True))


def _key(flat: Sequence) -> str | None:
  return flat[0].name if flat and isinstance(flat[0], tf.Tensor) else None


def _features_and_labels(element: Any, with_labels: bool = True) -> tuple[Any, Any]:
  """(features, labels) of a dataset element, as Estimator reads it."""
  if isinstance(element, (list, tuple)):
    return (element[0], element[1]) if with_labels else (element[0], None)
  return element, None


def staged_input_fn(input_fn: Callable, plan: plan_lib.DevicePlan,
                    backend: str | None = None) -> Callable:
  """Wraps an Estimator input_fn so that towers read prefetched device shards.

  `input_fn` returns a `tf.data.Dataset` whose elements are global batches:
  `(features, labels)` or `features` alone. Give the returned input_fn to
  `train`, `evaluate`, `predict` or `train_and_evaluate` of an Estimator whose
  model_fn is `replicate_model_fn(..., plan=plan)` (the same devices). Each
  global batch is split on the host as the towered model_fn splits it, and
  `plan.staging_depth` shards per device are kept in flight on the tower
  devices; the hooks that drive this come with the model_fn's spec. Every
  example of a finite dataset is consumed exactly once, in every mode.

  With `plan.staging_depth == 0` the input_fn is returned unchanged (the towered
  model_fn then splits each batch itself). A model_fn that is not towered gets
  the plain host batch.

  Args:
    input_fn: an Estimator input_fn returning a `tf.data.Dataset`; it may take
      any of `mode`, `params`, `config` and `input_context`, as usual.
    plan: the `DevicePlan` (from `make_plan`) of the towered model_fn.
    backend: 'staging_area' (a StagingArea per device, puts driven by a
      hook; the only backend), or None for `plan.staging_backend`
      (`--staging_backend`). Another name raises a ValueError.

  Returns:
    An input_fn for Estimator.

  Raises:
    TypeError: if `input_fn` is not callable or `plan` is not a DevicePlan;
      when the input_fn runs, if it returns something other than a
      `tf.data.Dataset`.
    ValueError: for an unknown or removed backend.

  Example:
      ```python
      plan = estimator_towers.make_plan(num_gpus=4, staging_depth=1)
      estimator = tf.estimator.Estimator(
          estimator_towers.replicate_model_fn(model_fn, plan=plan), model_dir='/tmp/model')
      estimator.train(estimator_towers.staged_input_fn(train_input_fn, plan))
      ```
  """
  if not callable(input_fn):
    raise TypeError(f'input_fn must be callable, got {input_fn!r}.')
  if not isinstance(plan, plan_lib.DevicePlan):
    raise TypeError(
        f'plan must be a DevicePlan from estimator_towers.make_plan, got '
        f'{plan!r}. Build one plan and give it to both replicate_model_fn(..., '
        f'plan=plan) and staged_input_fn(input_fn, plan).')
  if backend is None:
    backend = plan.staging_backend
  validate_backend(backend)
  if plan.staging_depth == 0:
    return input_fn
  # Estimator passes only the arguments an input_fn's signature names.
  accepted = [n for n in _INPUT_FN_ARGS if n in interception.fn_args(input_fn)]
  signature = inspect.Signature(
      [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in accepted])

  def wrapped_input_fn(*args, **kwargs):
    dataset = input_fn(**signature.bind(*args, **kwargs).arguments)
    if not isinstance(dataset, tf.data.Dataset):
      raise TypeError(
          f'staged_input_fn needs an input_fn that returns a tf.data.Dataset '
          f'of global batches, but {input_fn!r} returned a '
          f'{type(dataset).__name__}. Return the dataset itself (e.g. '
          f'tf.data.Dataset.from_tensor_slices((x, y)).batch(b)), not tensors '
          f'or an iterator.')
    if isinstance(dataset.element_spec, tuple) and len(dataset.element_spec) != 2:
      raise ValueError(
          f'The dataset of a staged input_fn must yield (features, labels) '
          f'or features alone, but its elements are '
          f'{len(dataset.element_spec)}-tuples: {dataset.element_spec}. Pack '
          f'the features into a dict.')
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    # Scaffold's default local_init_op runs the table initializers on every
    # session creation: that initializes the iterator for a model_fn that uses
    # the host batch directly. Towers take it out (their input is staged).
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS,
                                   iterator.initializer)
    features, labels = _features_and_labels(iterator.get_next())
    flat_features = _flat(features)
    _registry(tf.compat.v1.get_default_graph())[_key(flat_features)] = _HostBatch(
        plan=plan, iterator=iterator,
        flat_features=flat_features,
        flat_labels=None if labels is None else _flat(labels))
    return features, labels

  wrapped_input_fn.__signature__ = signature
  wrapped_input_fn.__name__ = f'staged_{getattr(input_fn, "__name__", "input_fn")}'
  return wrapped_input_fn


def is_staged(features: Any) -> bool:
  """Whether `features` came from a `staged_input_fn` of this graph."""
  flat_features = _flat(features)
  host_batch = _registry(tf.compat.v1.get_default_graph()).get(_key(flat_features))
  return host_batch is not None and host_batch.flat_features == flat_features


@dataclasses.dataclass(frozen=True)
class StagedShards:
  """Per-tower inputs read on the tower devices, and the hook that feeds them.

  Attributes:
    features: tower k's features shard, for each tower.
    labels: tower k's labels shard (None when the model_fn gets no labels).
    sizes: shard sizes (Python ints when static, else int32 scalars).
    batch: the global batch size (their sum).
    hook: the SessionRunHook to run with the spec.
  """
  features: list
  labels: list
  sizes: list
  batch: Any
  hook: tf.compat.v1.train.SessionRunHook

  def attach_hook(self, spec: tf.estimator.EstimatorSpec) -> tf.estimator.EstimatorSpec:
    """`spec` with the staging hook added to the hooks of its mode."""
    fields = spec._asdict()
    field = _HOOK_FIELDS[spec.mode]
    fields[field] = tuple(fields[field] or ()) + (self.hook,)
    return tf.estimator.EstimatorSpec(**fields)


class StagingHook(tf.compat.v1.train.SessionRunHook):
  """Primes the staging areas and puts one batch per step; ends input exactly.

  The number of staged batches is counted in Python. Every step fetches
  `step`: the put's result, after the get ops of all devices, so that a step
  consumes one staged batch on every device (whatever the model reads) and
  runs the next put. After the put reports the end of input, the step that
  consumes the last staged batch requests a stop; a step about to start with
  nothing staged (an empty dataset) raises OutOfRangeError, MonitoredSession's
  end of input.
  """

  def __init__(self, put: tf.Tensor, step: tf.Tensor, start: Callable[[Any], None],
               clear: tf.Operation, depth: int):
    self._put = put
    self._step_args = tf.compat.v1.train.SessionRunArgs(step)
    self._start = start  # sets the input's position (a fresh iterator, or as restored)
    self._clear = clear
    self._depth = depth
    self._staged = 0
    self._exhausted = False

  def after_create_session(self, session, coord):
    del coord
    # A new session starts with empty areas, whatever a previous session (or a
    # remote worker's leftovers) left behind, and the input where its position
    # says: the first element, or where the restored checkpoint left off.
    session.run(self._clear)
    self._start(session)
    self._staged = 0
    self._exhausted = False
    for _ in range(self._depth):
      if not session.run(self._put):
        self._exhausted = True
        break
      self._staged += 1

  def before_run(self, run_context):
    if self._staged == 0:
      raise tf.errors.OutOfRangeError(
          None, None, 'End of input: every staged batch has been consumed.')
    self._staged -= 1
    return self._step_args

  def after_run(self, run_context, run_values):
    if not self._exhausted:
      if run_values.results:
        self._staged += 1
      else:
        self._exhausted = True
    if self._exhausted and self._staged == 0:
      run_context.request_stop()

  def end(self, session):
    session.run(self._clear)


def _split(value: Any, with_labels: bool, num_towers: int, plan: plan_lib.DevicePlan) -> list:
  """The per-tower shards of a global batch: features or (features, labels), cut as the
  plan's towers are (on the fixed shard grid, its cut: `grid.tower_sizes`)."""
  features, labels = _features_and_labels(value, with_labels)
  sizes = grid.tower_sizes(sharding.batch_size(features, labels), plan.shards, num_towers,
                           plan.micro_batches)
  feature_shards = sharding.split(features, sizes)
  if not with_labels:
    return feature_shards
  return list(zip(feature_shards, sharding.split(labels, sizes)))


def _stage(host_batch: _HostBatch, with_labels: bool, tower_devices: Sequence[str],
           host: str, source: Any = None) -> tuple[list, StagingHook]:
  """A StagingArea per tower device, filled by a put op that the hook runs.

  Args:
    host_batch: the staged input_fn's registration.
    with_labels: whether shards carry labels (not in PREDICT).
    tower_devices: one device per tower.
    host: the input pipeline's device.
    source: the positioned training input (`position.Source`), or None to
      read the input_fn's iterator from its first element.

  Returns:
    Each tower's shard (read on its device) and the driving hook.
  """
  graph = tf.compat.v1.get_default_graph()
  iterator = host_batch.iterator
  with tf.device(host):
    if source is None:
      optional = iterator.get_next_as_optional()
      has_value, element_spec = optional.has_value(), optional.element_spec
      next_value = optional.get_value
    else:
      has_value, value = source.get_next_as_optional()
      element_spec, next_value = source.element_spec, lambda: value
  features_spec, labels_spec = _features_and_labels(element_spec, with_labels)
  element_spec = (features_spec, labels_spec) if with_labels else features_spec
  dtypes = [s.dtype for s in tf.nest.flatten(element_spec, expand_composites=True)]
  areas = []
  for device in tower_devices:
    with tf.device(device):
      areas.append(interception.StagingArea(
          dtypes, shared_name=graph.unique_name('staging_area')))
  in_flight = None if source is None else _InFlight(source, host, graph,
                                                    host_batch.plan.staging_depth)

  shard_specs = []

  def put_next_batch():
    batch = next_value()
    shards = _split(batch, with_labels, len(areas), host_batch.plan)
    del shard_specs[:]
    puts = [] if in_flight is None else [in_flight.put(batch)]
    for area, device, shard in zip(areas, tower_devices, shards):
      shard_specs.append(tf.nest.map_structure(tf.type_spec_from_value, shard))
      with tf.device(device):
        puts.append(area.put(list(_flat(shard))))
    with tf.control_dependencies(puts):
      return tf.constant(True)

  with tf.device(host):
    put = tf.cond(has_value, put_next_batch, lambda: tf.constant(False),
                  name='put_next_batch')

  shards, gets, clears = [], [], []
  for area, device, spec in zip(areas, tower_devices, shard_specs):
    with tf.device(device):
      components = area.get()
      for component, component_spec in zip(
          components, tf.nest.flatten(spec, expand_composites=True)):
        component.set_shape(component_spec.shape)
      shards.append(tf.nest.pack_sequence_as(spec, components, expand_composites=True))
      gets.append(components[0].op)
      clears.append(area.clear())
  with tf.device(host):
    if in_flight is not None:
      gets.append(in_flight.get())
      clears.append(in_flight.area.clear())
    with tf.control_dependencies(gets):
      step = tf.identity(put, name='staged_step')
    clear = tf.group(*clears, name='clear_staged')
  start = (source.ensure if source is not None
           else lambda session: session.run(iterator.initializer))
  return shards, StagingHook(put=put, step=step, start=start, clear=clear,
                             depth=host_batch.plan.staging_depth)


class _InFlight:
  """The global batches staged on the devices, kept whole on the host for the checkpoint.

  Each put also puts its global batch here, and each step takes one out with
  the devices' shards, so this area holds what the devices hold, in order;
  `source.pending_in_flight` serializes them when a checkpoint is written
  (guarded peeks: it never waits on an empty area).
  """

  def __init__(self, source: Any, host: str, graph: tf.Graph, depth: int):
    self.source = source
    self.depth = depth
    self.host = host
    with tf.device(host):
      self.area = interception.StagingArea(
          [s.dtype for s in source.specs], shared_name=graph.unique_name('in_flight'))
    source.pending_in_flight = self.serialized

  def put(self, batch: Any) -> tf.Operation:
    with tf.device(self.host), tf.name_scope('in_flight'):
      return self.area.put(tf.nest.flatten(batch, expand_composites=True))

  def get(self) -> tf.Operation:
    with tf.device(self.host), tf.name_scope('in_flight'):
      got = self.area.get()
      return (got[0] if isinstance(got, (list, tuple)) else got).op

  def serialized(self) -> tf.Tensor:
    """[n, components] strings: the staged global batches, oldest first."""
    columns = len(self.source.specs)
    rows = []
    with tf.device(self.host), tf.name_scope('in_flight'):
      size = self.area.size()
      for i in range(self.depth):
        def peek(i=i):
          got = self.area.peek(i)
          got = list(got) if isinstance(got, (list, tuple)) else [got]
          return tf.stack([tf.io.serialize_tensor(t) for t in got])[None]
        rows.append(tf.cond(size > i, peek, lambda: tf.zeros([0, columns], tf.string)))
      return tf.concat(rows, 0)


# The backend names and their check live in staging_backends, which plan.py
# imports too (plan validates the name; this module imports plan).
BACKENDS = staging_backends.BACKENDS
REMOVED_BACKENDS = staging_backends.REMOVED_BACKENDS
validate_backend = staging_backends.validate_backend


def _same_devices(a: plan_lib.DevicePlan, b: plan_lib.DevicePlan) -> bool:
  return a.devices == b.devices and a.num_gpus == b.num_gpus


def _describe(plan: plan_lib.DevicePlan) -> str:
  if plan.devices is not None:
    return f'devices={list(plan.devices)}'
  if plan.num_gpus is not None:
    return f'num_gpus={plan.num_gpus}'
  return 'the default devices'


def staged_shards(features: Any, labels: Any, plan: plan_lib.DevicePlan,
                  tower_devices: Sequence[str], source: Any = None) -> StagedShards | None:
  """Builds the staging for a host batch of `staged_input_fn`.

  Args:
    features: the features the towered model_fn received.
    labels: its labels (None in PREDICT: then no labels are staged).
    plan: the towered model_fn's plan.
    tower_devices: the resolved tower devices.
    source: the positioned training input (`position.Source`) the staging
      reads, or None (EVAL, PREDICT, resume_input=False).

  Returns:
    The per-tower shards and their hook, or None if `features` did not come
    from a staged input_fn (the model_fn then splits them itself).

  Raises:
    ValueError: if the input_fn's plan names other devices than the model_fn's,
      or if the same staged batch is used by two towered model_fns.
  """
  graph = tf.compat.v1.get_default_graph()
  flat_features = _flat(features)
  host_batch = _registry(graph).get(_key(flat_features))
  if host_batch is None or host_batch.flat_features != flat_features:
    return None
  if not _same_devices(host_batch.plan, plan):
    raise ValueError(
        f'The staged input_fn and the towered model_fn must tower on the same '
        f'devices, but the input_fn\'s plan has {_describe(host_batch.plan)} and '
        f'the model_fn\'s plan has {_describe(plan)}. Build one plan with '
        f'make_plan(...) and pass it to both staged_input_fn(input_fn, plan) '
        f'and replicate_model_fn(model_fn, plan=plan).')
  if host_batch.staged:
    raise ValueError(
        'This staged batch already feeds a towered model_fn in this graph; a '
        'staged input_fn\'s batch can feed one towered model_fn only. Call the '
        'input_fn once per model_fn.')
  host_batch.staged = True
  # The host batch is not used: its iterator needs no initialization.
  graph.get_collection_ref(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS).remove(
      host_batch.iterator.initializer)
  with_labels = labels is not None and host_batch.flat_labels is not None
  host = host_batch.iterator.initializer.device or '/cpu:0'

  with tf.name_scope('staged_input'):
    shards, hook = _stage(host_batch, with_labels, tower_devices, host, source)
    feature_shards, label_shards, sizes = [], [], []
    for shard, device in zip(shards, tower_devices):
      shard_features, shard_labels = shard if with_labels else (shard, None)
      feature_shards.append(shard_features)
      label_shards.append(shard_labels)
      with tf.device(device):  # A shape read on a GPU stays in host memory.
        sizes.append(sharding.rows(tf.nest.flatten(shard_features)[0]))
    static = [sharding.static_rows(tf.nest.flatten(shard_features)[0])
              for shard_features in feature_shards]
    with tf.device(host):
      if all(isinstance(n, int) and n > 0 for n in static):
        sizes, batch = static, sum(static)
      else:
        batch = tf.add_n(sizes)
  return StagedShards(features=feature_shards, labels=label_shards,
                      sizes=sizes, batch=batch, hook=hook)
