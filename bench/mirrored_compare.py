"""estimator_towers next to tf.distribute.MirroredStrategy + Estimator, on virtual CPUs.

Trains the same MLP model_fn (momentum SGD, a tf.compat.v1.losses loss) with
the same global batch three ways, each in a fresh Estimator:

  plain     one device, the unchanged model_fn;
  towered   @replicate_model_fn on --num_cpu_devices virtual CPU devices
            (input_fn yields the global batch);
  mirrored  RunConfig(train_distribute=MirroredStrategy(those devices)) with
            the unchanged model_fn (input_fn yields global / N per replica,
            as Estimator's distribution support expects).

It prints (1) how far each run's variables are from the plain run's after
--check_steps steps on identical data, and (2) examples/sec over --steps timed
steps after --warmup_steps, for --rounds interleaved rounds (median, and the
median paired change against towered).

The MirroredStrategy is created first thing, before any session runs (later,
TensorFlow's device list is fixed at one CPU).

  python bench/mirrored_compare.py
"""

from __future__ import annotations

import datetime
import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import estimator_towers as et
from benchlib import machine  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer('num_cpu_devices', 2, 'Devices (towers / replicas).')
flags.DEFINE_integer('batch_size', 256, 'Global batch size (must divide by the devices).')
flags.DEFINE_integer('num_features', 256, 'Input width.')
flags.DEFINE_integer('hidden', 512, 'Width of the two hidden layers.')
flags.DEFINE_integer('check_steps', 10, 'Steps of the equivalence check.')
flags.DEFINE_integer('warmup_steps', 20, 'Untimed steps at the start of each timed run.')
flags.DEFINE_integer('steps', 200, 'Timed steps per run.')
flags.DEFINE_integer('rounds', 5, 'Interleaved rounds of timed runs.')

FLAGS = flags.FLAGS
NUM_CLASSES = 10
NUM_EXAMPLES = 4096


def model_fn(features, labels, mode):
  x = features
  for i in range(2):
    x = tf.compat.v1.layers.dense(
        x, FLAGS.hidden, activation=tf.nn.relu,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
  logits = tf.compat.v1.layers.dense(
      x, NUM_CLASSES, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=9))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def make_input_fn(batch_size: int):
  rng = np.random.RandomState(0)
  x = rng.randn(NUM_EXAMPLES, FLAGS.num_features).astype(np.float32)
  y = rng.randint(0, NUM_CLASSES, NUM_EXAMPLES).astype(np.int32)

  def input_fn():
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    return dataset.batch(batch_size, drop_remainder=True).prefetch(2)
  return input_fn


class StepTimer(tf.compat.v1.train.SessionRunHook):
  """Wall time of the steps after the warm-up."""

  def __init__(self, warmup_steps: int):
    self._warmup = warmup_steps
    self._steps = 0
    self.start = self.stop = None

  def after_run(self, run_context, run_values):
    self._steps += 1
    if self._steps == self._warmup:
      self.start = time.perf_counter()
    self.stop = time.perf_counter()


def estimator_for(kind: str, strategy) -> tuple[tf.estimator.Estimator, object]:
  devices = [f'/cpu:{i}' for i in range(FLAGS.num_cpu_devices)]
  session = tf.compat.v1.ConfigProto(
      device_count={'CPU': FLAGS.num_cpu_devices}, allow_soft_placement=True)
  common = dict(session_config=session, save_checkpoints_steps=10**9,
                save_summary_steps=10**9, log_step_count_steps=10**9)
  model_dir = tempfile.mkdtemp(prefix=f'mirrored_compare_{kind}_')
  if kind == 'plain':
    return (tf.estimator.Estimator(model_fn, model_dir=model_dir,
                                   config=tf.estimator.RunConfig(**common)),
            make_input_fn(FLAGS.batch_size))
  if kind == 'towered':
    return (tf.estimator.Estimator(et.replicate_model_fn(model_fn, devices=devices),
                                   model_dir=model_dir, config=tf.estimator.RunConfig(**common)),
            make_input_fn(FLAGS.batch_size))
  return (tf.estimator.Estimator(model_fn, model_dir=model_dir, config=tf.estimator.RunConfig(
      train_distribute=strategy, **common)),
          make_input_fn(FLAGS.batch_size // FLAGS.num_cpu_devices))


def variables(estimator) -> dict[str, np.ndarray]:
  """Every checkpointed variable (slots and global_step included)."""
  return {n: estimator.get_variable_value(n) for n in estimator.get_variable_names()}


def main(argv):
  del argv
  strategy = tf.distribute.MirroredStrategy(
      devices=[f'/cpu:{i}' for i in range(FLAGS.num_cpu_devices)],
      cross_device_ops=tf.distribute.ReductionToOneDevice())
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  print(f'# {datetime.date.today()}  {machine()}  TensorFlow {tf.__version__}')
  print(f'# {FLAGS.num_cpu_devices} virtual CPU devices, global batch {FLAGS.batch_size}, '
        f'MLP {FLAGS.num_features}-{FLAGS.hidden}-{FLAGS.hidden}-{NUM_CLASSES}, momentum SGD')

  trained = {}
  for kind in ('plain', 'towered', 'mirrored'):
    estimator, input_fn = estimator_for(kind, strategy)
    estimator.train(input_fn, steps=FLAGS.check_steps)
    trained[kind] = variables(estimator)
  for kind in ('towered', 'mirrored'):
    same_names = sorted(trained[kind]) == sorted(trained['plain'])
    diff = max(float(np.max(np.abs(trained[kind][n] - trained['plain'][n])))
               for n in trained['plain'])
    print(f'{kind}: after {FLAGS.check_steps} steps, max |variable - plain| = {diff:.2e}; '
          f'checkpoint names {"equal" if same_names else "DIFFER from"} plain')

  rates = {'towered': [], 'mirrored': []}
  for round_index in range(FLAGS.rounds):
    order = ('towered', 'mirrored') if round_index % 2 == 0 else ('mirrored', 'towered')
    for kind in order:
      estimator, input_fn = estimator_for(kind, strategy)
      timer = StepTimer(FLAGS.warmup_steps)
      estimator.train(input_fn, steps=FLAGS.warmup_steps + FLAGS.steps, hooks=[timer])
      rates[kind].append(FLAGS.steps * FLAGS.batch_size / (timer.stop - timer.start))
    print(f'round {round_index}: ' + ', '.join(f'{k} {v[-1]:.0f} ex/s' for k, v in rates.items()))
  changes = [100 * (m / t - 1) for m, t in zip(rates['mirrored'], rates['towered'])]
  q1, _, q3 = statistics.quantiles(changes, n=4) if len(changes) > 1 else (0, 0, 0)
  print(f'towered  {statistics.median(rates["towered"]):.0f} examples/sec (median)')
  print(f'mirrored {statistics.median(rates["mirrored"]):.0f} examples/sec (median); '
        f'change vs towered {statistics.median(changes):+.1f}% [{q1:+.1f}, {q3:+.1f}]')


if __name__ == '__main__':
  app.run(main)
