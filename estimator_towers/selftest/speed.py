"""Speed on the user's devices: ResNet-20 steps/sec on 1 and N devices, and MirroredStrategy.

ResNet-20 (`resnet`) trains on CIFAR-10-shaped synthetic data (one fixed
batch of random images, repeated: the input costs nothing) with the same
batch per device everywhere: on one device, towered on the N devices (the
plain input, and `staged_input_fn`'s shards prefetched onto the devices),
and with `tf.distribute.MirroredStrategy` + Estimator on the same N devices.
Each run is a fresh Estimator: `warmup` untimed steps, then `steps` timed
ones. Scaling efficiency is rate_N / (N * rate_1) in examples/sec at the same
per-device batch (1.0: perfect scaling). The MirroredStrategy must be made
before any session runs in the process (`make_mirrored`), or TensorFlow's
device list is fixed at one CPU. On virtual CPU devices the N devices share
the host's cores, so these figures say nothing about GPUs. This check
measures: it is INFO unless a run crashes.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

import numpy as np
import tensorflow as tf

import estimator_towers as et
from estimator_towers.selftest import report
from estimator_towers.selftest import resnet

CPU_NOTE = ('CPU figures say nothing about GPUs: virtual CPU devices share this host\'s '
            'cores, so N of them cannot be faster than one; they only show the runs work.')


def make_mirrored(devices: tuple[str, ...]):
  """The MirroredStrategy over `devices`; call it before any session runs."""
  return tf.distribute.MirroredStrategy(devices=list(devices))


@dataclasses.dataclass
class Timing:
  """What the speed check runs: batch per device, untimed and timed steps."""
  batch_per_device: int
  warmup: int
  steps: int


class StepTimer(tf.compat.v1.train.SessionRunHook):
  """The wall time of the steps after the first `warmup`."""

  def __init__(self, warmup: int):
    self.warmup, self.done, self.start, self.stop = warmup, 0, None, None

  def after_create_session(self, session, coord):
    if not self.warmup:
      self.start = time.perf_counter()

  def after_run(self, run_context, run_values):
    self.done += 1
    if self.done == self.warmup:
      self.start = time.perf_counter()
    self.stop = time.perf_counter()


def input_fn_for(batch: int):
  """One fixed batch of `batch` random CIFAR-shaped images and labels, repeated."""
  rng = np.random.RandomState(0)
  images = rng.randn(batch, 32, 32, 3).astype(np.float32)
  labels = rng.randint(0, resnet.NUM_CLASSES, batch).astype(np.int32)

  def input_fn():
    return tf.data.Dataset.from_tensors((images, labels)).repeat()
  return input_fn


def _steps_per_sec(model_fn, run_config_kwargs: dict, input_fn, timing: Timing,
                   make_run_config) -> float:
  run_config = make_run_config(model_dir=tempfile.mkdtemp(prefix='et_selftest_speed_'),
                               save_summary_steps=None, save_checkpoints_steps=None,
                               save_checkpoints_secs=None, log_step_count_steps=10**6,
                               **run_config_kwargs)
  timer = StepTimer(timing.warmup)
  tf.estimator.Estimator(model_fn, config=run_config).train(
      input_fn, steps=timing.warmup + timing.steps, hooks=[timer])
  return timing.steps / (timer.stop - timer.start)


def runs(device_settings: dict, devices: tuple[str, ...], strategy: str, mirrored,
         timing: Timing) -> list[tuple[str, int, object]]:
  """(label, devices, function timing it) of each run, in the report's order."""
  gpus = all(tf.DeviceSpec.from_string(d).device_type == 'GPU' for d in devices)
  model_fn = resnet.make_model_fn('channels_first' if gpus else 'channels_last')
  n, batch = len(devices), timing.batch_per_device
  one = et.make_config(devices=[devices[0]])
  many = et.make_config(**device_settings, variable_strategy=strategy)

  def towered(config, staged: bool):
    input_fn = input_fn_for(batch * len(config.plan.devices or devices))
    if staged:
      input_fn = et.staged_input_fn(input_fn, config.plan)
    return lambda: _steps_per_sec(
        et.replicate_model_fn(model_fn, plan=config.plan), {}, input_fn, timing,
        lambda **kw: et.make_run_config(config, **kw))

  def mirrored_run():
    if isinstance(mirrored, Exception):
      raise mirrored
    return _steps_per_sec(model_fn, {'train_distribute': mirrored}, input_fn_for(batch), timing,
                          lambda **kw: tf.estimator.RunConfig(
                              session_config=et.session_config(many), **kw))

  found = [(f'towered, 1 device ({devices[0]})', 1, towered(one, False))]
  if n > 1:
    found += [(f'towered, {n} devices ({strategy})', n, towered(many, False)),
              (f'towered, {n} devices ({strategy}), staged', n, towered(many, True)),
              (f'MirroredStrategy + Estimator, {n} devices', n, mirrored_run)]
  return found


def check(device_settings: dict, devices: tuple[str, ...], strategy: str, mirrored,
          timing: Timing) -> report.Result:
  """Steps/sec, examples/sec and scaling efficiency of each run."""
  gpus = all(tf.DeviceSpec.from_string(d).device_type == 'GPU' for d in devices)
  lines = [f'ResNet-20, synthetic CIFAR-10-shaped data, {timing.batch_per_device} examples '
           f'per device, {timing.warmup} untimed + {timing.steps} timed steps per run']
  if not gpus:
    lines.append(f'NOTE  {CPU_NOTE}')
  data, status, rate_1 = {'timing': dataclasses.asdict(timing), 'runs': []}, report.INFO, None
  for label, n, timed in runs(device_settings, devices, strategy, mirrored, timing):
    run = {'label': label, 'devices': n}
    try:
      steps = timed()
      examples = steps * n * timing.batch_per_device
      rate_1 = examples if n == 1 else rate_1
      run.update(steps_per_sec=steps, examples_per_sec=examples)
      line = f'{label:48s} {steps:8.2f} steps/sec {examples:9.1f} examples/sec'
      if n > 1 and rate_1:
        run['scaling_efficiency'] = examples / (n * rate_1)
        line += f'  scaling efficiency {run["scaling_efficiency"]:.2f}'
    except Exception as e:  # pylint: disable=broad-except  (one run's crash: its FAIL)
      run['error'] = f'{type(e).__name__}: {e}'.splitlines()[0][:400]
      line, status = f'{report.FAIL}  {label}: crashed: {run["error"]}', report.FAIL
    lines.append(line)
    data['runs'].append(run)
  return report.Result('speed', status, lines, data)
