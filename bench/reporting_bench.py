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

import os
import statistics
import tempfile

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

import estimator_towers as et
import benchlib  # pylint: disable=g-import-not-at-top

benchlib.define_mlp_flags(warmup_steps=30, steps=100, rounds=20,
                          warmup_help='Untimed steps per session at the start.')
flags.DEFINE_integer('log_steps', 100, 'ThroughputHook cadence (log_step_count_steps).')

FLAGS = flags.FLAGS
CONFIGS = ('bare', 'throughput', 'bare_dynamic', 'throughput_dynamic', 'summaries',
           'bare_again')


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  logging.set_verbosity(logging.WARNING)  # The hook's own log lines are not the point.
  benchlib.print_header(
      f'{FLAGS.num_cpu_devices} virtual CPU towers, batch {FLAGS.batch_size}, MLP '
      f'{benchlib.mlp_name()}; {FLAGS.rounds} rounds of {FLAGS.steps} steps per configuration')
  data = benchlib.synthetic_data()
  model_dir = tempfile.mkdtemp(prefix='reporting_bench_')
  run_config = tf.estimator.RunConfig(model_dir=model_dir,
                                      log_step_count_steps=FLAGS.log_steps)
  plan = et.make_plan(devices=benchlib.cpu_devices())
  model_fn = benchlib.mlp_model_fn(global_mean_accuracy=True)

  def open_session(name: str):
    """The training graph, built as Estimator builds it, with `name`'s hooks."""
    def hooks(spec):
      tf.compat.v1.summary.scalar('loss', spec.loss)
      hooks = []
      if name in ('throughput', 'throughput_dynamic', 'summaries'):
        hooks.append(et.ThroughputHook(run_config))
      if name == 'summaries':
        hooks.append(tf.compat.v1.train.SummarySaverHook(
            save_steps=1, output_dir=os.path.join(model_dir, name),
            summary_op=tf.compat.v1.summary.merge_all()))
      return hooks
    return benchlib.open_towered_session(
        model_fn, plan, tf.estimator.ModeKeys.TRAIN, data,
        drop_remainder=not name.endswith('_dynamic'), fetch=lambda spec: spec.train_op,
        run_config=run_config, hooks=hooks)

  sessions = {name: open_session(name) for name in CONFIGS}
  seconds = benchlib.interleaved_seconds_per_step(sessions, CONFIGS, FLAGS.warmup_steps,
                                                  FLAGS.rounds, FLAGS.steps)
  times = {name: [1000 * t for t in values] for name, values in seconds.items()}
  print(f'{"configuration":<20} {"ms/step":>8} {"baseline":>13} {"µs/step":>8} '
        f'{"change [quartiles]":>26}')
  for name in CONFIGS:
    baseline = 'bare_dynamic' if name.endswith('_dynamic') else 'bare'
    median, q1, q3 = benchlib.paired_change(times[name], times[baseline])
    extra = [1000 * (t - b) for t, b in zip(times[name], times[baseline])]
    print(f'{name:<20} {statistics.median(times[name]):8.3f} {baseline:>13} '
          f'{statistics.median(extra):+8.1f} {median:+9.1f}% [{q1:+.1f}, {q3:+.1f}]')


if __name__ == '__main__':
  app.run(main)
