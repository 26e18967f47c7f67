"""What examples/sec and the per-tower summaries cost a towered training step.

Builds one towered training graph (MLP, virtual CPU towers, unstaged input)
and keeps three MonitoredSessions on it open, differing only in their hooks:

  bare       Estimator's own per-step work aside, no reporting hook;
  throughput + ThroughputHook (logs and writes examples_per_sec every
             --log_steps steps; the batch size is static, so nothing is
             fetched per step);
  bare_dynamic, throughput_dynamic
             the same two with a batch size unknown in the graph (the last
             partial batch kept): the hook fetches it with every step. These
             are compared with bare_dynamic, the others with bare;
  summaries  + ThroughputHook + a SummarySaverHook writing every summary of
             the graph (the loss, towers/<k>/loss, towers/<k>/shard_size and a
             global_mean accuracy) at EVERY step: an upper bound, since
             Estimator writes them every save_summary_steps (default 100);
  bare_again the same as bare, in its own session: the control (what two
             identical sessions differ by on this machine).

Chunks of --steps steps alternate between the sessions for --rounds rounds;
it prints per configuration the median time per step and the median (and
quartiles) of the paired change against its baseline in the same round.

  python bench/reporting_bench.py
  python bench/reporting_bench.py --batch_size=32 --hidden=64   # a ~1 ms step
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

import estimator_towers as et
from benchlib import interleaved_seconds_per_step  # pylint: disable=g-import-not-at-top
from benchlib import machine  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer('num_cpu_devices', 2, 'Towers on this many virtual CPU devices.')
flags.DEFINE_integer('batch_size', 256, 'Global batch size.')
flags.DEFINE_integer('num_features', 256, 'Input width.')
flags.DEFINE_integer('hidden', 512, 'Width of the two hidden layers.')
flags.DEFINE_integer('warmup_steps', 30, 'Untimed steps per session at the start.')
flags.DEFINE_integer('steps', 100, 'Timed steps per chunk.')
flags.DEFINE_integer('rounds', 20, 'Rounds (one chunk per configuration each).')
flags.DEFINE_integer('log_steps', 100, 'ThroughputHook cadence (log_step_count_steps).')

FLAGS = flags.FLAGS
NUM_CLASSES = 10
CONFIGS = ('bare', 'throughput', 'bare_dynamic', 'throughput_dynamic', 'summaries',
           'bare_again')


def model_fn(features, labels, mode):
  x = features
  for i in range(2):
    x = tf.compat.v1.layers.dense(
        x, FLAGS.hidden, activation=tf.nn.relu,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
  logits = tf.compat.v1.layers.dense(x, NUM_CLASSES)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  accuracy = tf.reduce_mean(tf.cast(tf.equal(
      tf.argmax(logits, 1, output_type=tf.int32), labels), tf.float32))
  et.global_mean('train_accuracy', accuracy)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def session_config() -> tf.compat.v1.ConfigProto:
  return tf.compat.v1.ConfigProto(device_count={'CPU': FLAGS.num_cpu_devices},
                                  use_per_session_threads=True)


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  logging.set_verbosity(logging.WARNING)  # The hook's own log lines are not the point.
  print(f'# {datetime.date.today()}  {machine()}  TensorFlow {tf.__version__}')
  print(f'# {FLAGS.num_cpu_devices} virtual CPU towers, batch {FLAGS.batch_size}, MLP '
        f'{FLAGS.num_features}-{FLAGS.hidden}-{FLAGS.hidden}-{NUM_CLASSES}; '
        f'{FLAGS.rounds} rounds of {FLAGS.steps} steps per configuration')
  rng = np.random.RandomState(0)
  x = rng.randn(4096, FLAGS.num_features).astype(np.float32)
  y = rng.randint(0, NUM_CLASSES, 4096).astype(np.int32)
  model_dir = tempfile.mkdtemp(prefix='reporting_bench_')
  run_config = tf.estimator.RunConfig(model_dir=model_dir,
                                      log_step_count_steps=FLAGS.log_steps)
  plan = et.make_plan(devices=[f'/cpu:{i}' for i in range(FLAGS.num_cpu_devices)])

  def open_session(name: str):
    """The training graph, built as Estimator builds it, with `name`'s hooks."""
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
          FLAGS.batch_size, drop_remainder=not name.endswith('_dynamic')).prefetch(2)
      features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
      spec = et.replicate_model_fn(model_fn, plan=plan)(
          features, labels, mode=tf.estimator.ModeKeys.TRAIN, config=run_config)
      tf.compat.v1.summary.scalar('loss', spec.loss)
      hooks = []
      if name in ('throughput', 'throughput_dynamic', 'summaries'):
        hooks.append(et.ThroughputHook(run_config))
      if name == 'summaries':
        hooks.append(tf.compat.v1.train.SummarySaverHook(
            save_steps=1, output_dir=os.path.join(model_dir, name),
            summary_op=tf.compat.v1.summary.merge_all()))
      session = tf.compat.v1.train.MonitoredSession(
          tf.compat.v1.train.ChiefSessionCreator(config=session_config()), hooks=hooks)
      return session, spec.train_op

  sessions = {name: open_session(name) for name in CONFIGS}
  seconds = interleaved_seconds_per_step(sessions, CONFIGS, FLAGS.warmup_steps, FLAGS.rounds,
                                         FLAGS.steps)
  times = {name: [1000 * t for t in values] for name, values in seconds.items()}
  print(f'{"configuration":<20} {"ms/step":>8} {"baseline":>13} {"µs/step":>8} '
        f'{"change [quartiles]":>26}')
  for name in CONFIGS:
    baseline = 'bare_dynamic' if name.endswith('_dynamic') else 'bare'
    changes = [100 * (t / b - 1) for t, b in zip(times[name], times[baseline])]
    extra = [1000 * (t - b) for t, b in zip(times[name], times[baseline])]
    q1, _, q3 = statistics.quantiles(changes, n=4) if len(changes) > 1 else (0, 0, 0)
    print(f'{name:<20} {statistics.median(times[name]):8.3f} {baseline:>13} '
          f'{statistics.median(extra):+8.1f} {statistics.median(changes):+9.1f}% '
          f'[{q1:+.1f}, {q3:+.1f}]')


if __name__ == '__main__':
  app.run(main)
