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
import datetime
import statistics
import tempfile

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

import estimator_towers as et
from estimator_towers import empty_shards
from benchlib import interleaved_seconds_per_step  # pylint: disable=g-import-not-at-top
from benchlib import machine  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer('num_cpu_devices', 3, 'Towers on this many virtual CPU devices.')
flags.DEFINE_integer('batch_size', 64, 'Global batch size.')
flags.DEFINE_integer('num_features', 64, 'Input width.')
flags.DEFINE_integer('hidden', 128, 'Width of the two hidden layers.')
flags.DEFINE_integer('warmup_steps', 30, 'Untimed steps per session at the start.')
flags.DEFINE_integer('steps', 200, 'Timed steps per chunk.')
flags.DEFINE_integer('rounds', 20, 'Rounds (one chunk per configuration each).')

FLAGS = flags.FLAGS
NUM_CLASSES = 10
CONFIGS = ('gated', 'ungated', 'static')


def model_fn(features, labels, mode):
  x = features
  for i in range(2):
    x = tf.compat.v1.layers.dense(
        x, FLAGS.hidden, activation=tf.nn.relu,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
  logits = tf.compat.v1.layers.dense(x, NUM_CLASSES)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  classes = tf.argmax(logits, 1, output_type=tf.int32)
  return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
      'accuracy': tf.compat.v1.metrics.accuracy(labels, classes),
      'mean_logit': tf.compat.v1.metrics.mean(logits)})


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
  print(f'# {datetime.date.today()}  {machine()}  TensorFlow {tf.__version__}')
  print(f'# EVAL, {FLAGS.num_cpu_devices} virtual CPU towers, batch {FLAGS.batch_size}, MLP '
        f'{FLAGS.num_features}-{FLAGS.hidden}-{FLAGS.hidden}-{NUM_CLASSES}; '
        f'{FLAGS.rounds} rounds of {FLAGS.steps} steps per configuration')
  rng = np.random.RandomState(0)
  x = rng.randn(4096, FLAGS.num_features).astype(np.float32)
  y = rng.randint(0, NUM_CLASSES, 4096).astype(np.int32)
  run_config = tf.estimator.RunConfig(model_dir=tempfile.mkdtemp(prefix='eval_bench_'))
  plan = et.make_plan(devices=[f'/cpu:{i}' for i in range(FLAGS.num_cpu_devices)])
  session_config = tf.compat.v1.ConfigProto(device_count={'CPU': FLAGS.num_cpu_devices},
                                            use_per_session_threads=True)

  def open_session(name: str):
    with tf.Graph().as_default():
      tf.compat.v1.train.get_or_create_global_step()
      dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
          FLAGS.batch_size, drop_remainder=name == 'static').prefetch(2)
      features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
      with without_gating() if name == 'ungated' else contextlib.nullcontext():
        spec = et.replicate_model_fn(model_fn, plan=plan)(
            features, labels, mode=tf.estimator.ModeKeys.EVAL, config=run_config)
      step = tf.group(spec.loss, *[update for _, update in spec.eval_metric_ops.values()])
      session = tf.compat.v1.train.MonitoredSession(
          tf.compat.v1.train.ChiefSessionCreator(config=session_config))
      return session, step

  sessions = {name: open_session(name) for name in CONFIGS}
  seconds = interleaved_seconds_per_step(sessions, CONFIGS, FLAGS.warmup_steps, FLAGS.rounds,
                                         FLAGS.steps)
  rates = {name: [1 / t for t in values] for name, values in seconds.items()}
  print(f'{"configuration":<14} {"steps/sec":>10} {"change vs ungated [quartiles]":>32}')
  for name in CONFIGS:
    changes = [100 * (r / b - 1) for r, b in zip(rates[name], rates['ungated'])]
    q1, _, q3 = statistics.quantiles(changes, n=4) if len(changes) > 1 else (0, 0, 0)
    print(f'{name:<14} {statistics.median(rates[name]):10.1f} '
          f'{statistics.median(changes):+13.1f}% [{q1:+.1f}, {q3:+.1f}]')


if __name__ == '__main__':
  app.run(main)
