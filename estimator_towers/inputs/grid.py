"""The fixed shard grid: the global batch cut into S shards by one rule, on any topology.

With `shards=S`, the global batch is always cut into S shards by
`sharding.shard_sizes(B, S)` (shard s takes B // S rows, plus one if
s < B % S, in input order), whatever the devices, micro-batches and workers.
Each shard is one tower, so each shard's computation has the same shapes and
the same ops on any topology. The shards are dealt out in contiguous blocks:
W workers, then N devices per worker, then k micro-batches per device; a
device runs its S / (W N) shards as S / (W N k) towers side by side (on the
same device), each taking its k micro-batches one after another.

Every sum across shards follows one fixed binary tree over the shard indices
(`gradients.fixed_order`): a range [lo, hi) of more than one shard splits at
lo + the largest power of two below hi - lo. A block of shards whose size is
a power of two and that starts at a multiple of it is a subtree, so a
device's (and a micro-batch tower's) local sum is a subtree when the shards
per device, S / (W N), are a power of two; `check_grid` requires it, that
W N k divide S, and across workers that a worker's S / W be a power of two
too (its sum is then one node, and the tree above the workers is the tree
over their ranks: `cluster.fixed_reduce`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import tensorflow as tf

from estimator_towers.base import fixed_sums
from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.inputs import micro_batches as micro_batches_lib
from estimator_towers.inputs import sharding


class GridError(ValueError):
  """A topology the fixed shard grid cannot be dealt out on."""


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def check_grid(shards: int, devices: int, micro_batches: int = 1, workers: int = 1) -> None:
  """Raises GridError unless the S shards can be dealt out on this topology.

  devices x micro-batches x workers must divide S, and the shards per device
  S / (workers x devices) must be a power of two (a device's local sum is then
  a subtree of the summation tree).
  """
  used = devices * micro_batches * workers
  where = (f'{devices} device(s) x {micro_batches} micro-batch(es) x {workers} '
           f'worker(s) = {used}')
  if shards % used:
    raise GridError(
        f'shards={shards} cannot be dealt out on {where}: devices x micro-batches '
        f'x workers must divide shards, so that every device runs the same '
        f'number of whole shards. The divisors of {shards} are '
        f'{divisors(shards)}; choose a topology whose product is one of them, or '
        f'a shards count that {used} divides.')
  per_worker = shards // workers
  if workers > 1 and per_worker & (per_worker - 1):
    raise GridError(
        f'shards={shards} on {workers} workers gives {per_worker} shards per '
        f'worker, not a power of two: a worker\'s shards must form a subtree of '
        f'the fixed summation tree, so its own sum is one node of it. Use a '
        f'worker count for which shards / workers is a power of two (the '
        f'divisors of {shards}: {divisors(shards)}).')
  per_device = shards // (devices * workers)
  if devices * workers > 1 and per_device & (per_device - 1):
    raise GridError(
        f'shards={shards} on {devices * workers} device(s) gives {per_device} '
        f'shards per device, not a power of two: a device\'s shards must form a '
        f'subtree of the fixed summation tree, so its local sum is one node of '
        f'it. Use a device count for which shards / devices is a power of two '
        f'(the divisors of {shards}: {divisors(shards)}).')


@dataclasses.dataclass(frozen=True)
class GridLayout(micro_batches_lib.Layout):
  """The layout of the fixed grid: `num_devices` towers (several may share a device),
  `micro_batches` shards each, one after another; the sizes by one cut into S shards."""

  shares_devices = True  # towers may share a device (not a dataclass field)

  def split_batch(self, batch, num_towers: int) -> list:
    del num_towers
    return list(sharding.shard_sizes(batch, self.num_shards))


def tower_sizes(batch, shards: int | None, num_towers: int, micro_batches: int) -> list:
  """The rows of each tower of a global batch of `batch` rows: without the grid
  `sharding.shard_sizes(batch, num_towers)`; on it, each tower's k shards' (the grid's cut
  into S, in blocks of k), which `Layout.sizes` splits again into the grid's shards (a block
  of consecutive shards of the cut is the block's own rows cut into k)."""
  if shards is None:
    return sharding.shard_sizes(batch, num_towers)
  sizes = sharding.shard_sizes(batch, shards)
  return [functools.reduce(lambda a, b: a + b, sizes[t * micro_batches:(t + 1) * micro_batches])
          for t in range(num_towers)]


def tower_devices(devices: Sequence[str], shards: int, micro_batches: int) -> tuple:
  """Each grid tower's device: device d hosts S / (N k) towers, contiguous."""
  per_device = shards // (len(devices) * micro_batches)
  return tuple(d for d in devices for _ in range(per_device))


def grid_devices(shards: int | None, devices: Sequence[str], micro_batches: int,
                 workers: int = 1) -> tuple:
  """The towers' devices: `devices` as they are without a grid (shards None), else
  each device once per tower it hosts (after `check_grid`)."""
  if shards is None:
    return tuple(devices)
  check_grid(shards, len(devices), micro_batches, workers)
  if (any(tf.DeviceSpec.from_string(d).device_type == 'GPU' for d in devices)
      and not interception.op_determinism_enabled()):
    logs.warning_once(
        f'estimator_towers: shards={shards} on GPUs gives bit-identical checkpoints '
        f'only with deterministic kernels (cuDNN and atomics pick their summation '
        f'order otherwise): call tf.config.experimental.enable_op_determinism() '
        f'before building the Estimator.', key='grid:op_determinism')
  return tower_devices(devices, shards // workers, micro_batches)


def layout(shards: int | None, num_towers: int, micro_batches: int) -> micro_batches_lib.Layout:
  """The plan's layout: the grid's with shards (the default graph is then marked as
  built on it: `fixed_sums.active`), else one shard per device and micro-batch.
  Across workers, the towers are this worker's S / W shards (`grid_devices`)."""
  if shards is None:
    return micro_batches_lib.Layout(num_towers, micro_batches)
  fixed_sums.mark(tf.compat.v1.get_default_graph(), shards)
  return GridLayout(num_towers, micro_batches)


def check_cluster(shards: int | None, workers: int, synchronised: bool,
                  variable_strategy: str) -> None:
  """Raises GridError for the grid on W > 1 training tasks that do not meet at
  all-reduces every step (a cluster under another strategy than 'collective')."""
  if shards is None or workers < 2 or synchronised:
    return
  raise GridError(
      f'shards={shards} across {workers} training tasks needs '
      f"variable_strategy='collective' (got {variable_strategy!r}): only its "
      f'all-reduces sum the workers\' gradients every step, which the fixed '
      f'summation order takes over. Use variable_strategy=\'collective\', or '
      f'train without shards.')
