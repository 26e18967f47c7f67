"""TowersConfig: every towering and session setting a training script chooses.

`make_config` validates the settings once and returns an immutable
`TowersConfig`; from it come the `DevicePlan` for `replicate_model_fn`
(`config.plan`), the session's `ConfigProto` (`session_config`) and the
Estimator's `RunConfig` (`make_run_config`). `estimator_towers.flags` fills it
from command-line flags through the same `make_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=g-direct-tensorflow-import

from estimator_towers.base import spelling
from estimator_towers.cluster import tf_config as cluster_lib
from estimator_towers.placement import devices as devices_lib
from estimator_towers.placement import recommended
from estimator_towers.settings import plan as plan_lib

_DEVICE_CHOICES = ('num_gpus', 'devices', 'num_cpu_devices')


@dataclasses.dataclass(frozen=True)
class TowersConfig:
  """Immutable towering and session settings; build it with `make_config`.

  What a training script configures: the towers (its `plan`, a `DevicePlan`
  for `replicate_model_fn` and `staged_input_fn`) and the session
  (`session_config`, `make_run_config`). Each field is also a `make_config`
  keyword and a flag of `define_flags()` of the same name.

  Attributes:
    num_gpus: towers on '/gpu:0' .. '/gpu:N-1'; 0 trains on the host CPU.
      More GPUs than are visible is an error (raised by make_config) unless
      allow_cpu_fallback.
    devices: explicit tower devices (canonical strings).
    num_cpu_devices: towers on N virtual CPU devices '/cpu:0' .. '/cpu:N-1'
      (machines without GPUs); the session gets N CPU devices.
      At most one of num_gpus, devices and num_cpu_devices is set; with none,
      the towers are every visible GPU (the CPU when there is none).
    variable_strategy: 'auto' (default: the one recommended for the
      devices), 'cpu', 'gpu', 'replicated' or 'collective': where variables
      live and gradients are combined.
    staging_depth: shards kept in flight per device by the staged input_fn.
    staging_backend: the staged input_fn's backend: 'staging_area' (the only
      value).
    loss_reduction: 'auto', 'exact', 'mean' or 'sum', how the model_fn's loss reduces the batch.
    cross_example: 'auto' or 'refuse': whether a computation across examples
      that cannot be split per tower may run once on the whole batch, on the
      first device (with a warning), or is an error.
    random_draws: 'keyed' (each example's random draws set by its position
      in the global batch and the global step) or 'per_shard' (each tower
      draws on its own: the result depends on the device count).
    resume_input: True (default): in TRAIN a tf.data input's position is saved
      in every checkpoint, so a resumed run continues the same global batches;
      False: every train() call and restart reads from the first element.
    log_device_placement: log the device of every op when the session starts.
    allow_soft_placement: let TensorFlow move ops without a kernel for their
      device (summaries on a GPU tower, say) to another device. On by default,
      as in Estimator's own session config. It never hides missing GPUs:
      those are allow_cpu_fallback's business.
    gpu_memory_fraction: share of each GPU's memory the process takes; 0 keeps
      TensorFlow's default.
    allow_growth: allocate GPU memory as needed instead of up front.
    visible_gpus: GPU indices the session sees, e.g. '0,1'; '' for all.
    intra_op_threads: threads inside one op; 0 lets TensorFlow choose.
    inter_op_threads: ops run in parallel; 0 lets TensorFlow choose.
    allow_cpu_fallback: when num_gpus asks for more GPUs than are visible, run
      the missing towers on the host CPU with one warning, instead of raising.
    sync_batch_norm: None (default, unset): in TRAIN, batch norms use the
      global batch's statistics, as on one device; with micro_batches > 1 a
      batch norm is an error naming the choice. True: the same, and an
      error with micro_batches > 1. False: each shard's own statistics, with
      one warning per graph naming the batch norms.
    micro_batches: micro-batches per device and step (1: none).
    shards: None (default) or S, the fixed shard grid: the global batch is
      always cut into S shards, summed in one fixed order, so that training
      is bit-identical on any devices x micro-batches that divides S.
    worker_timeout_secs: under variable_strategy='collective' across workers,
      how long a training step (and the start) waits for the other training
      tasks before failing with DeadlineExceededError.

  Example:
      ```python
      config = estimator_towers.make_config(num_gpus=8, variable_strategy='replicated')
      model_fn = estimator_towers.replicate_model_fn(my_model_fn, plan=config.plan)
      run_config = estimator_towers.make_run_config(config, model_dir='/tmp/model')
      ```
  """
  num_gpus: int | None = None
  devices: tuple[str, ...] | None = None
  num_cpu_devices: int | None = None
  variable_strategy: str = 'auto'
  staging_depth: int = 1
  staging_backend: str = 'staging_area'
  loss_reduction: str = 'auto'
  cross_example: str = 'auto'
  random_draws: str = 'keyed'
  resume_input: bool = True
  log_device_placement: bool = False
  allow_soft_placement: bool = True
  gpu_memory_fraction: float = 0.0
  allow_growth: bool = False
  visible_gpus: str = ''
  intra_op_threads: int = 0
  inter_op_threads: int = 0
  allow_cpu_fallback: bool = False
  sync_batch_norm: bool | None = None
  micro_batches: int = 1
  worker_timeout_secs: float = 120.0
  shards: int | None = None

  @property
  def plan(self) -> plan_lib.DevicePlan:
    """The `DevicePlan` to pass to `replicate_model_fn(model_fn, plan=...)`."""
    devices = self.devices
    if self.num_cpu_devices is not None:
      devices = tuple(f'/cpu:{i}' for i in range(self.num_cpu_devices))
    return plan_lib.make_plan(num_gpus=self.num_gpus, devices=devices,
                              variable_strategy=self.variable_strategy,
                              loss_reduction=self.loss_reduction,
                              cross_example=self.cross_example,
                              random_draws=self.random_draws,
                              resume_input=self.resume_input,
                              staging_depth=self.staging_depth,
                              staging_backend=self.staging_backend,
                              allow_cpu_fallback=self.allow_cpu_fallback,
                              sync_batch_norm=self.sync_batch_norm,
                              micro_batches=self.micro_batches,
                              worker_timeout_secs=self.worker_timeout_secs,
                              shards=self.shards)


FIELDS = tuple(f.name for f in dataclasses.fields(TowersConfig))


def make_config(**kwargs: Any) -> TowersConfig:
  """Validates settings (the `TowersConfig` fields) and returns a TowersConfig.

  Messages spell settings in Python syntax (`num_gpus=2`), or as flags
  (`--num_gpus=2`) when called by `config_from_flags` or a flag validator.
  Unlike `make_plan`, it checks GPUs against the visible ones at once.

  Args:
    **kwargs: any `TowersConfig` field (num_gpus, devices, num_cpu_devices,
      variable_strategy, micro_batches, sync_batch_norm, session settings,
      ...); the others keep their defaults.

  Returns:
    The validated `TowersConfig`.

  Raises:
    TypeError: for an argument that is not a `TowersConfig` field.
    ValueError: for more than one of num_gpus / devices / num_cpu_devices, a
      value out of range, anything `plan.make_plan` rejects, or num_gpus
      beyond the visible GPUs without allow_cpu_fallback.

  Example:
      ```python
      config = estimator_towers.make_config(num_cpu_devices=2, variable_strategy='gpu')
      config.plan.devices   # ('/device:CPU:0', '/device:CPU:1')
      ```
  """
  return _make_config(kwargs, resolve=True)


def check_field(name: str, value: Any) -> None:
  """Checks one setting on its own (no GPU lookup): for per-flag validators.

  Raises:
    TypeError: if `name` is not a `TowersConfig` field.
    ValueError: if `value` is out of range for `name`.
  """
  _make_config({name: value}, resolve=False)


def _make_config(kwargs: dict[str, Any], resolve: bool) -> TowersConfig:
  kwargs = dict(kwargs)
  unknown = sorted(set(kwargs) - set(FIELDS))
  if unknown:
    raise TypeError(f'make_config() got unknown argument(s) {unknown}; the '
                    f'valid arguments are {list(FIELDS)}.')
  given = [name for name in _DEVICE_CHOICES if kwargs.get(name) is not None]
  if len(given) > 1:
    received = ' and '.join(spelling.setting(name, kwargs[name]) for name in given)
    if spelling.flags_active():
      raise ValueError(
          f'Give at most one of --num_gpus, --devices and --num_cpu_devices, '
          f'got {received}. --num_gpus=N means towers on /gpu:0../gpu:N-1 '
          f'(--num_gpus=0: the CPU), --num_cpu_devices=N towers on '
          f'/cpu:0../cpu:N-1, --devices=/gpu:0,/gpu:2 names the towers exactly.')
    raise ValueError(
        f'Give at most one of num_gpus, devices and num_cpu_devices '
        f'(--num_gpus, --devices, --num_cpu_devices), got {received}. '
        f'num_gpus=N means towers on /gpu:0../gpu:N-1 (num_gpus=0: the CPU), '
        f'num_cpu_devices=N towers on /cpu:0../cpu:N-1, devices=[...] names '
        f'the towers exactly.')
  if kwargs.get('num_cpu_devices') is not None:
    devices_lib.validate_count(kwargs['num_cpu_devices'], what='num_cpu_devices')
  if kwargs.get('devices') is not None:
    kwargs['devices'] = devices_lib.validate_devices(kwargs['devices'])
  for name in ('log_device_placement', 'allow_soft_placement', 'allow_growth',
               'allow_cpu_fallback'):
    _check_bool(name, kwargs.get(name, False))
  plan_lib.validate_sync_batch_norm(kwargs.get('sync_batch_norm'))
  for name in ('intra_op_threads', 'inter_op_threads'):
    _check_threads(name, kwargs.get(name, 0))
  _check_memory_fraction(kwargs.get('gpu_memory_fraction', 0.0))
  if 'visible_gpus' in kwargs:
    kwargs['visible_gpus'] = _normalize_visible_gpus(kwargs['visible_gpus'])
  if 'resume_input' in kwargs:  # numpy's bool kept as Python's
    kwargs['resume_input'] = plan_lib.validate_resume_input(kwargs['resume_input'])
  config = TowersConfig(**kwargs)
  plan = config.plan  # make_plan's checks: count, devices, strategy, reduction, depth.
  _check_gpus_visible(plan, config.visible_gpus)
  if resolve and plan.num_gpus is not None:
    plan.resolve(config_hints=True)  # Missing GPUs: an error now, before the script creates anything.
  return config


def session_config(config: TowersConfig) -> tf.compat.v1.ConfigProto:
  """The session's ConfigProto for `config`.

  Keeps Estimator's default graph rewriting (one meta-optimizer pass); sets
  device_count CPU to the number of virtual CPU devices the towers need, the
  GPU memory options, the thread counts and soft placement from `config`;
  under `variable_strategy='collective'` in a chief-and-workers cluster,
  limits the session to this task's devices (`device_filters`).

  Args:
    config: a TowersConfig from `make_config` or `config_from_flags`.

  Returns:
    A `tf.compat.v1.ConfigProto` for `tf.estimator.RunConfig(session_config=...)`.

  Raises:
    TypeError: if `config` is not a TowersConfig.

  Example:
      ```python
      config = estimator_towers.make_config(num_cpu_devices=2)
      run_config = tf.estimator.RunConfig(
          model_dir='/tmp/model', session_config=estimator_towers.session_config(config))
      ```
  """
  _check_config(config, 'session_config')
  proto = tf.compat.v1.ConfigProto(
      allow_soft_placement=config.allow_soft_placement,
      log_device_placement=config.log_device_placement,
      intra_op_parallelism_threads=config.intra_op_threads,
      inter_op_parallelism_threads=config.inter_op_threads)
  proto.graph_options.rewrite_options.meta_optimizer_iterations = (
      rewriter_config_pb2.RewriterConfig.ONE)
  num_cpus = _virtual_cpus(config)
  if num_cpus:
    proto.device_count['CPU'] = num_cpus
  if config.gpu_memory_fraction:
    proto.gpu_options.per_process_gpu_memory_fraction = config.gpu_memory_fraction
  proto.gpu_options.allow_growth = config.allow_growth
  proto.gpu_options.visible_device_list = config.visible_gpus
  strategy = recommended.cluster_strategy(config.variable_strategy)
  cluster = cluster_lib.parse() if strategy == 'collective' else None
  if cluster is not None and cluster.trains:  # this task's devices only: no ps
    proto.device_filters.append(f'/job:{cluster.task_type}/task:{cluster.task_index}')
  return proto


def make_run_config(config: TowersConfig, **run_config_kwargs: Any
                    ) -> tf.estimator.RunConfig:
  """A `tf.estimator.RunConfig` with `session_config(config)`.

  Under `variable_strategy='collective'` with a TF_CONFIG cluster it also
  checks the cluster and turns off Estimator's start delay of the workers
  (`experimental_max_worker_delay_secs=0`, unless given).

  Args:
    config: a TowersConfig from `make_config` or `config_from_flags`.
    **run_config_kwargs: any other RunConfig argument (model_dir,
      save_checkpoints_steps, ...).

  Returns:
    A `tf.estimator.RunConfig`.

  Raises:
    TypeError: if `config` is not a TowersConfig.
    ValueError: if run_config_kwargs holds session_config, or the TF_CONFIG
      cluster does not suit the variable strategy.

  Example:
      ```python
      config = estimator_towers.config_from_flags()
      estimator = tf.estimator.Estimator(
          estimator_towers.replicate_model_fn(model_fn, plan=config.plan),
          config=estimator_towers.make_run_config(config, model_dir=FLAGS.model_dir))
      ```
  """
  _check_config(config, 'make_run_config')
  if 'session_config' in run_config_kwargs:
    raise ValueError(
        'make_run_config builds session_config from the TowersConfig, so it '
        'cannot also be passed (got session_config='
        f'{run_config_kwargs["session_config"]!r}). Set the session options '
        'through make_config(...) or the flags, or build the RunConfig yourself '
        'with session_config(config) edited.')
  cluster = cluster_lib.parse()
  strategy = recommended.cluster_strategy(config.variable_strategy)
  if cluster is not None and cluster.trains:
    cluster_lib.check(cluster, strategy)
  if strategy == 'collective' and cluster is not None:
    # Every worker trains from its first step: the workers wait for each
    # other at the first all-reduce, so Estimator's start delay only costs.
    run_config_kwargs.setdefault('experimental_max_worker_delay_secs', 0)
  return tf.estimator.RunConfig(session_config=session_config(config),
                                **run_config_kwargs)


def _check_config(config: object, caller: str) -> None:
  if not isinstance(config, TowersConfig):
    raise TypeError(f'{caller} needs a TowersConfig from make_config() or '
                    f'config_from_flags(), got {config!r}.')


def _check_bool(name: str, value: object) -> None:
  if not isinstance(value, bool):
    raise ValueError(f'{name} must be True or False (flags --{name} / '
                     f'--no{name}), got {value!r}.')


def _check_threads(name: str, value: object) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f'{spelling.name(name)} must be a non-negative integer (0 '
                     f'lets TensorFlow choose), got {spelling.value(name, value)}.')


def _check_memory_fraction(value: object) -> None:
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not (value == 0 or 0 < value <= 1)):
    raise ValueError(
        f'{spelling.name("gpu_memory_fraction")} must be 0 (TensorFlow\'s '
        f'default) or in (0, 1] (the share of each GPU\'s memory this process '
        f'takes, e.g. {spelling.setting("gpu_memory_fraction", 0.5)}), got '
        f'{spelling.value("gpu_memory_fraction", value)}.')


def _normalize_visible_gpus(value: object) -> str:
  """'0, 1' -> '0,1'; raises unless a list of distinct GPU indices or ''."""
  items = [s.strip() for s in value.split(',')] if isinstance(value, str) else None
  if items == ['']:
    return ''
  if (items is None or not all(s.isdigit() for s in items)
      or len(set(map(int, items))) != len(items)):
    raise ValueError(
        f'{spelling.name("visible_gpus")} must be a comma-separated list of '
        f'distinct GPU indices such as {spelling.setting("visible_gpus", "0,1")} '
        f'(empty for every GPU), got {spelling.value("visible_gpus", value)}.')
  return ','.join(str(int(s)) for s in items)


def _check_gpus_visible(plan: plan_lib.DevicePlan, visible_gpus: str) -> None:
  """With visible_gpus set, the session sees only those GPUs, as /gpu:0.. ."""
  if not visible_gpus:
    return
  gpu_indices = [devices_lib.device_index(d) for d in plan.devices or ()
                 if devices_lib.device_type(d) == 'GPU']
  needed = plan.num_gpus or (max(gpu_indices) + 1 if gpu_indices else 0)
  available = len(visible_gpus.split(','))
  if needed > available:
    asked = (spelling.setting('num_gpus', plan.num_gpus) if plan.num_gpus
             else spelling.setting('devices', list(plan.devices)))
    raise ValueError(
        f'{asked} needs {needed} GPUs but '
        f'{spelling.setting("visible_gpus", visible_gpus)} shows the session '
        f'only {available} (as /gpu:0../gpu:{available - 1}). List more GPUs in '
        f'{"" if spelling.flags_active() else "visible_gpus / "}--visible_gpus '
        f'or use fewer towers.')


def _virtual_cpus(config: TowersConfig) -> int:
  """How many CPU devices the session must create for the towers (0: default)."""
  if config.num_cpu_devices is not None:
    return config.num_cpu_devices
  local_cpus: Sequence[str] = [
      d for d in config.devices or ()
      if devices_lib.device_type(d) == 'CPU'
      and tf.DeviceSpec.from_string(d).job in (None, 'localhost')]
  return max((devices_lib.device_index(d) + 1 for d in local_cpus), default=0)
