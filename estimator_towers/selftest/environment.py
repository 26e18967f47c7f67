"""What the self-test ran on: the software, its GPU builds, and the devices.

Read without running a session, so that it cannot disturb the checks that
follow: the library's version, Python and the OS; TensorFlow's version and
what it was built against (`tf.sysconfig.get_build_info()`: CUDA, cuDNN,
the compute capabilities); NCCL from its pip package (TensorFlow's build
info does not name it); the devices TensorFlow sees, with their names and
compute capabilities (`tf.config.experimental.get_device_details`); each
GPU's memory and the driver from `nvidia-smi` where it exists; the host's
memory; and the towers the other checks use. This check only reports: it is
INFO unless it crashes.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

import tensorflow as tf

import estimator_towers as et
from estimator_towers.selftest import report

NCCL_PACKAGES = ('nvidia-nccl-cu12', 'nvidia-nccl-cu11')
NVIDIA_SMI_QUERY = 'index,name,memory.total,driver_version'


def _nccl() -> str:
  for name in NCCL_PACKAGES:
    try:
      return f'{importlib.metadata.version(name)} (pip {name})'
    except importlib.metadata.PackageNotFoundError:
      continue
  return 'no NCCL pip package (a CPU-only install, or NCCL from the system)'


def _nvidia_smi() -> list[str]:
  """One line per GPU the driver shows, or why there are none."""
  if shutil.which('nvidia-smi') is None:
    return ['nvidia-smi: not on PATH (no NVIDIA driver here)']
  done = subprocess.run(
      ['nvidia-smi', f'--query-gpu={NVIDIA_SMI_QUERY}', '--format=csv,noheader'],
      capture_output=True, text=True, timeout=60, check=False)
  if done.returncode:
    return [f'nvidia-smi failed ({done.returncode}): {done.stderr.strip()[:300]}']
  return [f'nvidia-smi GPU {line.strip()}' for line in done.stdout.splitlines() if line.strip()]


def _host_memory_gb() -> float | None:
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30
  except (ValueError, OSError, AttributeError):
    return None


def _devices() -> list[dict]:
  found = []
  for device in tf.config.list_physical_devices():
    details = tf.config.experimental.get_device_details(device) if device.device_type == 'GPU' else {}
    found.append({'name': device.name, 'type': device.device_type,
                  **{k: str(v) for k, v in details.items()}})
  return found


def _device_line(device: dict) -> str:
  extra = ', '.join(f'{k} {v}' for k, v in device.items() if k not in ('name', 'type'))
  return f'  {device["name"]}' + (f' ({extra})' if extra else '')


def check(towers: tuple[str, ...], towers_note: str) -> report.Result:
  """The environment as report lines and JSON (`towers`: the checks' devices)."""
  build = {k: v for k, v in dict(tf.sysconfig.get_build_info()).items()
           if k in ('is_cuda_build', 'cuda_version', 'cudnn_version', 'cuda_compute_capabilities',
                    'is_rocm_build')}
  devices = _devices()
  memory = _host_memory_gb()
  data = {
      'estimator_towers': et.__version__, 'python': sys.version.split()[0],
      'os': platform.platform(), 'tensorflow': tf.__version__,
      'tensorflow_git': tf.version.GIT_VERSION, 'build': build, 'nccl': _nccl(),
      'devices': devices, 'nvidia_smi': _nvidia_smi(),
      'host_memory_gb': None if memory is None else round(memory, 1),
      'cpu_count': os.cpu_count(), 'towers': list(towers),
  }
  cuda = (f'CUDA {build.get("cuda_version")}, cuDNN {build.get("cudnn_version")}, compute '
          f'capabilities {",".join(build.get("cuda_compute_capabilities", []))}'
          if build.get('is_cuda_build') else 'not a CUDA build')
  lines = [
      f'estimator_towers {et.__version__}, Python {data["python"]}, {data["os"]}',
      f'TensorFlow {tf.__version__} ({tf.version.GIT_VERSION}): {cuda}',
      f'NCCL: {data["nccl"]}',
      f'host: {os.cpu_count()} CPU cores'
      + (f', {memory:.1f} GB memory' if memory is not None else ''),
      'devices TensorFlow sees:', *map(_device_line, devices),
      *data['nvidia_smi'],
      f'towers: {", ".join(towers)} ({towers_note})',
  ]
  return report.Result('environment', report.INFO, lines, data)
