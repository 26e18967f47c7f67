"""DevicePlan: the one value that says which devices host towers, and how.

The towered model_fn and the staged input_fn take the same plan, so the two
sides can never disagree on the devices or on how a batch is split.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from estimator_towers.base import spelling
from estimator_towers.cluster import servers as cross_worker_servers
from estimator_towers.placement import devices as devices_lib
from estimator_towers.placement import strategies as placement
from estimator_towers.settings import staging_backends

LOSS_REDUCTIONS = ('auto', 'exact', 'mean', 'sum')
# What a computation across examples that would run once on the whole batch gets: 'auto' builds
# it (exact; a warning says what share of the step then runs on one device), 'refuse' raises.
CROSS_EXAMPLE = ('auto', 'refuse')
RANDOM_DRAWS = ('keyed', 'per_shard')


@dataclasses.dataclass(frozen=True)
class DevicePlan:
  """Immutable description of a towered setup; build it with `make_plan`.

  The one value both sides of a towered Estimator take: the towered model_fn
  (`replicate_model_fn(model_fn, plan=plan)`) and the staged input_fn
  (`staged_input_fn(input_fn, plan)`), so that they cannot disagree on the
  devices. Frozen: change a field with `dataclasses.replace`, which does not
  validate; prefer a new `make_plan`.

  Attributes:
    devices: canonical tower devices, or None for "every visible GPU (the CPU
      when there is none)", resolved at graph construction.
    num_gpus: the GPU count asked for, when given as a count; 0 means one
      tower on the host CPU.
    variable_strategy: where variables live and gradients are combined:
      'auto' (default: the recommended one for the devices), 'cpu', 'gpu',
      'replicated' or 'collective' (see the placement page).
    loss_reduction: 'auto' (default: the whole batch's loss is rebuilt from
      the shards' statistics (see the losses page); a loss it cannot
      rebuild gets one warning naming the op and the reduction the model_fn's
      TensorFlow loss function recorded, else a mean), 'exact' ('auto', with
      that warning an error), 'mean' (the loss is a mean over the batch:
      towers are weighted by their share of the batch) or 'sum' (towers add
      up).
    cross_example: 'auto' (default: a computation across examples that
      cannot be split per tower runs once, on the whole batch, on the first
      device: exact, with a warning saying what share of the step's heavy
      ops that puts on one device) or 'refuse' (that is an error at graph
      construction: the towers must stay data-parallel).
    random_draws: 'keyed' (default: every random op draws each example's
      values by its position in the global batch and the global step, so
      any device count, micro-batch or worker, and a resumed run, draw what
      one device draws; see the random draws page) or 'per_shard' (each
      tower draws its shard on its own, as the undecorated model_fn would:
      the draws, and so the training, then depend on the device count and
      restart with each session).
    resume_input: True (default): in TRAIN a tf.data input's position (its
      iterator, batches prefetched or staged) is saved in every checkpoint, so
      a resumed run continues the same global batches; False: it starts over.
    staging_depth: shards kept in flight per device by the staged input_fn.
    staging_backend: how the staged input_fn prefetches shards:
      'staging_area' (a StagingArea per device; the only value).
    allow_cpu_fallback: when num_gpus asks for more GPUs than are visible, run
      the missing towers on the host CPU (with one warning) instead of raising.
    sync_batch_norm: True: in TRAIN, every batch normalisation uses the
      statistics of the global batch (all towers' shards), as on one device;
      what make_plan makes of the default (unset) with one micro-batch.
      False: each shard's own statistics (one warning per graph names the
      batch norms). None: unset with micro_batches > 1, where the global
      statistics would need every micro-batch's activations at once: a
      batch norm in TRAIN is then an error naming the choice.
    micro_batches: k, the micro-batches each device splits its shard into and
      runs one after another within a step (1: none).
    shards: S, the fixed shard grid (None: none): the global batch is
      always cut into S shards, each a tower, and every sum across shards
      follows one fixed tree, so that training is bit-identical on any
      topology that deals the shards out evenly (see the guarantees page).
    worker_timeout_secs: under variable_strategy='collective' across workers,
      how long a training step (and the start, for the variables' broadcast)
      waits for the other workers before failing with DeadlineExceededError.

  Example:
      ```python
      plan = estimator_towers.make_plan(num_gpus=8, variable_strategy='replicated')
      model_fn = estimator_towers.replicate_model_fn(my_model_fn, plan=plan)
      input_fn = estimator_towers.staged_input_fn(my_input_fn, plan)
      ```
  """
  devices: tuple[str, ...] | None = None
  num_gpus: int | None = None
  variable_strategy: str = 'auto'
  loss_reduction: str = 'auto'
  staging_depth: int = 1
  staging_backend: str = 'staging_area'
  allow_cpu_fallback: bool = False
  sync_batch_norm: bool | None = True
  micro_batches: int = 1
  worker_timeout_secs: float = 120.0
  cross_example: str = 'auto'
  random_draws: str = 'keyed'
  resume_input: bool = True
  shards: int | None = None

  def resolve(self, config_hints: bool = False) -> tuple[str, ...]:
    """The devices the towers really get on this machine.

    Explicit devices are taken as given (a warning says when they name GPUs
    that are not visible here); num_gpus=0 is the host CPU; num_gpus=N needs N
    visible GPUs, or allow_cpu_fallback; no choice means every visible GPU, or
    the host CPU when there is none.

    Args:
      config_hints: the error's fixes name `make_config`'s arguments (its
        caller) instead of `replicate_model_fn`'s and `make_plan`'s.

    Raises:
      ValueError: when num_gpus asks for more GPUs than are visible and
        allow_cpu_fallback is off.
    """
    if self.devices is not None:
      devices_lib.warn_invisible_gpus(self.devices)
      return self.devices
    if self.num_gpus is None:
      return devices_lib.default_devices()
    return devices_lib.resolve_gpu_count(self.num_gpus, self.allow_cpu_fallback, config_hints)


def make_plan(num_gpus: int | None = None, devices: Sequence[str] | None = None,
              variable_strategy: str = 'auto', loss_reduction: str = 'auto',
              staging_depth: int = 1,
              staging_backend: str = 'staging_area',
              allow_cpu_fallback: bool = False,
              sync_batch_norm: bool | None = None,
              micro_batches: int = 1,
              worker_timeout_secs: float = 120.0,
              cross_example: str = 'auto',
              random_draws: str = 'keyed',
              resume_input: bool = True,
              shards: int | None = None) -> DevicePlan:
  """Validates arguments and returns a DevicePlan.

  Give the plan to `replicate_model_fn(model_fn, plan=plan)` and, for staged
  input, to `staged_input_fn(input_fn, plan)`. With neither num_gpus nor
  devices, the towers are every visible GPU (the CPU when there is none),
  resolved when the graph is built.

  Args:
    num_gpus: towers on /gpu:0 .. /gpu:N-1; 0 trains on the host CPU.
    devices: explicit tower devices, instead of num_gpus, e.g.
      ['/gpu:0', '/gpu:2'] or ['/cpu:0', '/cpu:1'].
    variable_strategy: 'auto' (default: the one the choosing-a-strategy
      page recommends for the devices and the cluster, named in the device
      report), 'cpu' (variables on the host CPU), 'gpu' (spread over the
      tower devices), 'replicated' (a copy per tower) or 'collective' (a
      copy per tower, all-reduced; also across a chief and workers). See the
      placement page.
    loss_reduction: 'auto' (default: the whole batch's loss rebuilt from the
      shards' statistics, one warning for a loss it cannot rebuild), 'exact'
      ('auto' with that warning an error), 'mean' or 'sum' (the towers'
      losses weighted by that rule, without analysis).
    staging_depth: shards kept in flight per device by `staged_input_fn`;
      0 turns staging off.
    staging_backend: 'staging_area' (the only value).
    allow_cpu_fallback: run towers on the host CPU when num_gpus asks for
      more GPUs than are visible, instead of raising at graph construction.
    sync_batch_norm: None (default: True, batch norms in TRAIN use the
      global batch's statistics, exactly as on one device; with
      micro_batches > 1 a batch norm is an error naming the choice), True
      (the same; an error with micro_batches > 1) or False (each shard's own
      statistics, with one warning per graph naming the batch norms).
    micro_batches: k >= 1: each device's shard is split into k micro-batches
      that run one after another on that device, within one step.
    worker_timeout_secs: variable_strategy='collective' across workers: a
      step waits this long for the other workers before failing.
    cross_example: 'auto' (default: a computation across examples that
      cannot be split per tower runs once on the whole batch, on the first
      device, with a warning giving that device's share of the step's heavy
      ops) or 'refuse' (an error instead: the towers stay data-parallel).
    random_draws: 'keyed' (default: each example's random draws are set by
      its position in the global batch and the global step, the same on any
      topology and after a restart) or 'per_shard' (each tower draws on its
      own: the result depends on the device count).
    resume_input: True (default: in TRAIN the tf.data input's position is
      saved in every checkpoint, so a resumed run continues the same global
      batches) or False (every train() call reads from the first element).
    shards: None (default: the batch is cut per device and micro-batch) or
      S: the fixed shard grid. The global batch is always cut into S shards
      (one tower each) and every sum across them is taken in one fixed
      order, so that the checkpoints are bit-identical on any devices x
      micro-batches x workers that divides S (with S / (devices x workers)
      a power of two); another topology is an error naming the divisors.

  Raises:
    ValueError: for a count together with devices, a negative count,
      duplicate or malformed devices, an unknown strategy, reduction or
      cross_example, or a
      negative staging depth, an unknown or removed staging backend, or
      micro_batches that is not a positive integer, a resume_input that
      is not a bool, a sync_batch_norm that is not True, False or None, or
      sync_batch_norm=True with micro_batches > 1.

  Example:
      ```python
      plan = estimator_towers.make_plan(num_gpus=4, variable_strategy='gpu')
      estimator = tf.estimator.Estimator(
          estimator_towers.replicate_model_fn(model_fn, plan=plan))
      ```
  """
  if num_gpus is not None and devices is not None:
    raise ValueError(
        f'Give either num_gpus or devices, not both (got num_gpus={num_gpus!r} '
        f'and devices={devices!r}). devices=[...] names the towers exactly; '
        f'num_gpus=N means devices=["/gpu:0", ..., "/gpu:N-1"].')
  if num_gpus is not None:
    devices_lib.validate_gpu_count(num_gpus)
  canonical = devices_lib.validate_devices(devices) if devices is not None else None
  placement.validate_strategy(variable_strategy)
  if loss_reduction not in LOSS_REDUCTIONS:
    raise ValueError(
        f'{spelling.name("loss_reduction")} must be one of {LOSS_REDUCTIONS}, '
        f'got {spelling.value("loss_reduction", loss_reduction)}: use "auto" to '
        f'rebuild the whole batch\'s loss from the shards\' statistics, "exact" '
        f'for "auto" that raises where it cannot, "mean" '
        f'when your loss averages over the batch (tf.compat.v1.losses and Keras '
        f'losses do) and "sum" when it adds up per-example losses.')
  validate_cross_example(cross_example)
  validate_random_draws(random_draws)
  resume_input = validate_resume_input(resume_input)
  shards = validate_shards(shards)
  if isinstance(staging_depth, bool) or not isinstance(staging_depth, int) or staging_depth < 0:
    raise ValueError(
        f'{spelling.name("staging_depth")} must be a non-negative integer '
        f'(shards kept in flight per device; 0 turns staging off), got '
        f'{spelling.value("staging_depth", staging_depth)}.')
  if not isinstance(allow_cpu_fallback, bool):
    raise ValueError(f'{spelling.name("allow_cpu_fallback")} must be True or False, got '
                     f'{spelling.value("allow_cpu_fallback", allow_cpu_fallback)}.')
  validate_sync_batch_norm(sync_batch_norm)
  staging_backends.validate_backend(staging_backend, what=spelling.name('staging_backend'))
  _validate_micro_batches(micro_batches)
  sync_batch_norm = resolve_sync_batch_norm(sync_batch_norm, micro_batches)
  if (isinstance(worker_timeout_secs, bool) or not isinstance(worker_timeout_secs, (int, float))
      or not worker_timeout_secs > 0):
    raise ValueError(
        f'{spelling.name("worker_timeout_secs")} must be a positive number of seconds '
        f'(how long a step waits for the other workers), got '
        f'{spelling.value("worker_timeout_secs", worker_timeout_secs)}. The default is 120.')
  if variable_strategy in ('collective', 'auto'):  # 'auto' is collective in such a cluster
    cross_worker_servers.install()
  return DevicePlan(devices=canonical, num_gpus=num_gpus,
                    variable_strategy=variable_strategy,
                    loss_reduction=loss_reduction, staging_depth=staging_depth,
                    staging_backend=staging_backend,
                    allow_cpu_fallback=allow_cpu_fallback,
                    sync_batch_norm=sync_batch_norm,
                    micro_batches=micro_batches,
                    worker_timeout_secs=float(worker_timeout_secs),
                    cross_example=cross_example, random_draws=random_draws,
                    resume_input=resume_input, shards=shards)


def validate_shards(value: object) -> int | None:
  """Checks a `shards` setting: None (no fixed grid) or an integer >= 1.

  Raises:
    ValueError: for anything else (a bool, a float, 0 or less).
  """
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(
        f'{spelling.name("shards")} must be a positive integer (the number of '
        f'shards the global batch is always cut into, whatever the devices) or '
        f'None (no fixed grid), got {spelling.value("shards", value)}. Use e.g. '
        f'{spelling.setting("shards", 8)} to train bit-identically on 1, 2, 4 or 8 '
        f'devices.')
  return value


def validate_sync_batch_norm(value: object) -> None:
  """Checks a `sync_batch_norm` setting.

  Raises:
    ValueError: unless `value` is True, False or None (unset).
  """
  if value is not None and not isinstance(value, bool):
    raise ValueError(
        f'{spelling.name("sync_batch_norm")} must be True, False or unset (None), got '
        f'{spelling.value("sync_batch_norm", value)}: leave it unset (the default) for '
        f'the global batch\'s batch-norm statistics, as on one device, or pass '
        f'{spelling.setting("sync_batch_norm", False)} for each shard\'s own.')


def resolve_sync_batch_norm(value: bool | None, micro_batches: int) -> bool | None:
  """The plan's `sync_batch_norm`: unset is True with one micro-batch, and stays None
  (a batch norm is then an error naming the choice) with micro-batches.

  Raises:
    ValueError: for True with micro_batches > 1.
  """
  if value and micro_batches > 1:
    raise ValueError(
        f'{spelling.setting("sync_batch_norm", True)} and {spelling.name("micro_batches")}='
        f'{micro_batches} cannot be combined: global batch-norm statistics need '
        f'every micro-batch\'s forward pass before any of them is normalised, '
        f'which is what micro-batches avoid. Use one of the two: '
        f'{spelling.setting("micro_batches", 1)}, or '
        f'{spelling.setting("sync_batch_norm", False)} (each micro-batch uses its '
        f'own statistics).')
  if value is None and micro_batches == 1:
    return True
  return value


def validate_random_draws(value: object) -> None:
  """Checks a `random_draws` setting.

  Raises:
    ValueError: for a value not in `RANDOM_DRAWS`.
  """
  _validate_choice('random_draws', value, RANDOM_DRAWS,
                   'use "keyed" to draw each example\'s random values by its position in the '
                   'global batch (the same on any device count and after a restart), or '
                   '"per_shard" to let each tower draw on its own.')


def validate_resume_input(value: object) -> bool:
  """Checks a `resume_input` setting and returns it as a Python bool.

  Raises:
    ValueError: unless `value` is a bool (Python's or numpy's); 1 or 'yes' are not.
  """
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(
        f'{spelling.name("resume_input")} must be True or False, got '
        f'{spelling.value("resume_input", value)}: use '
        f'{spelling.setting("resume_input", True)} (the default) to save the '
        f'position of a tf.data input in every checkpoint, so a resumed run '
        f'continues the same global batches, or '
        f'{spelling.setting("resume_input", False)} to read the input from its '
        f'first element at every train() call and restart.')
  return bool(value)


def validate_cross_example(value: object) -> None:
  """Checks a `cross_example` setting.

  Raises:
    ValueError: for a value not in `CROSS_EXAMPLE`.
  """
  _validate_choice('cross_example', value, CROSS_EXAMPLE,
                   'use "auto" to run a computation across examples that cannot be split per '
                   'tower once on the whole batch (exact, with a warning when it puts work on '
                   'one device), or "refuse" to make that an error.')


def _validate_choice(name: str, value: object, choices: tuple, advice: str) -> None:
  if value not in choices:
    raise ValueError(f'{spelling.name(name)} must be one of {choices}, got '
                     f'{spelling.value(name, value)}: {advice}')


def plan_from_arguments(plan: DevicePlan | None, num_gpus: int | None,
                        devices: Sequence[str] | None, variable_strategy: str,
                        loss_reduction: str, sync_batch_norm: bool | None,
                        micro_batches: int, cross_example: str = 'auto',
                        random_draws: str = 'keyed',
                        resume_input: bool = True,
                        shards: int | None = None) -> DevicePlan:
  """`replicate_model_fn`'s plan: the one it was given, or one made from its arguments.

  Raises:
    ValueError: for a plan together with devices or settings of its own
      (each differing from its default), or invalid arguments (`make_plan`).
    TypeError: if `plan` is not a DevicePlan.
  """
  if plan is None:
    return make_plan(num_gpus=num_gpus, devices=devices,
                     variable_strategy=variable_strategy,
                     loss_reduction=loss_reduction,
                     sync_batch_norm=sync_batch_norm,
                     micro_batches=micro_batches,
                     cross_example=cross_example, random_draws=random_draws,
                     resume_input=resume_input, shards=shards)
  if num_gpus is not None or devices is not None:
    raise ValueError('Give either plan or num_gpus/devices, not both; the '
                     'plan already names the devices.')
  if not isinstance(plan, DevicePlan):
    raise TypeError(f'plan must be a DevicePlan from make_plan, got {plan!r}.')
  validate_resume_input(resume_input)  # 1 == True: not an override, still not a bool.
  overridden = {name: value for name, value, default in (
      ('variable_strategy', variable_strategy, 'auto'),
      ('loss_reduction', loss_reduction, 'auto'),
      ('sync_batch_norm', sync_batch_norm, None),
      ('micro_batches', micro_batches, 1),
      ('cross_example', cross_example, 'auto'),
      ('random_draws', random_draws, 'keyed'),
      ('resume_input', resume_input, True),
      ('shards', shards, None)) if value != default}
  if overridden:
    settings = ', '.join(f'{name}={value!r}' for name, value in overridden.items())
    raise ValueError(
        f'Give either plan or {settings}, not both: the plan already holds '
        f'these settings. Pass them to make_plan(...) (or make_config(...)) '
        f'instead.')
  return plan

def _validate_micro_batches(value: object) -> int:
  """Checks a `micro_batches` setting.

  Raises:
    ValueError: unless `value` is an integer >= 1 (not a bool).
  """
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(
        f'{spelling.name("micro_batches")} must be a positive integer (the '
        f'number of micro-batches each device splits its shard into and runs '
        f'one after another; 1 turns micro-batches off), got '
        f'{spelling.value("micro_batches", value)}. Use '
        f'{spelling.setting("micro_batches", 1)} for none, or e.g. '
        f'{spelling.setting("micro_batches", 4)} for a device shard in 4 parts.')
  return value
