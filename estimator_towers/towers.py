"""replicate_model_fn: run an unchanged single-device model_fn on several devices."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Sequence

import tensorflow as tf
from tensorflow.python.util import function_utils  # pylint: disable=g-direct-tensorflow-import

from estimator_towers import gradients
from estimator_towers import logs
from estimator_towers import placement as placement_lib
from estimator_towers import plan as plan_lib
from estimator_towers import sharding
from estimator_towers import sharing
from estimator_towers import specs as specs_lib
from estimator_towers import staging
from estimator_towers import throughput
from estimator_towers import tower_context
from estimator_towers import tower_summaries

ModeKeys = tf.estimator.ModeKeys
GraphKeys = tf.compat.v1.GraphKeys

# Collections a tower fills with its own copies; each tower sees only its own
# while it is built, and tower 0's are kept afterwards.
_PER_TOWER_COLLECTIONS = (GraphKeys.UPDATE_OPS, GraphKeys.LOSSES, GraphKeys.SUMMARIES)

# Op types that change a variable's value (checked by prefix).
_MUTATING_PREFIXES = ('Assign', 'ResourceScatter', 'Scatter', 'ResourceApply',
                      'Apply', 'ResourceSparseApply', 'SparseApply')

_MODEL_FN_ARGS = ('features', 'labels', 'mode', 'params', 'config')


def replicate_model_fn(model_fn: Callable | int | None = None,
                       num_gpus: int | None = None, *,
                       devices: Sequence[str] | None = None,
                       variable_strategy: str = 'cpu',
                       loss_reduction: str = 'mean',
                       plan: plan_lib.DevicePlan | None = None) -> Callable:
  """Turns a single-device Estimator model_fn into a towered one.

  Usable as `@replicate_model_fn`, `@replicate_model_fn(4)`,
  `@replicate_model_fn(num_gpus=4)`, `replicate_model_fn(model_fn, devices=[...])`
  or `replicate_model_fn(model_fn, plan=plan)`.

  On sharding: features and labels (Tensors, SparseTensors, RaggedTensors,
  nested dicts/lists of them; labels may be None) are split along axis 0, tower
  k taking B // N examples plus one if k < B % N. The batch size may be unknown
  when the graph is built, need not divide by N and may be smaller than N; an
  empty shard contributes nothing. Tower 0 always holds the largest shard.

  On variables: tower 0 is built first, with the plain names, and creates every
  variable; the other towers get tower 0's variables back whatever API asks for
  them (get_variable, tf.compat.v1.layers, Keras layers, tf.Variable, metrics).
  The checkpoint equals the plain model_fn's.

  On reduction: the model_fn's own `optimizer.minimize` / `apply_gradients` /
  Keras `get_updates` calls are deferred in every tower; the k-th calls of all
  towers are combined (each tower's gradient weighted by its share of the batch
  for loss_reduction='mean', added for 'sum') and tower 0's optimizer applies
  them once, so `global_step` advances by one per step. EVAL reports the
  example-weighted mean loss; metric state is shared, so metrics of
  per-example values equal the plain ones. PREDICT concatenates predictions in
  input order.

  On side effects: the train_op Estimator runs is tower 0's, so whatever the
  model_fn hangs on it (batch-norm moving averages in UPDATE_OPS or
  `layer.updates`, EMA, counters) runs once per step, fed by tower 0's shard,
  which is the largest and never empty. The other towers contribute gradients
  only: their variable updates are detached from their gradient computations.
  Summaries come from tower 0, under their plain names.

  On placement: tower k's ops run on device k; `variable_strategy` decides
  where variables live: 'cpu' (default) on the host CPU of the towers' worker
  (on the device itself when there is one), 'gpu' spread over the tower devices
  balanced by bytes, 'replicated' a copy per tower refreshed after each update.
  Gradients are combined on each variable's device, or on the worker's CPU when
  the variable sits on a parameter server. Features from
  `staged_input_fn(input_fn, plan)` are read from per-device staging areas.
  The devices the towers get are logged once per graph. With one device
  the model_fn runs as it is, under that device. Serving graphs
  (export_saved_model) are built as the plain model_fn, without device pins,
  so a SavedModel serves on any machine.

  Args:
    model_fn: the model_fn to wrap, or a device count when used as
      `@replicate_model_fn(4)`, or None when used as a decorator factory.
    num_gpus: number of GPU towers ('/gpu:0' .. '/gpu:N-1').
    devices: explicit tower devices, e.g. ['/cpu:0', '/cpu:1'].
    variable_strategy: a key of `estimator_towers.placement.STRATEGIES`.
    loss_reduction: 'mean' or 'sum', how the model_fn's loss reduces the batch.
    plan: a `DevicePlan` from `make_plan`, instead of the arguments above.

  Returns:
    The towered model_fn, or a decorator that makes one.

  Raises:
    ValueError: for a count together with devices, a non-positive count,
      duplicate devices, or conflicting arguments.
  """
  if isinstance(model_fn, int) and not isinstance(model_fn, bool):
    if num_gpus is not None:
      raise ValueError(
          f'The device count was given twice: positionally ({model_fn}) and as '
          f'num_gpus={num_gpus}. Write @replicate_model_fn({model_fn}).')
    model_fn, num_gpus = None, model_fn
  if model_fn is not None and not callable(model_fn):
    raise TypeError(f'model_fn must be callable, got {model_fn!r}.')
  if plan is not None:
    if num_gpus is not None or devices is not None:
      raise ValueError('Give either plan or num_gpus/devices, not both; the '
                       'plan already names the devices.')
    if not isinstance(plan, plan_lib.DevicePlan):
      raise TypeError(f'plan must be a DevicePlan from make_plan, got {plan!r}.')
  else:
    plan = plan_lib.make_plan(num_gpus=num_gpus, devices=devices,
                              variable_strategy=variable_strategy,
                              loss_reduction=loss_reduction)

  def decorate(fn: Callable) -> Callable:
    return _wrap(fn, plan)

  return decorate(model_fn) if model_fn is not None else decorate


def _wrap(model_fn: Callable, plan: plan_lib.DevicePlan) -> Callable:
  accepted = set(function_utils.fn_args(model_fn))
  if 'features' not in accepted:
    raise ValueError(f'model_fn {model_fn} must take a features argument.')

  def call_user(features, labels, mode, params, config):
    kwargs = {'features': features}
    for name, value in (('labels', labels), ('mode', mode), ('params', params),
                        ('config', config)):
      if name in accepted:
        kwargs[name] = value
    spec = model_fn(**kwargs)
    if not isinstance(spec, tf.estimator.EstimatorSpec):
      raise TypeError(f'model_fn must return a tf.estimator.EstimatorSpec, got '
                      f'{type(spec).__name__}.')
    return spec

  @functools.wraps(model_fn)
  def towered_model_fn(features, labels=None, mode=None, params=None, config=None):
    tower_devices = plan.resolve()
    placement = placement_lib.make_placement(plan.variable_strategy, tower_devices)
    serving = (mode == ModeKeys.PREDICT and len(tower_devices) > 1
               and _is_serving_graph(features))
    logs.info_once_per_graph(
        f'estimator_towers: {mode} graph: the plain model_fn, without towers or '
        f'device pins (a serving graph).' if serving else
        f'estimator_towers: {mode} graph: {len(tower_devices)} tower(s) on '
        f'{", ".join(tower_devices)}; {placement.describe()} (variable_strategy='
        f'{placement.name}, loss_reduction={plan.loss_reduction}).')
    run = functools.partial(call_user, params=params, config=config)
    staged = staging.staged_shards(features, labels, plan, tower_devices)
    if mode == ModeKeys.TRAIN:  # For ThroughputHook's examples/sec.
      throughput.record_global_batch(staged.batch if staged is not None
                                     else throughput.first_leaf_rows(features))
    if staged is not None:  # Towers read prefetched shards from staging areas.
      if len(tower_devices) == 1:
        with tf.device(tower_devices[0]), tower_context.entering(0, 1, tower_devices[0], True):
          return staged.attach_hook(run(staged.features[0], staged.labels[0], mode))
      return staged.attach_hook(
          _build_towers(run, features, labels, mode, plan, placement, staged))
    if len(tower_devices) == 1:
      with tf.device(tower_devices[0]), tower_context.entering(0, 1, tower_devices[0], True):
        return run(features, labels, mode)
    if serving:
      return run(features, labels, mode)
    return _build_towers(run, features, labels, mode, plan, placement)

  # Estimator passes only the arguments a model_fn's signature names: mirror the
  # user's labels/params, and always take mode and config, which towering needs.
  names = [n for n in _MODEL_FN_ARGS if n in ('features', 'mode', 'config') or n in accepted]
  towered_model_fn.__signature__ = inspect.Signature(
      [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                         default=inspect.Parameter.empty if n == 'features' else None)
       for n in names])
  del towered_model_fn.__wrapped__  # Estimator must see our signature.
  return towered_model_fn


def _is_serving_graph(features: Any) -> bool:
  """True if the features are fed by placeholders (an export), not an input_fn."""
  pending = [t.op for t in tf.nest.flatten(features, expand_composites=True)
             if isinstance(t, tf.Tensor)]
  seen = set()
  while pending and len(seen) < 10000:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type == 'Placeholder':
      return True
    if op.type.startswith('IteratorGetNext') or op.type == 'Unstage':
      continue
    pending.extend(t.op for t in op.inputs)
  return False


@contextlib.contextmanager
def _tower_collections(saved: dict, keep: dict) -> Any:
  """While a tower is built, per-tower collections hold only what it adds."""
  graph = tf.compat.v1.get_default_graph()
  for key in _PER_TOWER_COLLECTIONS:
    graph.get_collection_ref(key)[:] = saved[key]
  try:
    yield
  finally:
    for key in _PER_TOWER_COLLECTIONS:
      keep[key] = graph.get_collection(key)[len(saved[key]):]


def _detach_side_effects(ops: Sequence[tf.Operation]) -> None:
  """Drops control edges from a tower's ops to its own variable updates.

  A model_fn often computes gradients under `control_dependencies(update_ops)`;
  in towers other than tower 0 that would run their batch-norm updates as well
  (and an empty shard would write NaN statistics). Data edges are untouched.
  """
  mutating = set()
  for op in ops:
    if (op.type.startswith(_MUTATING_PREFIXES)
        or any(t.op in mutating for t in op.inputs)
        or any(c in mutating for c in op.control_inputs)):
      mutating.add(op)
  for op in ops:
    controls = op.control_inputs
    keep = [c for c in controls if c not in mutating]
    if len(keep) != len(controls):
      op._remove_all_control_inputs()  # pylint: disable=protected-access
      op._add_control_inputs(keep)  # pylint: disable=protected-access


def _build_towers(run, features, labels, mode, plan, placement, staged=None):
  graph = tf.compat.v1.get_default_graph()
  tower_devices = placement.tower_devices
  num_towers = len(tower_devices)
  host = getattr(tf.nest.flatten(features, expand_composites=True)[0], 'device', '') or '/cpu:0'
  with tf.device(host), tf.name_scope('shard_inputs'):
    if staged is None:
      batch = sharding.batch_size(features, labels)
      sizes = sharding.shard_sizes(batch, num_towers)
      feature_shards = sharding.split(features, sizes)
      label_shards = sharding.split(labels, sizes)
    else:
      batch, sizes = staged.batch, staged.sizes
      feature_shards, label_shards = staged.features, staged.labels
    nonempty = [s > 0 for s in sizes]  # Python bools when the batch is static
    if plan.loss_reduction == 'sum':
      weights = [1.0] * num_towers
    elif isinstance(batch, int):
      weights = [s / max(batch, 1) for s in sizes]
    else:
      total = tf.cast(tf.maximum(batch, 1), tf.float32)
      weights = [tf.cast(s, tf.float32) / total for s in sizes]
  # Towers whose shard is statically empty are not built at all.
  active = [k for k in range(num_towers) if nonempty[k] is not False] or [0]

  variable_sharing = sharing.VariableSharing(placement.variable_device,
                                             placement.replica_device)
  collector = gradients.GradientCollector(primary=variable_sharing.primary)
  saved = {key: graph.get_collection(key) for key in _PER_TOWER_COLLECTIONS}
  kept = {}
  tower_specs = []
  for k in active:
    first_op = len(graph.get_operations())
    tower_kept = {}
    scopes = contextlib.ExitStack()
    with scopes:
      if k != active[0]:
        scopes.enter_context(tf.name_scope(f'tower_{k}'))
      scopes.enter_context(tf.device(tower_devices[k]))
      scopes.enter_context(variable_sharing.creating() if k == active[0]
                           else variable_sharing.reusing(k))
      scopes.enter_context(_tower_collections(saved, tower_kept))
      scopes.enter_context(tower_context.entering(k, num_towers, tower_devices[k],
                                                  primary=k == active[0]))
      if mode == ModeKeys.TRAIN:
        scopes.enter_context(collector.collecting())
      tower_specs.append(run(feature_shards[k], label_shards[k], mode))
    if k == active[0]:
      kept = tower_kept
    elif mode == ModeKeys.TRAIN:
      _detach_side_effects(graph.get_operations()[first_op:])
  for key in _PER_TOWER_COLLECTIONS:
    graph.get_collection_ref(key)[:] = saved[key] + kept.get(key, [])

  weights = [weights[k] for k in active]
  nonempty = [nonempty[k] for k in active]
  if mode == ModeKeys.PREDICT:
    return specs_lib.merge_predict(tower_specs)
  with tf.name_scope('tower_loss'):
    loss = specs_lib.weighted_sum([s.loss for s in tower_specs], weights, nonempty)
  # towers/<k>/loss, towers/<k>/shard_size and the towers' global_mean scalars.
  tower_losses = dict(zip(active, (s.loss for s in tower_specs)))
  tower_summaries.tower_summaries([tower_losses.get(k) for k in range(num_towers)], sizes)
  if mode == ModeKeys.EVAL:
    return specs_lib.merge_eval(tower_specs, loss)
  if not collector.calls[0]:
    raise ValueError(
        'In TRAIN mode a towered model_fn must update its variables through an '
        'optimizer (tf.compat.v1.train.Optimizer or a tf.keras.optimizers.legacy '
        'optimizer: minimize, apply_gradients or get_updates), so that the '
        'towers\' gradients can be combined before one update; this model_fn '
        'made no such call. Use an optimizer, or run it without towers.')
  collector.apply(weights, nonempty, placement.aggregation_device)
  train_op = variable_sharing.refresh(tower_specs[0].train_op)  # itself without copies
  return specs_lib.merge_train(tower_specs, loss, train_op)
