"""What keeping empty shards out of EVAL costs a towered evaluation step.

With a batch size unknown in the graph, every EVAL tower but the first gets
its shard through a Switch and hands its loss, metric updates and
predictions back through a Merge (estimator_towers/empty_shards.py), so that
a shard that turns out empty runs nothing. This script builds the same
towered EVAL graph (MLP, virtual CPU towers, unstaged input, every batch
full) three times and keeps a MonitoredSession open on each:

  gated     the library as it is (batch size unknown);
  ungated   the same graph built with empty_shards' two functions replaced by
            pass-throughs: the graph before the change;
  static    the batch size known (drop_remainder=True): nothing to gate.

Chunks of --steps evaluation steps (the metric updates and the loss)
alternate between the sessions for --rounds rounds; it prints per
configuration the median steps/sec and the paired change against `ungated`
in the same round (median [quartiles]).

  python bench/eval_bench.py
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

import estimator_towers as et
from estimator_towers.inputs import empty_shards
import benchlib  # pylint: disable=g-import-not-at-top

benchlib.define_mlp_flags(num_cpu_devices=3, batch_size=64, num_features=64, hidden=128,
                          warmup_steps=30, steps=200, rounds=20,
                          warmup_help='Untimed steps per session at the start.')

FLAGS = flags.FLAGS
CONFIGS = ('gated', 'ungated', 'static')


@contextlib.contextmanager
def without_gating():
  """Builds graphs as before the change: shards and specs pass through."""
  saved = empty_shards.gate_inputs, empty_shards.gate_spec
  empty_shards.gate_inputs = lambda shard, nonempty: shard
  empty_shards.gate_spec = lambda spec, first, nonempty: spec
  try:
    yield
  finally:
    empty_shards.gate_inputs, empty_shards.gate_spec = saved


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  logging.set_verbosity(logging.WARNING)
  benchlib.print_header(
      f'EVAL, {FLAGS.num_cpu_devices} virtual CPU towers, batch {FLAGS.batch_size}, MLP '
      f'{benchlib.mlp_name()}; {FLAGS.rounds} rounds of {FLAGS.steps} steps per configuration')
  data = benchlib.synthetic_data()
  run_config = tf.estimator.RunConfig(model_dir=tempfile.mkdtemp(prefix='eval_bench_'))
  plan = et.make_plan(devices=benchlib.cpu_devices())
  model_fn = benchlib.mlp_model_fn()

  def step(spec):  # the loss and the metric updates
    return tf.group(spec.loss, *[update for _, update in spec.eval_metric_ops.values()])

  sessions = {name: benchlib.open_towered_session(
      model_fn, plan, tf.estimator.ModeKeys.EVAL, data, drop_remainder=name == 'static',
      fetch=step, run_config=run_config,
      gating=without_gating() if name == 'ungated' else None) for name in CONFIGS}
  seconds = benchlib.interleaved_seconds_per_step(sessions, CONFIGS, FLAGS.warmup_steps,
                                                  FLAGS.rounds, FLAGS.steps)
  rates = {name: [1 / t for t in values] for name, values in seconds.items()}
  print(f'{"configuration":<14} {"steps/sec":>10} {"change vs ungated [quartiles]":>32}')
  for name in CONFIGS:
    median, q1, q3 = benchlib.paired_change(rates[name], rates['ungated'])
    print(f'{name:<14} {statistics.median(rates[name]):10.1f} '
          f'{median:+13.1f}% [{q1:+.1f}, {q3:+.1f}]')


if __name__ == '__main__':
  app.run(main)
