"""The devices of the session a towered graph will run in: towers only on devices that exist.

Rule: Estimator runs each graph in a session made from
`RunConfig.session_config`. That session has `device_count['CPU']` CPU
devices (one, CPU:0, when the count is not set) and the GPUs TensorFlow sees
(fewer when `device_count['GPU']` or `gpu_options.visible_device_list` limit
them). A tower on a device of this machine beyond those is an error when the
graph is built, whatever the variable strategy: soft placement would move it
onto a device another tower already uses, so the towers would share one
device, and a collective all-reduce among them would wait forever for a
group that never forms. A model_fn called without a RunConfig (a graph built
by hand, to inspect or export) is not checked: its session is not known yet.
Devices of other tasks (`/job:ps/...`) belong to their servers and are not
checked either.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from estimator_towers.placement import devices as devices_lib

_LOCAL_JOBS = (None, 'localhost')


def session_device_counts(session_config: tf.compat.v1.ConfigProto | None) -> dict[str, int]:
  """How many CPU and GPU devices a session made with `session_config` has.

  `None` is Estimator's default session config: one CPU device, every visible GPU.
  """
  gpus = len(devices_lib.visible_gpus())
  if session_config is None:
    return {'CPU': 1, 'GPU': gpus}
  counts = session_config.device_count
  cpus = counts['CPU'] if 'CPU' in counts else 1
  listed = session_config.gpu_options.visible_device_list
  if listed:
    gpus = min(gpus, len(listed.split(',')))
  if 'GPU' in counts:
    gpus = min(gpus, counts['GPU'])
  return {'CPU': max(cpus, 1), 'GPU': gpus}


def missing_devices(devices: Sequence[str], counts: dict[str, int]) -> list[str]:
  """The devices of this machine among `devices` that a session with `counts` lacks."""
  missing = []
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    kind = devices_lib.device_type(device)
    if spec.job in _LOCAL_JOBS and kind in counts and \
        devices_lib.device_index(device) >= counts[kind]:
      missing.append(device)
  return missing


def check_towers_exist(devices: Sequence[str], config: Any) -> None:
  """Raises when a tower device does not exist in the session `config` makes.

  Args:
    devices: the towers' canonical devices.
    config: the model_fn's `config` (a `tf.estimator.RunConfig`), or None (not checked).

  Raises:
    ValueError: naming the towers' devices that do not exist, the devices
      that do, and the fix.
  """
  if config is None or not hasattr(config, 'session_config'):
    return
  counts = session_device_counts(config.session_config)
  missing = missing_devices(devices, counts)
  if not missing:
    return
  raise ValueError(
      f'Towers on {", ".join(devices)}: {", ".join(missing)} do not exist in the '
      f'session this RunConfig makes, which has {_existing(counts)}. TensorFlow would '
      f'move those towers onto a device another tower already uses (soft '
      f'placement): they would share it (and with variable_strategy=\'collective\' '
      f'their all-reduce would never complete). Fix one of: {_fixes(missing, devices)}.')


def _existing(counts: dict[str, int]) -> str:
  cpus = ', '.join(f'CPU:{i}' for i in range(counts['CPU']))
  gpus = ', '.join(f'GPU:{i}' for i in range(counts['GPU'])) or 'no GPU'
  return f'{cpus} and {gpus}'


def _fixes(missing: Sequence[str], devices: Sequence[str]) -> str:
  """The fixes, each an argument of RunConfig, make_config or replicate_model_fn."""
  fixes = []
  cpus = [d for d in devices if devices_lib.device_type(d) == 'CPU']
  if any(devices_lib.device_type(d) == 'CPU' for d in missing):
    needed = max(devices_lib.device_index(d) for d in cpus) + 1
    fixes.append(
        f'create {needed} virtual CPU devices with tf.estimator.RunConfig('
        f'session_config=tf.compat.v1.ConfigProto(device_count={{\'CPU\': {needed}}})), '
        f'or config = make_config(num_cpu_devices={needed}, ...) with '
        f'replicate_model_fn(plan=config.plan) and make_run_config(config)')
  if any(devices_lib.device_type(d) == 'GPU' for d in missing):
    fixes.append(
        'name only GPUs the session sees in replicate_model_fn(devices=[...]) '
        '(check CUDA_VISIBLE_DEVICES and the session config\'s device_count and '
        'gpu_options.visible_device_list), or replicate_model_fn(plan=make_plan('
        'num_gpus=N, allow_cpu_fallback=True)) to run towers beyond the visible '
        'GPUs on the CPU')
  return '; '.join(fixes)
