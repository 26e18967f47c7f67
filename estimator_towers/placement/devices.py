"""Device strings: normalisation, validation and discovery.

CPU and GPU device strings are treated alike everywhere in the library: a
tower is "a device string", whatever kind of device it names.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from estimator_towers.base import logs
from estimator_towers.base import spelling

HOST_CPU = '/device:CPU:0'


def canonical(device: str) -> str:
  """Returns the canonical form of `device` ('/cpu:1' -> '/device:CPU:1').

  Raises:
    ValueError: if `device` is not a string TensorFlow can parse.
  """
  if not isinstance(device, str) or not device:
    raise ValueError(
        f'A device must be a non-empty string such as "/gpu:0" or "/cpu:1"; '
        f'got {device!r}.')
  try:
    return tf.DeviceSpec.from_string(device).to_string()
  except (ValueError, TypeError) as e:
    raise ValueError(
        f'Cannot parse device string {device!r} ({e}). Use the form '
        f'"/gpu:0", "/cpu:1" or "/job:worker/task:0/device:GPU:0".') from e


def validate_devices(devices: Sequence[str]) -> tuple[str, ...]:
  """Checks a list of tower devices and returns their canonical forms.

  Raises:
    ValueError: if the list is empty, a string, or names a device twice.
  """
  if isinstance(devices, str):
    raise ValueError(
        f'devices must be a list of device strings, got the single string '
        f'{devices!r}; write devices=[{devices!r}].')
  devices = list(devices)
  if not devices:
    raise ValueError(
        f'{spelling.name("devices")} must name at least one device; got '
        f'{spelling.value("devices", devices)}. Pass e.g. '
        f'{spelling.setting("devices", ["/gpu:0", "/gpu:1"])}.')
  result = tuple(canonical(d) for d in devices)
  seen = {}
  for given, canon in zip(devices, result):
    if canon in seen:
      raise ValueError(
          f'Each tower needs its own device, but {given!r} and '
          f'{seen[canon]!r} both name {canon}. Remove the duplicate from '
          f'{spelling.setting("devices", devices)}.')
    seen[canon] = given
  return result


def validate_count(num: object, what: str = 'num_cpu_devices') -> int:
  """Checks a positive device count given by the user (num_cpu_devices).

  Raises:
    ValueError: if `num` is not a positive integer.
  """
  if isinstance(num, bool) or not isinstance(num, int) or num < 1:
    raise ValueError(
        f'{spelling.name(what)} must be a positive integer (the number of '
        f'towers), got {spelling.value(what, num)}. Use '
        f'{spelling.setting(what, 2)} for two towers, or '
        f'{spelling.setting("num_gpus", 0)} to train on the CPU alone.')
  return num


def validate_gpu_count(num: object) -> int:
  """Checks a `num_gpus` value: 0 (train on the CPU) or a number of GPU towers.

  Raises:
    ValueError: if `num` is not a non-negative integer.
  """
  if isinstance(num, bool) or not isinstance(num, int) or num < 0:
    raise ValueError(
        f'{spelling.name("num_gpus")} must be 0 (train on the CPU) or a '
        f'positive integer (the number of GPU towers), got '
        f'{spelling.value("num_gpus", num)}. Use e.g. '
        f'{spelling.setting("num_gpus", 2)}, or name the towers with '
        f'{spelling.setting("devices", ["/gpu:0", "/gpu:1"])}.')
  return num


def visible_gpus() -> list[str]:
  """Lists the visible GPUs as '/device:GPU:k' without allocating memory.

  Uses `tf.config.list_physical_devices`, which, unlike
  `device_lib.list_local_devices`, does not create a context on each GPU.
  """
  return [f'/device:GPU:{i}'
          for i, _ in enumerate(tf.config.list_physical_devices('GPU'))]


def visible_devices() -> list[str]:
  """Lists every visible physical device, CPUs first, for error messages."""
  return [d.name for d in tf.config.list_physical_devices()]


def gpu_devices(num_gpus: int) -> tuple[str, ...]:
  """The tower devices for `num_gpus` GPUs: '/device:GPU:0' ... ."""
  return tuple(f'/device:GPU:{i}' for i in range(num_gpus))


def resolve_gpu_count(num_gpus: int, allow_cpu_fallback: bool = False,
                      config_hints: bool = False) -> tuple[str, ...]:
  """The devices the towers of `num_gpus` GPU towers really get on this machine.

  0 means one tower on the host CPU. Asking for more GPUs than are visible is
  an error, unless `allow_cpu_fallback`: then the towers beyond the visible
  GPUs run on the host CPU, and one warning (once per process) says so.
  The error's fixes are arguments of `make_config` (and its flags) with
  `config_hints`, else of `replicate_model_fn` and `make_plan`.

  Raises:
    ValueError: when fewer GPUs are visible than asked for, without fallback.
  """
  if num_gpus == 0:
    return (HOST_CPU,)
  visible = visible_gpus()
  if num_gpus <= len(visible):
    return gpu_devices(num_gpus)
  asked = spelling.setting('num_gpus', num_gpus)
  found = (f'{asked} asks for {num_gpus} GPU{"s" if num_gpus > 1 else ""} but {len(visible)} '
           f'{"is" if len(visible) == 1 else "are"} visible to TensorFlow '
           f'(visible devices: {", ".join(visible_devices())})')
  devices = gpu_devices(len(visible)) + (HOST_CPU,) * (num_gpus - len(visible))
  if allow_cpu_fallback:
    on_cpu = [str(k) for k in range(len(visible), num_gpus)]
    logs.warning_once(
        f'{found}. {spelling.setting("allow_cpu_fallback", True)} is set, so '
        f'tower{"s" if len(on_cpu) > 1 else ""} {", ".join(on_cpu)} '
        f'run{"" if len(on_cpu) > 1 else "s"} on the CPU {HOST_CPU}: '
        f'expect CPU speed.', key=f'cpu_fallback:{num_gpus}:{len(visible)}')
    return devices
  fewer = (f'{spelling.setting("num_gpus", len(visible))} to use the visible '
           f'GPUs only; ' if visible else '')
  if config_hints:  # make_config's arguments, or its flags
    on_cpus = (f'{spelling.setting("num_cpu_devices", num_gpus)} for {num_gpus} towers on '
               f'virtual CPU devices; {spelling.setting("allow_cpu_fallback", True)}')
  else:  # replicate_model_fn's and make_plan's
    on_cpus = (f'devices={_cpu_list(num_gpus)} for {num_gpus} towers '
               f'on virtual CPU devices, with tf.estimator.RunConfig(session_config='
               f'tf.compat.v1.ConfigProto(device_count={{\'CPU\': {num_gpus}}})); '
               f'plan=make_plan(num_gpus={num_gpus}, allow_cpu_fallback=True)')
  raise ValueError(
      f'{found}. Fix one of: {fewer}{spelling.setting("num_gpus", 0)} to train '
      f'on the CPU; {on_cpus} to run the missing '
      f'towers on the CPU {HOST_CPU}. If this machine has GPUs, check the CUDA '
      f'installation (pip install "estimator_towers[gpu]" installs '
      f'tensorflow[and-cuda]) and CUDA_VISIBLE_DEVICES.')


def _cpu_list(n: int) -> str:
  """"['/cpu:0', '/cpu:1']", or "['/cpu:0', ..., '/cpu:7']" for more than three."""
  names = [repr(f'/cpu:{i}') for i in range(n)]
  return f'[{", ".join(names if n <= 3 else [names[0], "...", names[-1]])}]'


def warn_invisible_gpus(devices: Sequence[str]) -> None:
  """Warns (once) when explicit tower devices name local GPUs that are not visible.

  Not an error: a graph may be built for GPUs elsewhere (inspected, exported,
  or run by another machine); TensorFlow's soft placement then moves the ops.
  """
  visible = len(visible_gpus())
  missing = [d for d in devices if device_type(d) == 'GPU'
             and tf.DeviceSpec.from_string(d).job in (None, 'localhost')
             and device_index(d) >= visible]
  if missing:
    logs.warning_once(
        f'Tower devices {", ".join(missing)} name GPUs that are not visible here '
        f'({visible} visible; devices: {", ".join(visible_devices())}). With '
        f'allow_soft_placement TensorFlow runs their ops on other devices (the '
        f'CPU); without it the session fails to start.',
        key=f'invisible_gpus:{",".join(missing)}')


def default_devices() -> tuple[str, ...]:
  """Every visible GPU; the host CPU when there is none."""
  gpus = visible_gpus()
  return tuple(gpus) if gpus else ('/device:CPU:0',)


def device_index(device: str) -> int:
  """The index of a device string ('/device:GPU:3' -> 3; 0 if unset)."""
  spec = tf.DeviceSpec.from_string(device)
  return spec.device_index or 0


def device_type(device: str) -> str:
  """The upper-case type of a device string ('/gpu:3' -> 'GPU')."""
  spec = tf.DeviceSpec.from_string(device)
  return (spec.device_type or 'CPU').upper()


def host_device(device: str) -> str:
  """The host CPU of the worker that owns `device` ('/job:w/gpu:1' -> '/job:w/cpu:0')."""
  spec = tf.DeviceSpec.from_string(device)
  return spec.replace(device_type='CPU', device_index=0).to_string()
