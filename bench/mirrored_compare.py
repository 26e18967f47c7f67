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

import statistics
import tempfile

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import estimator_towers as et
import benchlib  # pylint: disable=g-import-not-at-top

benchlib.define_mlp_flags(devices_help='Devices (towers / replicas).',
                          batch_help='Global batch size (must divide by the devices).',
                          steps_help='Timed steps per run.',
                          warmup_help='Untimed steps at the start of each timed run.',
                          rounds_help='Interleaved rounds of timed runs.')
flags.DEFINE_integer('check_steps', 10, 'Steps of the equivalence check.')

FLAGS = flags.FLAGS
NUM_EXAMPLES = 4096


def make_input_fn(batch_size: int):
  x, y = benchlib.synthetic_data(NUM_EXAMPLES)

  def input_fn():
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    return dataset.batch(batch_size, drop_remainder=True).prefetch(2)
  return input_fn


def estimator_for(kind: str, strategy) -> tuple[tf.estimator.Estimator, object]:
  model_fn = benchlib.mlp_model_fn()
  common = dict(session_config=benchlib.session_config(allow_soft_placement=True),
                save_checkpoints_steps=10**9, save_summary_steps=10**9,
                log_step_count_steps=10**9)
  model_dir = tempfile.mkdtemp(prefix=f'mirrored_compare_{kind}_')
  if kind == 'plain':
    return (tf.estimator.Estimator(model_fn, model_dir=model_dir,
                                   config=tf.estimator.RunConfig(**common)),
            make_input_fn(FLAGS.batch_size))
  if kind == 'towered':
    return (tf.estimator.Estimator(et.replicate_model_fn(model_fn, devices=benchlib.cpu_devices()),
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
      devices=benchlib.cpu_devices(), cross_device_ops=tf.distribute.ReductionToOneDevice())
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  benchlib.print_header(
      f'{FLAGS.num_cpu_devices} virtual CPU devices, global batch {FLAGS.batch_size}, '
      f'MLP {benchlib.mlp_name()}, momentum SGD')

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
      timer = benchlib.StepTimer(FLAGS.warmup_steps)
      estimator.train(input_fn, steps=FLAGS.warmup_steps + FLAGS.steps, hooks=[timer])
      rates[kind].append(FLAGS.steps * FLAGS.batch_size / (timer.stop - timer.start))
    print(f'round {round_index}: ' + ', '.join(f'{k} {v[-1]:.0f} ex/s' for k, v in rates.items()))
  median, q1, q3 = benchlib.paired_change(rates['mirrored'], rates['towered'])
  print(f'towered  {statistics.median(rates["towered"]):.0f} examples/sec (median)')
  print(f'mirrored {statistics.median(rates["mirrored"]):.0f} examples/sec (median); '
        f'change vs towered {median:+.1f}% [{q1:+.1f}, {q3:+.1f}]')


if __name__ == '__main__':
  app.run(main)
