"""Device strings: normalisation, validation and discovery.

CPU and GPU device strings are treated alike everywhere in the library: a
tower is "a device string", whatever kind of device it names.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf


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
    raise ValueError('devices must name at least one device; got an empty '
                     'list. Pass e.g. devices=["/gpu:0", "/gpu:1"].')
  result = tuple(canonical(d) for d in devices)
  seen = {}
  for given, canon in zip(devices, result):
    if canon in seen:
      raise ValueError(
          f'Each tower needs its own device, but {given!r} and '
          f'{seen[canon]!r} both name {canon}. Remove the duplicate from '
          f'devices={devices!r}.')
    seen[canon] = given
  return result


def validate_count(num: object, what: str = 'num_gpus') -> int:
  """Checks a device count given by the user.

  Raises:
    ValueError: if `num` is not a positive integer.
  """
  if isinstance(num, bool) or not isinstance(num, int) or num < 1:
    raise ValueError(
        f'{what} must be a positive integer (the number of towers), got '
        f'{num!r}. Use {what}=1 for one device, or pass devices=[...].')
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
