"""Throughput of towered training with and without input staging, on virtual CPUs.

Trains the same towered MLP on the same synthetic data unstaged (staging_depth
0: the towered model_fn splits each host batch itself) and staged with each
backend:depth of --configs (staged_input_fn with a StagingArea per device), in
interleaved rounds. It prints, per round and configuration, the wall-clock
examples/second and the process CPU time per step (all threads), then per
configuration the medians and the median (and quartiles) over rounds of the
change from the unstaged run of the same round: paired, so that load from
other processes that drifts between rounds cancels.

--mode=estimator (default) trains a fresh Estimator per run (graph building,
session creation, warm-up steps and the final checkpoint are not timed).
--mode=interleaved builds each configuration's training graph once, as
Estimator does, keeps its session open and alternates chunks of --steps steps
between the configurations in one process: much less run-to-run noise.

  python bench/staging_bench.py                       # 2 virtual CPUs
  python bench/staging_bench.py --num_cpu_devices=4 --rounds=7 \\
      --configs=staging_area:1,staging_area:3
  python bench/staging_bench.py --mode=interleaved --rounds=60 --steps=100
"""

from __future__ import annotations

import statistics
import tempfile
import time

from absl import app
from absl import flags
import tensorflow as tf

import estimator_towers as et
import benchlib  # pylint: disable=g-import-not-at-top

flags.DEFINE_enum('mode', 'estimator', ['estimator', 'interleaved'],
                  'estimator: a fresh Estimator per run; interleaved: one open '
                  'session per configuration, alternating chunks of steps.')
benchlib.define_mlp_flags(steps_help='Timed steps per run (per chunk when interleaved).',
                          rounds_help='Interleaved rounds (one run per depth each).')
flags.DEFINE_integer('num_examples', 8192, 'Synthetic examples (repeated).')
flags.DEFINE_list('configs', ['staging_area:1', 'staging_area:2'],
                  'backend:staging_depth pairs to compare with the unstaged run.')
flags.DEFINE_integer('inter_op_threads', 0, 'Session inter-op threads (0: TF default).')
flags.DEFINE_integer('intra_op_threads', 0, 'Session intra-op threads (0: TF default).')

FLAGS = flags.FLAGS
model_fn = benchlib.mlp_model_fn()


def input_fn():
  x, y = benchlib.synthetic_data(FLAGS.num_examples)
  dataset = tf.data.Dataset.from_tensor_slices(({'x': x}, y)).repeat()
  return dataset.batch(FLAGS.batch_size).prefetch(2)


UNSTAGED = 'unstaged'


def plan_and_backend(config: str) -> tuple[et.DevicePlan, str]:
  backend, depth = ('staging_area', 0) if config == UNSTAGED else config.split(':')
  plan = et.make_plan(devices=benchlib.cpu_devices(), staging_depth=int(depth))
  return plan, backend


def session_config(own_threads: bool = False) -> tf.compat.v1.ConfigProto:
  return benchlib.session_config(own_threads,
                                 inter_op_parallelism_threads=FLAGS.inter_op_threads,
                                 intra_op_parallelism_threads=FLAGS.intra_op_threads)


def run_once(config: str) -> tuple[float, float]:
  """Examples/second and CPU milliseconds/step of a fresh training run."""
  plan, backend = plan_and_backend(config)
  run_config = tf.estimator.RunConfig(
      session_config=session_config(), save_checkpoints_steps=10**9,
      save_summary_steps=10**9, log_step_count_steps=10**9)
  estimator = tf.estimator.Estimator(
      et.replicate_model_fn(model_fn, plan=plan), config=run_config,
      model_dir=tempfile.mkdtemp(prefix='staging_bench_'))
  timer = benchlib.StepTimer(FLAGS.warmup_steps)
  estimator.train(et.staged_input_fn(input_fn, plan, backend),
                  steps=FLAGS.warmup_steps + FLAGS.steps, hooks=[timer])
  return (FLAGS.steps * FLAGS.batch_size / (timer.stop - timer.start),
          1000 * (timer.cpu_stop - timer.cpu_start) / FLAGS.steps)


class _Initializer(tf.compat.v1.train.SessionRunHook):
  """Initializes a dataset iterator, as Estimator's own input hook does."""

  def __init__(self, initializer):
    self._initializer = initializer

  def after_create_session(self, session, coord):
    session.run(self._initializer)


class OpenSession:
  """One configuration's training graph, built as Estimator builds it, kept open."""

  def __init__(self, config: str):
    plan, backend = plan_and_backend(config)
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      hooks = []
      with tf.device('/cpu:0'):  # Where Estimator calls input_fns.
        inputs = et.staged_input_fn(input_fn, plan, backend)()
      if isinstance(inputs, tf.data.Dataset):  # Staging off: Estimator's own iterator.
        iterator = tf.compat.v1.data.make_initializable_iterator(inputs)
        hooks.append(_Initializer(iterator.initializer))
        inputs = iterator.get_next()
      features, labels = inputs
      spec = et.replicate_model_fn(model_fn, plan=plan)(
          features, labels, mode=tf.estimator.ModeKeys.TRAIN)
      self._train_op = spec.train_op
      self._session = tf.compat.v1.train.MonitoredSession(
          tf.compat.v1.train.ChiefSessionCreator(config=session_config(own_threads=True)),
          hooks=hooks + list(spec.training_hooks))
    self.run(FLAGS.warmup_steps)

  def run(self, steps: int) -> tuple[float, float]:
    """Examples/second and CPU milliseconds/step of `steps` more steps."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
      self._session.run(self._train_op)
    return (steps * FLAGS.batch_size / (time.perf_counter() - start),
            1000 * (time.process_time() - cpu_start) / steps)


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  configs = [UNSTAGED] + FLAGS.configs
  benchlib.print_header(
      f'columns: {", ".join(configs)}',
      f'{FLAGS.num_cpu_devices} virtual CPU towers, batch {FLAGS.batch_size}, '
      f'MLP {benchlib.mlp_name()}, {FLAGS.steps} timed steps after {FLAGS.warmup_steps}, '
      f'{FLAGS.rounds} rounds, mode {FLAGS.mode}')
  if FLAGS.mode == 'interleaved':
    sessions = {c: OpenSession(c) for c in configs}
    run = lambda config: sessions[config].run(FLAGS.steps)
  else:
    run = run_once
  speed = {c: [] for c in configs}
  cpu = {c: [] for c in configs}
  for r in range(FLAGS.rounds):
    order = configs if r % 2 == 0 else configs[::-1]  # Interleave against drift.
    for config in order:
      examples_per_second, cpu_ms = run(config)
      speed[config].append(examples_per_second)
      cpu[config].append(cpu_ms)
    print(f'round {r:2d}: ' + '  '.join(f'{speed[c][-1]:6.0f}' for c in configs)
          + '  ex/s;  ' + '  '.join(f'{cpu[c][-1]:5.2f}' for c in configs)
          + '  cpu-ms/step', flush=True)

  def paired(values, config):
    """Median and quartiles, over rounds, of the % change from unstaged."""
    median, q1, q3 = benchlib.paired_change(values[config], values[UNSTAGED])
    return f'{median:+6.1f}% [{q1:+6.1f}, {q3:+6.1f}]'

  print(f'\n{"configuration":24s} {"ex/s":>7s}  {"change [quartiles]":>24s}'
        f'  {"cpu-ms/step":>11s}  {"change [quartiles]":>24s}')
  for config in configs:
    print(f'{config:24s} {statistics.median(speed[config]):7.0f}  '
          f'{paired(speed, config):>24s}  {statistics.median(cpu[config]):11.2f}  '
          f'{paired(cpu, config):>24s}')
  print('(medians over rounds; change: vs the unstaged run of the same round)')


if __name__ == '__main__':
  app.run(main)
