"""Exactness on the user's devices: N towers give the one-device update.

The library's promise, checked where it matters: a small convnet with batch
norm, dropout and a ratio loss (the weighted per-example losses' sum over
the sum of the weights), trained for `STEPS` steps from fixed initial values
on the same global batches, once decorated for the first device alone
(`replicate_model_fn(model_fn, devices=[first])`, the reference) and once
towered on all the devices for each variable strategy (and
`sync_batch_norm=True`, so that batch norm uses the global batch's
statistics), and on the fixed shard grid (`shards=N`), where every variable
must be bit-identical to the first device on the same grid. Op determinism is on
(`enable_op_determinism`), so the
difference is the library's, not the kernels'. Every variable must be within
`TOLERANCE` of the reference, relative to max(1, |reference|) (the
project-wide rule); the report gives the largest difference and its
variable. The global batch does not divide by the devices and the shards'
examples are scaled differently, so a mistake in the split, the batch-norm
statistics or the loss shows. With one device there is nothing to
compare: the check is skipped (INFO).

The model is `model_fn` (`network`, `ratio_loss`, `train_spec`), looked up when
the check runs, so that a test can put a faulty one in its place.
"""

from __future__ import annotations

import dataclasses
import tempfile

import numpy as np
import tensorflow as tf

import estimator_towers as et
from estimator_towers.selftest import report

STEPS = 3
TOLERANCE = 1e-5
IMAGE_SIZE, CHANNELS, FILTERS, CLASSES = 8, 3, 8, 3
POSITION_PREFIX = 'input_position/'  # the input's position in the checkpoint: not a variable


def _constant(shape, seed: int, scale: float = 0.3):
  return tf.compat.v1.constant_initializer(
      np.random.RandomState(seed).uniform(-scale, scale, shape).astype(np.float32))


def network(features, mode) -> tf.Tensor:
  """Convolution, batch norm, ReLU, dropout, pooling, dense: the logits."""
  training = mode == tf.estimator.ModeKeys.TRAIN
  x = tf.compat.v1.layers.conv2d(
      features['image'], FILTERS, 3, padding='same',
      kernel_initializer=_constant([3, 3, CHANNELS, FILTERS], 1), name='conv')
  x = tf.compat.v1.layers.batch_normalization(x, momentum=0.8, training=training,
                                              fused=True, name='bn')
  x = tf.compat.v1.layers.dropout(tf.nn.relu(x), rate=0.25, training=training, seed=7)
  return tf.compat.v1.layers.dense(tf.reduce_mean(x, [1, 2]), CLASSES,
                                   kernel_initializer=_constant([FILTERS, CLASSES], 2),
                                   name='logits')


def ratio_loss(per_example: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
  """The weighted per-example losses' sum over the sum of the weights."""
  return tf.reduce_sum(weights * per_example) / tf.reduce_sum(weights)


def train_spec(mode, loss: tf.Tensor) -> tf.estimator.EstimatorSpec:
  """Momentum SGD after the batch norm's moving averages."""
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.2, 0.9)
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def model_fn(features, labels, mode):
  """The check's single-device model_fn: `network`, `ratio_loss`, `train_spec`."""
  per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, network(features, mode))
  return train_spec(mode, ratio_loss(per_example, features['weight']))


def input_fn_for(num_devices: int):
  """STEPS global batches of 8N+3 examples, each example scaled and shifted its own way."""
  batch = 8 * num_devices + 3
  count = batch * STEPS
  rng = np.random.RandomState(0)
  images = rng.randn(count, IMAGE_SIZE, IMAGE_SIZE, CHANNELS).astype(np.float32)
  images = images * np.linspace(0.2, 3.0, count, dtype=np.float32)[:, None, None, None] + (
      np.linspace(-2.0, 2.0, count, dtype=np.float32)[:, None, None, None])
  labels = rng.randint(0, CLASSES, count).astype(np.int32)
  weights = (rng.uniform(0.0, 2.0, count) * (rng.uniform(size=count) > 0.2)).astype(np.float32)

  def input_fn():
    return tf.data.Dataset.from_tensor_slices(
        ({'image': images, 'weight': weights}, labels)).batch(batch)
  return input_fn


def _trained(plan: et.DevicePlan, config: et.TowersConfig, input_fn) -> dict:
  run_config = et.make_run_config(config, model_dir=tempfile.mkdtemp(prefix='et_selftest_'),
                                  save_summary_steps=None, log_step_count_steps=10**6)
  estimator = tf.estimator.Estimator(et.replicate_model_fn(model_fn, plan=plan),
                                     config=run_config)
  estimator.train(input_fn, steps=STEPS)
  return {n: estimator.get_variable_value(n) for n in estimator.get_variable_names()
          if not n.startswith(POSITION_PREFIX)}


@dataclasses.dataclass
class Difference:
  """The largest |towered - reference| / max(1, |reference|) and where."""
  value: float
  variable: str
  missing: list

  def ok(self) -> bool:
    return not self.missing and self.value <= TOLERANCE


def difference(towered: dict, reference: dict) -> Difference:
  missing = sorted(set(reference) ^ set(towered))
  worst, where = 0.0, ''
  for name in sorted(set(reference) & set(towered)):
    ref = np.asarray(reference[name], dtype=np.float64)
    if ref.dtype.kind not in 'fiu':
      continue
    rel = np.abs(np.asarray(towered[name], dtype=np.float64) - ref) / np.maximum(1.0, np.abs(ref))
    value = float(np.nanmax(np.where(np.isnan(rel), np.inf, rel))) if rel.size else 0.0
    if value > worst or not where:
      worst, where = value, name
  return Difference(worst, where, missing)


def _row(label: str, diff: Difference) -> str:
  status = report.PASS if diff.ok() else report.FAIL
  line = f'{status}  {label:28s} max difference {diff.value:.2e} at {diff.variable}'
  if diff.missing:
    line += f'; variables in one run only: {diff.missing[:5]}'
  return line


def variants(devices: tuple[str, ...], strategies: tuple[str, ...]) -> list[tuple[str, dict]]:
  """(label, make_config settings) of each towered run to compare."""
  gpus = all(tf.DeviceSpec.from_string(d).device_type == 'GPU' for d in devices)
  return [(s + (f' ({"NCCL" if gpus else "ring"})' if s == 'collective' else ''),
           {'variable_strategy': s}) for s in strategies]


def check(device_settings: dict, devices: tuple[str, ...],
          strategies: tuple[str, ...]) -> report.Result:
  """Towered against one device, per strategy; FAIL names the worst variable."""
  if len(devices) == 1:
    return report.Result('exactness', report.INFO, [
        f'skipped: one device ({devices[0]}), no towers to compare with it. Run with '
        f'--num_gpus=2 or more (--num_cpu_devices=2 without GPUs).'])
  tf.config.experimental.enable_op_determinism()
  input_fn = input_fn_for(len(devices))
  reference_config = et.make_config(devices=[devices[0]])
  reference = _trained(reference_config.plan, reference_config, input_fn)
  lines = [f'{len(devices)} device(s) against {devices[0]} alone, {STEPS} steps, '
           f'sync_batch_norm, op determinism; pass: every variable within {TOLERANCE:g} '
           f'of the one-device run, relative to max(1, |value|)']
  data, status = {'tolerance': TOLERANCE, 'steps': STEPS, 'runs': []}, report.PASS
  for label, settings in variants(devices, strategies):
    run = {'label': label, **settings}
    try:
      config = et.make_config(**device_settings, sync_batch_norm=True, **settings)
      diff = difference(_trained(config.plan, config, input_fn), reference)
      lines.append(_row(label, diff))
      run.update(status=report.PASS if diff.ok() else report.FAIL,
                 max_difference=diff.value, variable=diff.variable, missing=diff.missing)
    except Exception as e:  # pylint: disable=broad-except  (one strategy's crash: its FAIL)
      error = f'{type(e).__name__}: {e}'.splitlines()[0][:400]
      lines.append(f'{report.FAIL}  {label:28s} crashed: {error}')
      run.update(status=report.FAIL, error=error)
    if run['status'] == report.FAIL:
      status = report.FAIL
    data['runs'].append(run)
  line, run = grid_run(device_settings, devices, input_fn)
  lines.append(line)
  data['runs'].append(run)
  if run['status'] == report.FAIL:
    status = report.FAIL
  return report.Result('exactness', status, lines, data)


def grid_run(device_settings: dict, devices: tuple[str, ...], input_fn) -> tuple[str, dict]:
  """The fixed shard grid (`shards=N`): every variable bit-identical to the first device
  alone on the same grid (on GPUs this needs, and so checks, op determinism)."""
  label = f'fixed grid (shards={len(devices)})'
  run = {'label': label, 'shards': len(devices)}
  try:
    settings = dict(shards=len(devices), sync_batch_norm=True)
    reference_config = et.make_config(devices=[devices[0]], **settings)
    reference = _trained(reference_config.plan, reference_config, input_fn)
    config = et.make_config(**device_settings, **settings)
    towered = _trained(config.plan, config, input_fn)
  except Exception as e:  # pylint: disable=broad-except  (its crash: its FAIL)
    error = f'{type(e).__name__}: {e}'.splitlines()[0][:400]
    run.update(status=report.FAIL, error=error)
    return f'{report.FAIL}  {label:28s} crashed: {error}', run
  differing = sorted(n for n in reference
                     if n not in towered or not np.array_equal(towered[n], reference[n]))
  diff = difference(towered, reference)
  run.update(status=report.FAIL if differing else report.PASS, differing=differing,
             max_difference=diff.value, variable=diff.variable)
  if differing:
    return (f'{report.FAIL}  {label:28s} not bit-identical to one device on the grid: '
            f'{len(differing)} variable(s) differ ({differing[:3]}), max difference '
            f'{diff.value:.2e} at {diff.variable}'), run
  return f'{report.PASS}  {label:28s} bit-identical to one device on the grid', run
