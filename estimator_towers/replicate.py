"""replicate_model_fn: run an unchanged single-device model_fn on several devices.

The orchestrator: `towered_model_fn`, which Estimator calls once per graph,
reads as the stages of the data path in order, each a call into its
subpackage: the plan's devices and variable placement (`placement`), staged
input (`inputs.staging`), the cluster's all-reduces (`cluster`), the global
batch cut into shards (`inputs.shards`), the towers built on them
(`towers.builder`), and then per mode: in TRAIN, the primary tower in the
model_fn's own flow with its gradient requests answered with the whole
batch's gradient (`gradients`: the other towers made at the request, the
heads and seeds of `heads` and `loss`, the backward passes and their sums),
sync points for batch norm (`sync_points`), the loss Estimator reports
(`loss.reported`) and the per-tower summaries (`reporting`); in EVAL and
PREDICT, every tower's whole model_fn and the merged spec (`towers.specs`).
No stage's details live here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.cluster import cross_worker
from estimator_towers.cluster import session as cluster_session
from estimator_towers.cluster import tf_config as cluster_lib
from estimator_towers.draws import keyed
from estimator_towers.gradients import backward_passes
from estimator_towers.gradients import fixed_order
from estimator_towers.gradients import gradient_sync
from estimator_towers.gradients import other_towers
from estimator_towers.gradients import whole_batch as gradients
from estimator_towers.inputs import empty_shards
from estimator_towers.inputs import grid
from estimator_towers.inputs import position
from estimator_towers.inputs import resume
from estimator_towers.inputs import shards as shards_lib
from estimator_towers.inputs import staging
from estimator_towers.loss import reported
from estimator_towers.placement import recommended
from estimator_towers.placement import session_devices
from estimator_towers.placement import shared_reads
from estimator_towers.placement import strategies as placement_lib
from estimator_towers.reporting import throughput
from estimator_towers.reporting import tower_summaries
from estimator_towers.reporting import whole_batch_views
from estimator_towers.reporting import work_share
from estimator_towers.rows import row_dependence
from estimator_towers.settings import plan as plan_lib
from estimator_towers.sync_points import batch_norm as batch_norm_sync
from estimator_towers.towers import builder as builder_lib
from estimator_towers.towers import counterparts
from estimator_towers.towers import specs as specs_lib
from estimator_towers.towers import tower_context
from estimator_towers.towers import tower_copies
from estimator_towers.towers import unsplit

ModeKeys = tf.estimator.ModeKeys
GraphKeys = tf.compat.v1.GraphKeys

_MODEL_FN_ARGS = ('features', 'labels', 'mode', 'params', 'config')


def replicate_model_fn(model_fn: Callable | int | None = None,
                       num_gpus: int | None = None, *,
                       devices: Sequence[str] | None = None,
                       variable_strategy: str = 'auto',
                       loss_reduction: str = 'auto',
                       sync_batch_norm: bool | None = None,
                       micro_batches: int = 1,
                       cross_example: str = 'auto',
                       random_draws: str = 'keyed',
                       resume_input: bool = True,
                       shards: int | None = None,
                       plan: plan_lib.DevicePlan | None = None) -> Callable:
  """Turns a single-device Estimator model_fn into a data-parallel (towered) one.

  Each global batch (what the input_fn returns) is split into shards, one per
  device and micro-batch; each shard runs your model_fn's computation (a
  tower) with one shared set of variables, and each step applies the update
  one device would make on the whole global batch, with the plain model_fn's
  checkpoint. Use it as `@replicate_model_fn`, `@replicate_model_fn(4)`,
  `@replicate_model_fn(num_gpus=4)`, `replicate_model_fn(model_fn, devices=[...])`
  or `replicate_model_fn(model_fn, plan=plan)`. The rules follow the
  arguments.

  Args:
    model_fn: the model_fn to wrap, or a device count when used as
      `@replicate_model_fn(4)`, or None when used as a decorator factory.
    num_gpus: number of GPU towers ('/gpu:0' .. '/gpu:N-1'); 0 trains on the
      CPU alone.
    devices: explicit tower devices, e.g. ['/cpu:0', '/cpu:1'].
    variable_strategy: where variables live and gradients are added up:
      'auto' (default: 'cpu' on CPU devices and 1 or 2 GPUs, 'gpu' on 3 or
      4, 'collective' on 5 or more and across a chief and workers; the device
      report says which and why), 'cpu', 'gpu', 'replicated' or 'collective'
      (NCCL all-reduce).
    loss_reduction: 'auto' (the whole batch's loss rebuilt from the shards'
      statistics; one warning naming the op for a loss it cannot rebuild,
      which then follows the reduction the model_fn's TensorFlow loss
      function records, a mean when none does), 'exact' ('auto' with that
      warning an error), 'mean' or 'sum' (the loss is not analysed;
      statistics declared with `loss_denominator` still are).
    sync_batch_norm: None (default, unset) or True: in TRAIN, every batch
      norm (Keras, tf.compat.v1.layers, tf.compat.v1.nn.fused_batch_norm,
      tf.nn.moments over the batch axis) normalises with the mean and
      variance of the global batch, so towered training equals
      single-device training for batch-norm models. With micro_batches > 1
      unset means a batch norm in TRAIN is an error naming the choice, and
      True is an error. False: each tower (micro-batch) uses its shard's
      statistics; one warning per graph names the batch norms.
    micro_batches: k >= 1: each device's shard is split into k micro-batches
      that run one after another on that device within the step.
    cross_example: 'auto' (a computation across examples that cannot be
      split per tower runs once on the whole batch, on the first device:
      exact, with a warning giving that device's share of the step's heavy
      ops) or 'refuse' (an error at graph construction instead).
    random_draws: 'keyed' (default: each example's random values are set by
      its position in the global batch and the step) or 'per_shard' (each
      tower draws its shard on its own, as the undecorated model_fn would;
      training then depends on the device count and a restart redraws).
    resume_input: True (default: every checkpoint saves the training input's
      position) or False (every train() call and restart reads the input
      from its first element).
    shards: None (default) or S, the fixed shard grid: the global batch is
      always cut into S shards (one tower each; a device runs several), and
      every sum across them (gradients, loss normalisers, batch-norm
      moments, an in-batch head's) is taken in one fixed order, so that the
      checkpoints are bit-identical on 1, 2, 4... devices and micro-batches
      whose product divides S (S / devices a power of two); another
      topology is an error naming the divisors of S.
      More: [guarantees](../guarantees.md#bit-identical-checkpoints-the-fixed-shard-grid).
    plan: a `DevicePlan` from `make_plan`, instead of the arguments above.

  Returns:
    The towered model_fn, or a decorator that makes one.

  Raises:
    ValueError: for a count together with devices, a negative GPU count (or a
      non-positive CPU device count), more GPUs than are visible (unless CPU
      fallback is allowed), duplicate devices, or conflicting arguments.
    TypeError: if model_fn is not callable or plan is not a DevicePlan.

  Sharding:
    Features and labels (Tensors, SparseTensors, RaggedTensors, nested
    dicts and lists of them; labels may be None) are split along axis 0:
    tower k takes B // N examples, plus one if k < B % N. The batch size may
    be unknown when the graph is built, need not divide by N and may be
    smaller than N; an empty shard adds nothing. Tower 0 holds the largest
    shard. More: [guarantees](../guarantees.md#sharding).

  Variables:
    Tower 0 is built first, with the plain names, and creates every
    variable; the other towers get tower 0's variables whatever API asks
    for them. The checkpoint equals the plain model_fn's.
    More: [guarantees](../guarantees.md#plain-variables).

  Gradients:
    In TRAIN your model_fn runs on tower 0, in its own flow. When it asks
    for gradients with respect to variables (an optimizer's `minimize`,
    `tf.gradients`), it receives the gradient of the whole batch's loss,
    rebuilt from the shards' statistics (means, sums, token counts), so
    ratio losses are exact; a loss it cannot rebuild warns once. What the
    model_fn does next (clipping, loss scaling, `apply_gradients`) runs
    once. The other towers are copied from tower 0's ops, or built by
    running the model_fn again where a copy would differ
    ([copied and built towers](../glossary.md#copied-and-built-towers)).
    More: [losses](../losses.md),
    [guarantees](../guarantees.md#the-whole-batch-gradient-in-your-model_fns-own-flow).

  Side effects:
    The train_op is tower 0's: what hangs on it (batch-norm moving averages,
    EMA, counters) runs once per step, on tower 0's shard; summaries and
    hooks read the whole batch's values (one warning per value that cannot
    be rebuilt). EVAL reports the whole batch's
    loss and metrics of per-example values equal the plain ones; PREDICT
    returns predictions in input order.
    More: [what differs from one device](../guarantees.md#what-differs-from-single-device-training-and-why).

  Placement:
    Tower k runs on device k; `variable_strategy` decides where variables
    live and where gradients are added up. With one device (and
    micro_batches=1) the model_fn runs as it is. Serving graphs
    (export_saved_model) are the plain model_fn's, without device pins.
    More: [placement](../placement.md), [choosing a strategy](../choosing-a-strategy.md).

  Micro-batches:
    With micro_batches=k, each device's shard is split again, by the same
    rule, into k micro-batches, one tower each, run one after another on
    the device: it holds about one micro-batch's activations. The update is
    still one per global batch. More: [micro-batches](../micro_batches.md).

  Random draws:
    With random_draws='keyed', every random op (dropout, noise, tf.image's)
    draws each example's values by its position in the global batch and the
    global step, so one device, N devices, micro-batches, workers and a
    resumed run draw the same values (other values than the undecorated
    model_fn's, from the same distribution).
    More: [random draws](../random_draws.md).

  Input position:
    With resume_input=True, in TRAIN the towers read the input through the
    library's own iterator, whose position (tf.data's state and the batches
    staged on devices) every checkpoint saves, so the next train() call or
    a restarted job continues the same global batches, on any number of
    devices, micro-batches or (through `global_batches`) workers; workers
    reading each their own shard resume on the same number of workers.
    More: [resuming](../resuming.md).

  Example:
      ```python
      @estimator_towers.replicate_model_fn(num_gpus=8, variable_strategy='collective')
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
  plan = plan_lib.plan_from_arguments(plan, num_gpus, devices, variable_strategy,
                                      loss_reduction, sync_batch_norm, micro_batches,
                                      cross_example, random_draws, resume_input, shards)

  def decorate(fn: Callable) -> Callable:
    return _wrap(fn, plan)

  return decorate(model_fn) if model_fn is not None else decorate


def _wrap(model_fn: Callable, plan: plan_lib.DevicePlan) -> Callable:
  accepted = set(interception.fn_args(model_fn))
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
    cluster = cluster_lib.from_run_config(config)
    workers = (cluster.num_workers if mode == ModeKeys.TRAIN and cluster is not None
               and cluster.trains else 1)  # the training tasks a TRAIN graph's batch spans
    tower_devices = grid.grid_devices(plan.shards, plan.resolve(), plan.micro_batches, workers)
    strategy, chosen = recommended.choose(plan.variable_strategy, tower_devices, cluster)
    placement = placement_lib.make_placement(strategy, tower_devices)
    single = len(tower_devices) == 1 and plan.micro_batches == 1
    serving = (mode == ModeKeys.PREDICT and not single and shards_lib.is_serving_input(features))
    if not serving:  # towers on devices the session lacks would share one (soft placement)
      session_devices.check_towers_exist(tower_devices, config)
    logs.info_once_per_graph(
        f'estimator_towers: {mode} graph: the plain model_fn, without towers or '
        f'device pins (a serving graph).' if serving else
        f'estimator_towers: {mode} graph: {len(tower_devices)} tower(s) on '
        f'{", ".join(tower_devices)}; {placement.describe()} (variable_strategy='
        f'{placement.name}{f", {chosen}" if chosen else ""}, loss_reduction={plan.loss_reduction}'
        f'{f", micro_batches={plan.micro_batches}" if plan.micro_batches > 1 else ""}).')
    run = functools.partial(call_user, params=params, config=config)
    from_staging = staging.is_staged(features)
    across = None if mode != ModeKeys.TRAIN else cross_worker.for_train_graph(
        config, strategy, plan.worker_timeout_secs, from_staging)
    grid.check_cluster(plan.shards, workers, across is not None, placement.name)
    source = None
    if mode == ModeKeys.TRAIN:  # the input's position, checkpointed (global batches' rows)
      features, labels, source = position.own(
          features, labels, replace=not from_staging and across is None,
          across=across is not None, resume=plan.resume_input,
          model_dir=getattr(config, 'model_dir', None))
    spec = _towered_spec(run, features, labels, mode, plan, placement, tower_devices, single,
                         serving, across, source)
    if source is not None:
      spec = resume.attach(spec, source, config, staged=from_staging, across=across)
    if mode == ModeKeys.TRAIN:  # the last hook: hooks' writes of the global step keyed too
      spec = keyed.with_step_order(spec)
    return spec

  # Estimator passes only the arguments a model_fn's signature names: mirror the
  # user's labels/params, and always take mode and config, which towering needs.
  names = [n for n in _MODEL_FN_ARGS if n in ('features', 'mode', 'config') or n in accepted]
  towered_model_fn.__signature__ = inspect.Signature(
      [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                         default=inspect.Parameter.empty if n == 'features' else None)
       for n in names])
  del towered_model_fn.__wrapped__  # Estimator must see our signature.
  return towered_model_fn


def _towered_spec(run, features, labels, mode, plan, placement, tower_devices, single, serving,
                  across, source) -> tf.estimator.EstimatorSpec:
  """The spec of one graph: staged or plain input, one device or towers, one worker or several."""
  staged = staging.staged_shards(features, labels, plan, tower_devices, source)
  if across is not None:  # a TRAIN graph of one worker of several
    features, labels, has_data = cross_worker.live_inputs(
        features, labels, None if source is None else source.next_for_worker(across.rank,
                                                                             across.size))
    across.set_live(has_data)  # ThroughputHook's batch: the cluster's (_build_train)
    return _build_towers(run, features, labels, mode, plan, placement, None, across)
  if mode == ModeKeys.TRAIN:  # For ThroughputHook's examples/sec.
    throughput.record_global_batch(staged.batch if staged is not None
                                   else throughput.first_leaf_rows(features))
  if single and plan.random_draws == 'keyed':  # one device draws what any topology does
    run = keyed.KeyedDraws.whole_batch(
        tf.compat.v1.get_default_graph(), *((features, labels) if staged is None
                                            else (staged.features[0], staged.labels[0]))
    ).wrap(run)
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


def _build_towers(run, features, labels, mode, plan, placement, staged=None, across=None):
  """Shards -> towers -> the merged EstimatorSpec of `mode`."""
  layout = grid.layout(plan.shards, len(placement.tower_devices), plan.micro_batches)
  shards = shards_lib.make_shards(features, labels, mode, placement.tower_devices, staged,
                                  layout, across.has_data if across is not None else None)
  draws = None
  if plan.random_draws == 'keyed':  # each example draws by its place in the global batch
    draws = keyed.KeyedDraws.of_shards(tf.compat.v1.get_default_graph(), shards, across)
    run = draws.wrap(run)
  builder = builder_lib.TowerBuilder(run, mode, shards, placement)
  if mode == ModeKeys.TRAIN:
    spec = _build_train(builder, plan, features, labels, staged, across, draws)
  else:
    spec = _build_eval_predict(builder, plan, (features, labels, staged))
  shared_reads.share_reads(builder.graph.get_operations())  # a device receives a variable once
  return spec


def _build_eval_predict(builder: builder_lib.TowerBuilder, plan: plan_lib.DevicePlan,
                        whole: tuple) -> tf.estimator.EstimatorSpec:
  """EVAL / PREDICT: every tower's full model_fn; losses weighted, predictions joined.

  An EVAL loss or metric that mixes the batch's rows: on the whole batch instead.
  """
  shards = builder.shards
  gated = shards.gate_empty()  # a shard empty at run time feeds its tower nothing
  built = builder.build_each()
  tower_specs = [empty_shards.gate_spec(s, built[0], gated[k]) if k in gated else s
                 for k, s in zip(shards.active, built)]
  for k, spec in zip(shards.active, tower_specs):  # micro-batches in turn
    shards.order_next(k, [spec.loss, spec.predictions])
  if builder.mode == ModeKeys.PREDICT:
    return specs_lib.merge_predict(tower_specs)
  if row_dependence.in_eval_spec(built[0], shards.flat(builder.primary)).mixing:
    return unsplit.run_unsplit(builder, *whole, 'its EVAL loss or metrics mix the batch\'s '
                               'rows, so they cannot be split across towers; it evaluates',
                               order=False)
  losses = [s.loss for s in tower_specs]
  loss = reported.reported_loss([s.loss for s in built], losses, shards, plan.loss_reduction,
                                builder.graph, gated)
  tower_summaries.of_built_towers(shards.active, losses, shards.sizes)
  merged = specs_lib.merge_eval(tower_specs, loss, built)
  views = whole_batch_views.WholeBatchViews(
      (built[0].loss, loss), counterparts.every_tower([s.loss for s in built]), shards,
      builder.graph)
  return merged._replace(evaluation_hooks=views.rebind_hooks(merged.evaluation_hooks or ()))


def _build_train(builder: builder_lib.TowerBuilder, plan: plan_lib.DevicePlan, features,
                 labels, staged, across: cross_worker.CrossWorker | None = None,
                 draws: keyed.KeyedDraws | None = None) -> tf.estimator.EstimatorSpec:
  """TRAIN: the primary in the model_fn's own flow, the whole-batch gradient, one update."""
  shards, graph, variable_sharing = builder.shards, builder.graph, builder.variable_sharing
  micro = shards.layout.micro_batches > 1
  batch = shards.batch if across is None else across.sum([shards.batch])[0]
  if across is not None:  # For ThroughputHook's examples/sec: the cluster's batch.
    throughput.record_global_batch(batch)
  sync = gradient_sync.GradientSync(builder.placement.aggregation_device,
                                    getattr(builder.placement, 'combine', None), across)
  statistics = batch_norm_sync.for_train(plan.sync_batch_norm, graph, shards,
                                         builder.tower_devices, across)
  copies = _tower_copies(builder, statistics, across, lambda: broker.variables_at[0], draws)
  others = other_towers.OtherTowers(builder, copies)
  passes = backward_passes.BackwardPasses(
      sync, lambda variable, k: variable_sharing.copy_of(variable, shards.layout.device_of(k)),
      device_of=builder.device_of if micro or plan.shards else None,
      after_backward=shards.order_next if micro else None, copies=copies,
      fixed=fixed_order.FixedOrder(shards.layout.num_shards, builder.device_of)
      if plan.shards else None)
  broker = gradients.WholeBatchGradients(
      graph, shards.active, shards.sizes, batch, plan.loss_reduction, others.build, passes,
      primary=variable_sharing.primary,
      variable_count=lambda: len(variable_sharing.variables),
      creation_spans=variable_sharing.creation_spans, inputs=shards.flat(builder.primary),
      nonempty=dict(zip(shards.active, shards.nonempty)),
      ungated=lambda k: shards.ungated.get(k) or shards.flat(k), gates=shards.gates,
      cross_example=plan.cross_example)
  others.attach(broker)
  kept = {}
  with copies.primary() if copies is not None else contextlib.nullcontext(), \
      interception.gradient_requests(broker.handle), broker.building(builder.primary), \
      builder_lib.tower_collections(builder.base, kept), statistics.syncing():
    spec = builder.build(builder.primary, reuse=False)
  if not broker.requests:
    return _without_gradients(builder, features, labels, staged, across)
  builder.keep_collections(kept)
  statistics.check_complete()
  with statistics.syncing():  # a tower built again meets the sync points again: an error
    losses = [spec.loss] + [others.loss(k, spec.loss) for k in shards.active[1:]]
  # A ratio loss's whole-batch loss, as differentiated when it was the gradient's.
  loss = broker.whole_batch_loss(spec.loss)
  if loss is None:
    loss = reported.reported_loss(losses, losses, shards, plan.loss_reduction, graph,
                                  batch=batch, across=across)
  views = whole_batch_views.WholeBatchViews((spec.loss, loss), others.counterparts, shards,
                                            graph, batch, across)
  views.rebind_summaries(graph.get_collection(GraphKeys.SUMMARIES))  # one device's values
  spec = spec._replace(training_hooks=views.rebind_hooks(spec.training_hooks or ()))
  tower_summaries.of_built_towers(shards.active, losses, shards.sizes)
  train_op = variable_sharing.refresh(spec.train_op)  # itself without copies
  merged = specs_lib.merge_train(spec, loss, train_op, others.counterparts)
  work_share.report(graph, builder.tower_devices, [merged.train_op, merged.loss])
  if across is None:
    return merged
  merged = merged._replace(train_op=cross_worker.share_updates(
      across, kept.get(GraphKeys.UPDATE_OPS, []), views.in_step(merged.train_op)))
  cross_worker.gate_updates(across, merged.train_op)
  return cluster_session.attach(merged, across)


def _without_gradients(builder: builder_lib.TowerBuilder, features, labels, staged,
                       across: cross_worker.CrossWorker | None) -> tf.estimator.EstimatorSpec:
  """A TRAIN model_fn that asked for no gradient (k-means): on the whole batch, one machine."""
  if across is not None:
    raise ValueError(
        f'variable_strategy=\'collective\' across {across.size} workers trains '
        f'by summing the workers\' gradients, but this model_fn asked for no '
        f'gradient with respect to variables (its update, like k-means\', '
        f'cannot be split). Train it on one machine.')
  return unsplit.run_unsplit(builder, features, labels, staged, 'this model_fn asked for no '
                             'gradients with respect to variables in TRAIN, so its update '
                             'cannot be split across towers; it trains')


def _tower_copies(builder: builder_lib.TowerBuilder, statistics: Any,
                  across: cross_worker.CrossWorker | None, created: Callable[[], int],
                  draws: keyed.KeyedDraws | None = None) -> tower_copies.TowerCopies | None:
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
      shards.flat, builder.primary, sharing.creation_spans,
      builder.pinned, statistics, lambda k: sharing.replicas(k, created()),
      own=(lambda k: [draws.position(k)]) if draws is not None else (lambda k: []))

