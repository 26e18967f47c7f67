"""replicate_model_fn: run an unchanged single-device model_fn on several devices."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

from absl import logging
import tensorflow as tf
from tensorflow.python.util import function_utils  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.base import updates
from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.cluster import cross_worker
from estimator_towers.cluster import session as cluster_session
from estimator_towers.cluster import tf_config as cluster_lib
from estimator_towers.gradients import backward_passes
from estimator_towers.gradients import gradient_sync
from estimator_towers.gradients import whole_batch as gradients
from estimator_towers.inputs import empty_shards
from estimator_towers.inputs import micro_batches as micro_batches_lib
from estimator_towers.inputs import sharding
from estimator_towers.inputs import staging
from estimator_towers.loss import loss_algebra
from estimator_towers.loss import statistics as stats_lib
from estimator_towers.placement import strategies as placement_lib
from estimator_towers.reporting import throughput
from estimator_towers.reporting import tower_summaries
from estimator_towers.rows import row_dependence
from estimator_towers.settings import plan as plan_lib
from estimator_towers.sync_points import batch_norm as batch_norm_sync
from estimator_towers.towers import counterparts
from estimator_towers.towers import ordering
from estimator_towers.towers import sharing
from estimator_towers.towers import specs as specs_lib
from estimator_towers.towers import tower_context
from estimator_towers.towers import tower_copies

ModeKeys = tf.estimator.ModeKeys
GraphKeys = tf.compat.v1.GraphKeys

# Collections a tower fills with its own copies; each tower sees only its own
# while it is built, and tower 0's are kept afterwards.
_PER_TOWER_COLLECTIONS = (GraphKeys.UPDATE_OPS, GraphKeys.LOSSES, GraphKeys.SUMMARIES)

_MODEL_FN_ARGS = ('features', 'labels', 'mode', 'params', 'config')


def replicate_model_fn(model_fn: Callable | int | None = None,
                       num_gpus: int | None = None, *,
                       devices: Sequence[str] | None = None,
                       variable_strategy: str = 'cpu',
                       loss_reduction: str = 'auto',
                       sync_batch_norm: bool = False,
                       micro_batches: int = 1,
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

  On gradients: in TRAIN, tower 0 runs the model_fn on its shard, in the
  model_fn's own flow. When it asks for gradients with respect to variables
  (tf.gradients, an optimizer's compute_gradients / minimize, Keras legacy
  optimizers), it receives the gradient of the whole batch's loss: the loss
  as a function of the batch's statistics (sums, means, token counts, sums of
  weights, combined by arithmetic with regularisers and constants) rebuilt on
  the whole batch's totals, so token-weighted losses, BERT's
  two-term loss and a loss plus a regulariser equal the plain loss, and a
  shard with no tokens adds nothing (no NaN); a plain mean weighs tower k by
  w_k = n_k / B, a plain sum by 1. A loss it cannot rebuild gets one warning
  naming the op (an error with loss_reduction='exact'); declare a statistic
  it does not recognise with `loss_denominator(d)`. The other towers are
  made at that moment and stopped at their own request, so they have their
  forward pass only: copied from tower 0's ops (with their own shard, device
  and random seeds) where that is what building them would give, else built
  by running the model_fn again. What the model_fn
  then does (clipping, loss scaling, its optimizer's apply_gradients, a
  manual global_step update) runs once. Gradients with respect to anything
  other than variables (a gradient penalty on the inputs) stay per tower.
  EVAL reports the whole batch's loss, weighted the same way; metric state
  is shared, so metrics of per-example values equal the plain ones. PREDICT
  concatenates predictions in input order. In EVAL and PREDICT a tower whose
  shard is empty at run time runs nothing computed from it.

  On side effects: the train_op Estimator runs is tower 0's, so whatever the
  model_fn hangs on it (batch-norm moving averages in UPDATE_OPS or
  `layer.updates`, EMA, counters) runs once per step, fed by tower 0's shard,
  which is the largest and never empty. Summaries come from tower 0, under
  their plain names. A TRAIN model_fn that asks for no gradient (k-means)
  trains on the whole batch on tower 0's device.

  On placement: tower k's ops run on device k; `variable_strategy` decides
  where variables live: 'cpu' (default) on the host CPU of the towers' worker
  (on the device itself when there is one), 'gpu' spread over the tower devices
  balanced by bytes, 'replicated' a copy per tower refreshed after each update,
  'collective' a copy per tower kept equal by all-reduce (also across a chief
  and workers).
  Gradients are combined on each variable's device, or on the worker's CPU when
  the variable sits on a parameter server. Features from
  `staged_input_fn(input_fn, plan)` are read from per-device staging areas.
  The devices the towers get are logged once per graph. With one device
  (and micro_batches=1) the model_fn runs as it is, under that device.

  On micro-batches (`micro_batches=k`): each device's shard is split again,
  by the same rule, into k micro-batches, and the model_fn is built once per
  (device, micro-batch) pair, a "tower" above; the micro-batches of a device
  run one after another within the step (the next one's inputs wait for the
  previous one's gradients), so a device holds about one micro-batch's
  activations. The model_fn still gets the whole batch's gradient, summed
  per device first, and everything after it runs once per global batch.
  Placement is per device: shards on one device share its variables (one
  copy per device under 'replicated'). Serving graphs
  (export_saved_model) are built as the plain model_fn, without device pins,
  so a SavedModel serves on any machine.

  Args:
    model_fn: the model_fn to wrap, or a device count when used as
      `@replicate_model_fn(4)`, or None when used as a decorator factory.
    num_gpus: number of GPU towers ('/gpu:0' .. '/gpu:N-1'); 0 trains on the
      CPU alone.
    devices: explicit tower devices, e.g. ['/cpu:0', '/cpu:1'].
    variable_strategy: 'cpu' (default), 'gpu', 'replicated' or 'collective'.
    loss_reduction: 'auto' (the whole batch's loss rebuilt from the shards'
      statistics; one warning naming the op for a
      loss it cannot rebuild, which then follows the reduction the model_fn's
      TensorFlow loss function records, a mean when none does), 'exact'
      ('auto' with that warning an error), 'mean' or 'sum' (the loss is not
      analysed; statistics declared with `loss_denominator` still are).
    sync_batch_norm: in TRAIN, every batch norm (Keras, tf.compat.v1.layers,
      tf.compat.v1.nn.fused_batch_norm, tf.nn.moments over the batch axis)
      normalises with the mean and variance of the global batch, so towered
      training equals single-device training for batch-norm models. Off by
      default: each tower uses its shard's statistics.
    micro_batches: k >= 1: each device's shard is split into k micro-batches
      (by the same rule) that run one after another on that device within
      the step; the model_fn still receives the whole batch's gradient and
      updates once per global batch.
    plan: a `DevicePlan` from `make_plan`, instead of the arguments above.

  Returns:
    The towered model_fn, or a decorator that makes one.

  Raises:
    ValueError: for a count together with devices, a negative GPU count (or a
      non-positive CPU device count), more GPUs than are visible (unless CPU
      fallback is allowed), duplicate devices, or conflicting arguments.
    TypeError: if model_fn is not callable or plan is not a DevicePlan.

  Example:
      ```python
      @estimator_towers.replicate_model_fn(num_gpus=8)
      def model_fn(features, labels, mode):   # the unchanged single-device model_fn
        logits = tf.compat.v1.layers.dense(features['x'], 10)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
        optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
        train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

      estimator = tf.estimator.Estimator(model_fn)   # its input_fn returns global batches
      ```
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
    overridden = {name: value for name, value, default in (
        ('variable_strategy', variable_strategy, 'cpu'),
        ('loss_reduction', loss_reduction, 'auto'),
        ('sync_batch_norm', sync_batch_norm, False),
        ('micro_batches', micro_batches, 1)) if value != default}
    if overridden:
      settings = ', '.join(f'{name}={value!r}' for name, value in overridden.items())
      raise ValueError(
          f'Give either plan or {settings}, not both: the plan already holds '
          f'these settings. Pass them to make_plan(...) (or make_config(...)) '
          f'instead.')
  else:
    plan = plan_lib.make_plan(num_gpus=num_gpus, devices=devices,
                              variable_strategy=variable_strategy,
                              loss_reduction=loss_reduction,
                              sync_batch_norm=sync_batch_norm,
                              micro_batches=micro_batches)

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
    if type(spec).__name__ == 'TPUEstimatorSpec':  # TPU-first model_fns (use_tpu=False)
      spec = spec.as_estimator_spec()
    if not isinstance(spec, tf.estimator.EstimatorSpec):
      raise TypeError(f'model_fn must return a tf.estimator.EstimatorSpec (or a '
                      f'TPUEstimatorSpec), got {type(spec).__name__}.')
    return spec

  @functools.wraps(model_fn)
  def towered_model_fn(features, labels=None, mode=None, params=None, config=None):
    tower_devices = plan.resolve()
    placement = placement_lib.make_placement(plan.variable_strategy, tower_devices)
    single = len(tower_devices) == 1 and plan.micro_batches == 1
    serving = (mode == ModeKeys.PREDICT and not single and _is_serving_graph(features))
    logs.info_once_per_graph(
        f'estimator_towers: {mode} graph: the plain model_fn, without towers or '
        f'device pins (a serving graph).' if serving else
        f'estimator_towers: {mode} graph: {len(tower_devices)} tower(s) on '
        f'{", ".join(tower_devices)}; {placement.describe()} (variable_strategy='
        f'{placement.name}, loss_reduction={plan.loss_reduction}'
        f'{f", micro_batches={plan.micro_batches}" if plan.micro_batches > 1 else ""}).')
    run = functools.partial(call_user, params=params, config=config)
    staged = staging.staged_shards(features, labels, plan, tower_devices)
    across = _cross_worker(plan, mode, config, staged)
    if across is not None:  # a TRAIN graph of one worker of several
      features, labels, has_data = cross_worker.live_inputs(features, labels)
      across.set_live(has_data)  # ThroughputHook's batch: the cluster's (_build_train)
      return _build_towers(run, features, labels, mode, plan, placement, None, across)
    if mode == ModeKeys.TRAIN:  # For ThroughputHook's examples/sec.
      throughput.record_global_batch(staged.batch if staged is not None
                                     else throughput.first_leaf_rows(features))
    if staged is not None:  # Towers read prefetched shards from staging areas.
      if single:
        with tf.device(tower_devices[0]), tower_context.entering(0, 1, tower_devices[0], True):
          return staged.attach_hook(run(staged.features[0], staged.labels[0], mode))
      return staged.attach_hook(
          _build_towers(run, features, labels, mode, plan, placement, staged))
    if single:
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


def _cross_worker(plan: plan_lib.DevicePlan, mode: str, config: Any, staged: Any
                  ) -> cross_worker.CrossWorker | None:
  """The all-reduces across workers of a TRAIN graph under a collective cluster, or None.

  Raises:
    ValueError: for a TF_CONFIG cluster the strategy cannot train on
      (`cluster.check`), or what the collective strategy does not support
      across workers.
  """
  if mode != ModeKeys.TRAIN:
    return None
  cluster = cluster_lib.from_run_config(config)
  if cluster is None or not cluster.trains:
    return None
  cluster_lib.check(cluster, plan.variable_strategy)
  if plan.variable_strategy != 'collective' or cluster.num_workers < 2:
    return None
  if staged is not None:
    raise ValueError(
        f'variable_strategy=\'collective\' across {cluster.num_workers} workers '
        f'does not support staged_input_fn (read the dataset in the input_fn '
        f'instead): it would not give the single-device update. '
        f'Train without it, or on one machine.')
  return cross_worker.CrossWorker(cluster, timeout_secs=plan.worker_timeout_secs)


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
def _tower_collections(base: dict, keep: dict | None = None) -> Any:
  """While a tower is built, per-tower collections hold only what it adds.

  They start as `base` (their state before any tower); what the tower adds is
  stored in `keep` if given. Afterwards they are as they were before, so a
  tower built in the middle of tower 0 leaves tower 0's view untouched.
  """
  graph = tf.compat.v1.get_default_graph()
  before = {key: graph.get_collection(key) for key in _PER_TOWER_COLLECTIONS}
  for key in _PER_TOWER_COLLECTIONS:
    graph.get_collection_ref(key)[:] = base[key]
  try:
    yield
  finally:
    for key in _PER_TOWER_COLLECTIONS:
      if keep is not None:
        keep[key] = graph.get_collection(key)[len(base[key]):]
      graph.get_collection_ref(key)[:] = before[key]


def _detach_side_effects(ops: Sequence[tf.Operation]) -> None:
  """Drops control edges from a tower's ops to its own variable updates.

  A model_fn often computes its loss or gradients under
  `control_dependencies(update_ops)`; in towers other than tower 0 that would
  run their batch-norm updates as well (and an empty shard would write NaN
  statistics). Data edges are untouched.
  """
  mutating = set()
  for op in ops:
    if (updates.is_update(op)
        or any(t.op in mutating for t in op.inputs)
        or any(c in mutating for c in op.control_inputs)):
      mutating.add(op)
  for op in ops:
    controls = op.control_inputs
    keep = [c for c in controls if c not in mutating]
    if len(keep) != len(controls):
      op._remove_all_control_inputs()  # pylint: disable=protected-access
      op._add_control_inputs(keep)  # pylint: disable=protected-access


@dataclasses.dataclass
class _Shards:
  """The shards of one global batch: one per (device, micro-batch) pair.

  Attributes:
    layout: which device and micro-batch each shard is.
    features: shard s's features.
    labels: shard s's labels (None entries when there are none).
    sizes: shard sizes (Python ints when the batch is static, else int32 scalars).
    batch: the global batch size.
    active: the shards that are built: those not statically empty (shard 0
      at least); the first is the primary.
    nonempty: per built shard, whether it has rows (a Python bool when
      static, else a bool Tensor).
    gates: per built shard (micro-batches), the Identity ops its inputs pass
      through, to be ordered after the previous micro-batch (or a head's gradient).
    ungated: per gated shard, its flattened inputs before the gates.
  """
  layout: micro_batches_lib.Layout
  features: list
  labels: list
  sizes: list
  batch: Any
  active: list
  nonempty: list
  gates: dict
  ungated: dict = dataclasses.field(default_factory=dict)


def _make_shards(features, labels, mode, tower_devices, staged,
                 layout: micro_batches_lib.Layout, live: Any = None) -> _Shards:
  """Splits the global batch (or the staged device shards) into the plan's shards.

  In training, a shard whose size is known only at run time and turns out
  empty borrows an example (weight 0), so that no tower runs on no rows.
  `live` (across workers): False when this worker's input has ended; then
  its batch is one zero example and every shard counts 0 examples.
  """
  num_devices = len(tower_devices)
  host = getattr(tf.nest.flatten(features, expand_composites=True)[0], 'device', '') or '/cpu:0'
  with tf.device(host), tf.name_scope('shard_inputs'):
    if staged is None:
      batch = sharding.batch_size(features, labels)
      sizes = layout.sizes(sharding.shard_sizes(batch, num_devices))
      shards = sharding.split((features, labels), sizes, fill_empty=mode == ModeKeys.TRAIN)
      feature_shards, label_shards = [list(s) for s in zip(*shards)]
    else:
      batch, sizes = staged.batch, list(staged.sizes)
      feature_shards, label_shards = list(staged.features), list(staged.labels)
  nonempty = [s > 0 for s in sizes]  # Python bools when the batch is static
  # Devices (or micro-batches) whose shard is statically empty are not built at all.
  active = [k for k in range(len(sizes)) if nonempty[k] is not False] or [0]
  if staged is not None and mode == ModeKeys.TRAIN:
    with tf.name_scope('shard_inputs'):
      for k in active[1:]:
        if not isinstance(sizes[k], int):
          with tf.device(tower_devices[k]):
            feature_shards[k] = sharding.fill_empty(feature_shards[k], sizes[k], feature_shards[0])
            label_shards[k] = sharding.fill_empty(label_shards[k], sizes[k], label_shards[0])
  shards = _Shards(layout, feature_shards, label_shards, sizes, batch, active,
                   [nonempty[k] for k in active], {})
  if layout.micro_batches > 1:
    if staged is not None:
      _split_staged(shards, mode, tower_devices)
    _gate(shards, tower_devices)
  if live is not None:
    with tf.device(host), tf.name_scope('shard_inputs'):
      shards.batch = tf.where(live, shards.batch, 0)
      shards.sizes = [tf.where(live, s, 0) for s in shards.sizes]
      shards.nonempty = [tf.logical_and(live, ne) for ne in shards.nonempty]
  return shards


def _split_staged(shards: _Shards, mode: str, tower_devices: Sequence[str]) -> None:
  """Staged device shards -> their micro-batches, split on each device."""
  layout, train = shards.layout, mode == ModeKeys.TRAIN
  features, labels, sizes = [], [], []
  with tf.name_scope('micro_batches'):
    for d, device in enumerate(tower_devices):
      with tf.device(device):
        micro_sizes = layout.sizes([shards.sizes[d]])
        borrow_first = d > 0 and d in shards.active
        features.extend(micro_batches_lib.split_device_shard(
            shards.features[d], micro_sizes, train, borrow_first))
        labels.extend(micro_batches_lib.split_device_shard(
            shards.labels[d], micro_sizes, train, borrow_first))
      sizes.extend(micro_sizes)
  nonempty = [s > 0 for s in sizes]
  shards.features, shards.labels, shards.sizes = features, labels, sizes
  shards.active = [k for k in range(len(sizes)) if nonempty[k] is not False] or [0]
  shards.nonempty = [nonempty[k] for k in shards.active]


def _gate(shards: _Shards, tower_devices: Sequence[str]) -> None:
  """Every built micro-batch reads its inputs through gates (ordered once built)."""
  with tf.name_scope('micro_batch_gates'):
    for s in shards.active:
      device = tower_devices[shards.layout.device_of(s)]
      shards.ungated[s] = _flat_shard(shards, s)
      (shards.features[s], shards.labels[s]), shards.gates[s] = micro_batches_lib.gate(
          (shards.features[s], shards.labels[s]), device)


class _TowerBuilder:
  """Builds one tower: the model_fn on its shard, on its device, with shared variables.

  Args:
    run: `run(features, labels, mode)` calls the user's model_fn.
    mode: the Estimator mode.
    shards: the shards of the global batch.
    placement: the variable placement over the tower devices.
  """

  def __init__(self, run: Callable, mode: str, shards: _Shards,
               placement: placement_lib.Placement):
    self.run = run
    self.mode = mode
    self.shards = shards
    self.placement = placement
    self.graph = tf.compat.v1.get_default_graph()
    self.tower_devices = placement.tower_devices
    self.variable_sharing = sharing.VariableSharing(placement.variable_device,
                                                    placement.replica_device)
    # Per-tower collections as they were before any tower was built.
    self.base = {key: self.graph.get_collection(key) for key in _PER_TOWER_COLLECTIONS}
    self.root_scope = tf.compat.v1.get_variable_scope()
    self.devices = interception.device_stack(self.graph)
    self.pinned: set[str] = set()  # the primary's ops placed by a device scope of the model_fn
    interception.reset_loss_reduction(self.graph)

  @property
  def primary(self) -> int:
    return self.shards.active[0]

  def build(self, k: int, reuse: bool, **reuse_args) -> Any:
    """Shard k's model_fn on its device; None if it stopped at a gradient request.

    Variables are per device (device d's shards use its copies, if any). A
    micro-batch's ops that read none of its inputs wait for its gates too.
    """
    d = self.shards.layout.device_of(k)
    device = self.tower_devices[d]
    reuse_args.setdefault('copies', d != self.shards.layout.device_of(self.primary))
    pinned, first_op = self.pinned if k == self.primary else None, len(self.graph.get_operations())
    with tf.compat.v1.device(placement_lib.tower_device(device, pinned)), (
        self.variable_sharing.reusing(d, self.root_scope, **reuse_args) if reuse
        else self.variable_sharing.creating()), tower_context.entering(
            k, len(self.shards.sizes), device, primary=k == self.primary):
      try:
        spec = self.run(self.shards.features[k], self.shards.labels[k], self.mode)
      except gradients.TowerStop:  # at the gradient request it was built for
        spec = None
    if self.shards.layout.previous(k) is not None:  # a device's first: not ordered after one
      micro_batches_lib.gate_sources(self.graph.get_operations()[first_op:], self.shards.gates[k])
    return spec

  def keep_collections(self, kept: dict) -> None:
    """Per-tower collections: as before the towers, plus the primary's additions."""
    for key in _PER_TOWER_COLLECTIONS:
      self.graph.get_collection_ref(key)[:] = self.base[key] + kept.get(key, [])


def _build_towers(run, features, labels, mode, plan, placement, staged=None, across=None):
  """Shards -> towers -> the merged EstimatorSpec of `mode`."""
  layout = micro_batches_lib.Layout(len(placement.tower_devices), plan.micro_batches)
  shards = _make_shards(features, labels, mode, placement.tower_devices, staged, layout,
                        across.has_data if across is not None else None)
  builder = _TowerBuilder(run, mode, shards, placement)
  if mode == ModeKeys.TRAIN:
    return _build_train(builder, plan, features, labels, staged, across)
  return _build_eval_predict(builder, plan, (features, labels, staged))


def _build_eval_predict(builder: _TowerBuilder, plan: plan_lib.DevicePlan, whole: tuple
                        ) -> tf.estimator.EstimatorSpec:
  """EVAL / PREDICT: every tower's full model_fn; losses weighted, predictions joined.

  An EVAL loss or metric that mixes the batch's rows: on the whole batch instead.
  """
  shards, graph = builder.shards, builder.graph
  # A shard empty at run time feeds its tower nothing (see empty_shards).
  gated = {k: ne for k, ne in zip(shards.active[1:], shards.nonempty[1:])
           if not isinstance(ne, bool)}
  for k, ne in gated.items():
    shards.features[k] = empty_shards.gate_inputs(shards.features[k], ne)
    shards.labels[k] = empty_shards.gate_inputs(shards.labels[k], ne)
  tower_specs, kept = [], {}
  for k in shards.active:
    tower_kept = {}
    with tf.name_scope(f'tower_{k}') if k != builder.primary else contextlib.nullcontext(), \
        _tower_collections(builder.base, tower_kept):
      tower_specs.append(builder.build(k, reuse=k != builder.primary))
    kept = kept or tower_kept
  builder.keep_collections(kept)
  built, tower_specs = tower_specs, [
      empty_shards.gate_spec(s, tower_specs[0], gated[k]) if k in gated else s
      for k, s in zip(shards.active, tower_specs)]
  for k, spec in zip(shards.active, tower_specs):  # micro-batches in turn
    _order_next(shards, k, [spec.loss, spec.predictions])
  if builder.mode == ModeKeys.PREDICT:
    return specs_lib.merge_predict(tower_specs)
  if row_dependence.in_eval_spec(built[0], _flat_shard(shards, builder.primary)).mixing:
    return _whole_batch(builder, *whole, 'its EVAL loss or metrics mix the batch\'s rows, '
                        'so they cannot be split across towers; it evaluates', order=False)
  loss = _reported_loss([s.loss for s in built], [s.loss for s in tower_specs], shards, plan,
                        graph, gated)
  _tower_summaries(shards.active, [s.loss for s in tower_specs], shards.sizes)
  return specs_lib.merge_eval(tower_specs, loss, built)


def _build_train(builder: _TowerBuilder, plan: plan_lib.DevicePlan, features, labels,
                 staged, across: cross_worker.CrossWorker | None = None
                 ) -> tf.estimator.EstimatorSpec:
  """TRAIN: the primary in the model_fn's own flow, the whole-batch gradient, one update."""
  shards, graph, variable_sharing = builder.shards, builder.graph, builder.variable_sharing

  def build_other(k, stop_at):
    """Tower k, in a clean context, up to its `stop_at`-th gradient request."""
    if copies is not None and stop_at == 0 and _copied(k):
      return None
    expected = None if stop_at is None else broker.variables_at[stop_at]
    first_op = len(graph.get_operations())
    # Its updates would be dropped: Keras' batch-norm updates are not built.
    with interception.clean_context(graph, builder.devices), variable_sharing.suspended(), \
        graph.name_scope(f'tower_{k}'), _tower_collections(builder.base), \
        broker.building(k, stop_at), interception.batch_norm_updates_skipped():
      spec = builder.build(k, reuse=True, expected=expected)
    _detach_side_effects(graph.get_operations()[first_op:])
    if not broker.stopped_at_expected_request(k):
      raise gradients.DivergentTowersError(
          f'Tower {k} returned from the model_fn after {stop_at} gradient '
          f'request(s) with respect to variables, but tower 0 made more. '
          f'Every tower runs the same model_fn and must make the same gradient '
          f'requests; do not branch on the shard or device around them.')
    return spec

  def _copied(k):
    """Tower k's forward pass copied from the primary's (`tower_copies`), if it can be."""
    request = broker.requests[0]
    with interception.clean_context(graph, builder.devices):
      counterpart = copies.copy(k, broker.primary_segment(),
                                request.ys + request.grad_ys + request.stops)
    if counterpart is None:
      return False
    if not broker.adopt_copy(k, counterpart):  # copy() checked the request's tensors
      raise RuntimeError(f'estimator_towers: tower {k} was copied from tower 0 but its '
                         f'gradient request has no counterpart; please report this.')
    return True

  layout = shards.layout
  micro = layout.micro_batches > 1
  batch = shards.batch if across is None else across.sum([shards.batch])[0]
  if across is not None:  # For ThroughputHook's examples/sec: the cluster's batch.
    throughput.record_global_batch(batch)
  sync = gradient_sync.GradientSync(builder.placement.aggregation_device,
                                    getattr(builder.placement, 'combine', None), across)
  statistics = _batch_norm_statistics(plan, builder, across)
  copies = _tower_copies(builder, statistics, across, lambda: broker.variables_at[0])
  passes = backward_passes.BackwardPasses(
      sync, lambda variable, k: variable_sharing.copy_of(variable, layout.device_of(k)),
      device_of=(lambda k: builder.tower_devices[layout.device_of(k)]) if micro else None,
      after_backward=functools.partial(_order_next, shards) if micro else None,
      copies=copies)
  broker = gradients.WholeBatchGradients(
      graph, shards.active, shards.sizes, batch, plan.loss_reduction, build_other, passes,
      primary=variable_sharing.primary,
      variable_count=lambda: len(variable_sharing.variables),
      creation_spans=variable_sharing.creation_spans,
      inputs=_flat_shard(shards, builder.primary),
      nonempty=dict(zip(shards.active, shards.nonempty)),
      ungated=lambda k: shards.ungated.get(k) or _flat_shard(shards, k), gates=shards.gates)
  kept = {}
  if copies is not None:
    copies.primary_started()
  with interception.gradient_requests(broker.handle), broker.building(builder.primary), \
      _tower_collections(builder.base, kept), statistics.syncing():
    spec = builder.build(builder.primary, reuse=False)
  if not broker.requests:
    if across is not None:
      raise ValueError(
          f'variable_strategy=\'collective\' across {across.size} workers trains '
          f'by summing the workers\' gradients, but this model_fn asked for no '
          f'gradient with respect to variables (its update, like k-means\', '
          f'cannot be split). Train it on one machine.')
    return _whole_batch(builder, features, labels, staged, 'this model_fn asked for no '
                        'gradients with respect to variables in TRAIN, so its update cannot '
                        'be split across towers; it trains')
  builder.keep_collections(kept)
  statistics.check_complete()
  with statistics.syncing():  # a tower built again meets the sync points again: an error
    losses = [spec.loss] + [_tower_loss(broker, build_other, k, spec.loss)
                            for k in shards.active[1:]]
  # A ratio loss's whole-batch loss, as differentiated when it was the gradient's.
  loss = broker.whole_batch_loss(spec.loss)
  if loss is None:
    loss = _reported_loss(losses, losses, shards, plan, graph, batch=batch, across=across)
  _tower_summaries(shards.active, losses, shards.sizes)
  train_op = variable_sharing.refresh(spec.train_op)  # itself without copies
  sizes = shards.sizes

  def counterparts(tensor):  # without the example borrowed by an empty shard
    found = broker.all_counterparts(tensor)
    if found is None:
      return None
    return [t if isinstance(sizes[k], int) else t[:sizes[k]]
            for k, t in zip(shards.active, found)]

  merged = specs_lib.merge_train(spec, loss, train_op, counterparts)
  if across is None:
    return merged
  merged = merged._replace(train_op=cross_worker.share_updates(
      across, kept.get(GraphKeys.UPDATE_OPS, []), merged.train_op))
  cross_worker.gate_updates(across, merged.train_op)
  return cluster_session.attach(merged, across)


def _order_next(shards: _Shards, k: int, done: Any) -> None:
  """The next micro-batch of shard k's device waits for `done` (shard k's last ops)."""
  if k + 1 in shards.gates and shards.layout.previous(k + 1) == k:
    micro_batches_lib.order_after(shards.gates[k + 1], done)


def _tower_loss(broker: gradients.WholeBatchGradients, build_other: Callable, k: int,
                loss: tf.Tensor) -> tf.Tensor:
  """Tower k's counterpart of the primary's loss (a second pass when there is none)."""
  loss_k = broker.counterpart(k, loss)
  if loss_k is None:  # The loss is not what the gradients were asked of.
    _log_once(
        'estimator_towers: the EstimatorSpec\'s loss is not the tensor (or an '
        'ancestor of the tensor) the model_fn asked gradients of, so each '
        'tower\'s loss is built by a second pass of its model_fn, which costs '
        'an extra forward pass per step on every tower but the first.')
    with interception.gradient_requests(broker.handle):
      loss_k = build_other(k, None).loss
  return loss_k


def _whole_batch(builder: _TowerBuilder, features, labels, staged, why: str,
                 order: bool = True) -> tf.estimator.EstimatorSpec:
  """A model_fn whose TRAIN or EVAL cannot be split across towers, on the whole batch.

  Updates that are not gradient steps (k-means' cluster updates) and EVAL
  values of ops that mix the batch's rows cannot be split across towers:
  the model_fn runs on the whole batch on tower 0's device, with the
  variables tower 0 created, and the towers' build is unused. `why` says so.
  """
  device = builder.tower_devices[0]
  _log_once(f'estimator_towers: {why} on the whole batch on {device}.')
  shards = builder.shards
  whole = (features, labels) if staged is None else (
      sharding.concat(shards.features), sharding.concat(shards.labels))
  first_op = len(builder.graph.get_operations())
  with tf.name_scope('whole_batch'), \
      tf.compat.v1.device(placement_lib.tower_device(device)), \
      builder.variable_sharing.reusing(0, builder.root_scope, copies=False), \
      tower_context.entering(0, 1, device, True):
    spec = builder.run(whole[0], whole[1], builder.mode)
  if order:  # Reads of a variable see it as the code says: before later updates.
    ordering.order_reads_before_writes(builder.graph.get_operations()[first_op:])
  return spec


def _flat_shard(shards: _Shards, k: int) -> list:
  """Shard k's tensors, flattened; absent labels (features-only input) have none."""
  return [t for t in tf.nest.flatten((shards.features[k], shards.labels[k]),
                                     expand_composites=True) if t is not None]


def _reported_loss(built: Sequence, losses: Sequence, shards: _Shards,
                   plan: plan_lib.DevicePlan, graph: tf.Graph,
                   gated: dict | None = None, batch: Any = None,
                   across: cross_worker.CrossWorker | None = None) -> tf.Tensor:
  """The whole batch's loss from the towers' `losses`, by `loss_algebra`'s rule.

  `built`: the losses as the towers built them (`losses` may be their gated
  stand-ins). `gated` (EVAL): shards that may be empty at run time; their
  statistics are taken through `empty_shards.live`, 0 when the shard is empty.
  `batch` and `across`: the cluster's batch size and all-reduces, across
  workers (the loss is then the cluster's).
  """
  batch = shards.batch if batch is None else batch
  find = counterparts.in_losses(built)

  def counterpart(i, tensor):
    found = find(i, tensor)
    k = shards.active[i]
    if found is None or not gated or k not in gated:
      return found
    return empty_shards.live(found, gated[k])

  with tf.name_scope('tower_loss'):
    analysis = loss_algebra.analyse(
        built[0], _flat_shard(shards, shards.active[0]), (), plan.loss_reduction,
        lambda: stats_lib.fallback_reduction(graph, built[0]), micro_batches=plan.micro_batches > 1,
        static_count=stats_lib.static_counts(
            graph, find, [shards.sizes[k] for k in shards.active]))
    if analysis.rule == 'rebuild':
      statistics = stats_lib.shard_statistics(analysis.expression, counterpart, len(built))
      if statistics is not None:
        return stats_lib.whole_batch_loss(analysis.expression, statistics, shards.nonempty,
                                          across)
    rule = analysis.rule if analysis.rule != 'rebuild' else 'mean'
    weights = stats_lib.tower_weights(rule, shards.sizes, batch, shards.active)
    loss = specs_lib.weighted_sum(losses, weights, shards.nonempty)
    return loss if across is None else across.sum([loss])[0]


def _tower_copies(builder: _TowerBuilder, statistics: Any,
                  across: cross_worker.CrossWorker | None, created: Callable[[], int]
                  ) -> tower_copies.TowerCopies | None:
  """Copies of the primary's forward pass for the other towers, where they may be.

  `created()`: how many variables the primary created before its first
  gradient request (a copied tower's own copies of them, if any, are made).

  Not with micro-batches (gated inputs, per-device variables) or across
  workers (their live inputs).
  """
  shards = builder.shards
  if shards.layout.micro_batches > 1 or across is not None or len(shards.active) < 2:
    return None
  sharing = builder.variable_sharing
  return tower_copies.TowerCopies(
      builder.graph, lambda k: builder.tower_devices[k],
      lambda k: _flat_shard(shards, k), builder.primary, sharing.creation_spans,
      builder.pinned, statistics, lambda k: sharing.replicas(k, created()))


def _batch_norm_statistics(plan: plan_lib.DevicePlan, builder: _TowerBuilder,
                           across: cross_worker.CrossWorker | None = None) -> Any:
  """The sync points of batch statistics for a TRAIN graph (sync_batch_norm).

  make_plan refuses sync_batch_norm with micro-batches, so a shard is a device.
  Across workers the statistics are the cluster's (`across`), even with one tower.
  """
  shards = builder.shards
  if not plan.sync_batch_norm or (len(shards.active) < 2 and across is None):
    return batch_norm_sync.Unsynced()
  present = {}
  for k, ne in zip(shards.active, shards.nonempty):
    if isinstance(ne, bool):
      present[k] = 1.0
    else:
      with tf.compat.v1.colocate_with(ne), tf.name_scope('shard_inputs'):
        present[k] = tf.cast(ne, tf.float32)
  return batch_norm_sync.BatchNormSync(
      builder.graph, {k: builder.tower_devices[k] for k in shards.active}, present, across)


def _tower_summaries(active: Sequence[int], losses: Sequence, sizes: Sequence) -> None:
  """towers/<k>/loss and towers/<k>/shard_size, and the towers' global_mean scalars."""
  by_tower = dict(zip(active, losses))
  tower_summaries.tower_summaries([by_tower.get(k) for k in range(len(sizes))], sizes)


_logged = set()


def _log_once(message: str) -> None:
  if message not in _logged:
    _logged.add(message)
    logging.warning(message)
