"""DevicePlan: the one value that says which devices host towers, and how.

The towered model_fn and the staged input_fn take the same plan, so the two
sides can never disagree on the devices or on how a batch is split.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from absl import logging

from estimator_towers import devices as devices_lib
from estimator_towers import placement

LOSS_REDUCTIONS = ('auto', 'mean', 'sum')


@dataclasses.dataclass(frozen=True)
class DevicePlan:
  """Immutable description of a towered setup; build it with `make_plan`.

  Attributes:
    devices: canonical tower devices, or None for "every visible GPU (the CPU
      when there is none)", resolved at graph construction.
    num_gpus: the GPU count asked for, when given as a count.
    variable_strategy: a key of `placement.STRATEGIES`.
    loss_reduction: 'auto' (default: the reduction the model_fn's TensorFlow
      loss function recorded, as TensorFlow's distribution strategies read it;
      a mean when none did), 'mean' (the loss is a mean over the batch: towers
      are weighted by their share of the batch) or 'sum' (towers add up).
    staging_depth: shards kept in flight per device by the staged input_fn.
    staging_backend: how the staged input_fn prefetches shards: one of
      `staging.BACKENDS` ('staging_area', a StagingArea per device).
  """
  devices: tuple[str, ...] | None = None
  num_gpus: int | None = None
  variable_strategy: str = 'cpu'
  loss_reduction: str = 'auto'
  staging_depth: int = 1
  staging_backend: str = 'staging_area'

  def resolve(self, allow_soft_placement: bool = False) -> tuple[str, ...]:
    """The tower devices on this machine.

    Raises:
      ValueError: when more GPUs are asked for than are visible and soft
        placement is off.
    """
    if self.devices is not None:
      return self.devices
    if self.num_gpus is None:
      return devices_lib.default_devices()
    visible = devices_lib.visible_gpus()
    if self.num_gpus > len(visible):
      message = (
          f'num_gpus={self.num_gpus} asks for more GPUs than are visible '
          f'({len(visible)}); visible devices: {devices_lib.visible_devices()}. '
          f'Lower --num_gpus, check CUDA_VISIBLE_DEVICES / --visible_gpus, or '
          f'run towers on virtual CPU devices with --num_cpu_devices=N '
          f'(devices=["/cpu:0", ...]).')
      if not allow_soft_placement:
        raise ValueError(message)
      logging.warning('%s allow_soft_placement is on: TensorFlow will place '
                      'the missing towers on other devices.', message)
    return devices_lib.gpu_devices(self.num_gpus)


def make_plan(num_gpus: int | None = None, devices: Sequence[str] | None = None,
              variable_strategy: str = 'cpu', loss_reduction: str = 'auto',
              staging_depth: int = 1,
              staging_backend: str = 'staging_area') -> DevicePlan:
  """Validates arguments and returns a DevicePlan.

  Raises:
    ValueError: for a count together with devices, a non-positive count,
      duplicate or malformed devices, an unknown strategy or reduction, or a
      negative staging depth, or an unknown or removed staging backend.
  """
  if num_gpus is not None and devices is not None:
    raise ValueError(
        f'Give either num_gpus or devices, not both (got num_gpus={num_gpus!r} '
        f'and devices={devices!r}). devices=[...] names the towers exactly; '
        f'num_gpus=N means devices=["/gpu:0", ..., "/gpu:N-1"].')
  if num_gpus is not None:
    devices_lib.validate_count(num_gpus)
  canonical = devices_lib.validate_devices(devices) if devices is not None else None
  placement.validate_strategy(variable_strategy)
  if loss_reduction not in LOSS_REDUCTIONS:
    raise ValueError(
        f'loss_reduction must be one of {LOSS_REDUCTIONS}, got '
        f'{loss_reduction!r}: use "auto" to follow the reduction your '
        f'TensorFlow loss function records, "mean" when your loss averages over the '
        f'batch (tf.compat.v1.losses and Keras losses do) and "sum" when it '
        f'adds up per-example losses.')
  if isinstance(staging_depth, bool) or not isinstance(staging_depth, int) or staging_depth < 0:
    raise ValueError(
        f'staging_depth must be a non-negative integer (shards kept in flight '
        f'per device; 0 turns staging off), got {staging_depth!r}.')
  from estimator_towers import staging  # pylint: disable=g-import-not-at-top  (staging imports plan)
  staging.validate_backend(staging_backend, what='staging_backend')
  return DevicePlan(devices=canonical, num_gpus=num_gpus,
                    variable_strategy=variable_strategy,
                    loss_reduction=loss_reduction, staging_depth=staging_depth,
                    staging_backend=staging_backend)
