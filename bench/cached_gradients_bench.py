"""Micro-batches of an in-batch softmax (cached representation gradients): memory and speed.

A two-tower retrieval model whose activations dominate memory: a query and a
document encoder, each an MLP of --depth ReLU layers --width wide on
--inputs inputs, then a --dim-wide linear output, L2-normalised; the loss is
the in-batch softmax of the [B, B] similarity matrix over a temperature
(every other document of the batch is a negative), plain SGD. Trained by a
real `Estimator.train`, the batch made in the graph by tf.data from fixed
seeds (no batch-sized constant in the graph), at:

  (a) plain at batch B;
  (b) plain at batch B / k;
  (c) `replicate_model_fn(devices=['/cpu:0'], micro_batches=k)` at batch B
      (the first pass gives the head the batch's embeddings; the head's
      gradient seeds each micro-batch's backward pass: `cached_gradients`).

Peak memory, as bench/micro_batches_bench.py measures it: peak RSS of a fresh
subprocess per run (the median of --repeats, interleaved), minus the peak RSS
of a subprocess that only imports TensorFlow and estimator_towers
("above baseline"); and the allocator's peak (the most bytes TensorFlow's CPU
allocator had in use during one of --traced_steps traced steps after the
timed ones).

The input pipeline makes one batch per step (--prefetch turns tf.data's
default prefetch buffer back on: whole batches made ahead of the step and
held between steps, B / (B / k) times larger for (c) than for (b)). What is
alive at each configuration's peak is printed by group (the step's own
tensors, from the traced steps' allocation records: `benchlib.live_at_peak`),
and the ratios again without what (c) holds by design beyond (b): the whole
batch's input beyond one micro-batch's and the gradient sums.

Goals: (c) holds one micro-batch's activations plus what the step needs on
the whole batch: the cut tensors (the batch's embeddings, 2 x B x dim floats,
and their cached gradient), so (c) <= 1.10 x ((b) + cut bytes). The head
itself runs on the whole batch, as in plain at B: its [B, B] similarities
(and their gradient, computed in place by the cross-entropy) are a whole
batch's, so a second ratio counts one [B, B] matrix beyond (b)'s as well.
Speed: (c)'s step time <= 1.5 x (a)'s (each micro-batch's forward pass runs
twice).

  python bench/cached_gradients_bench.py           # B=8192, k=4
  python bench/cached_gradients_bench.py --quick   # B=1024, fewer steps, 1 repeat
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import sys
import tempfile

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_integer('batch_size', 8192, 'The global batch B.')
flags.DEFINE_integer('micro_batches', 4, 'k.')
flags.DEFINE_integer('inputs', 256, 'Inputs of each encoder.')
flags.DEFINE_integer('width', 1024, 'Width of each encoder\'s hidden layers.')
flags.DEFINE_integer('depth', 4, 'Hidden layers per encoder.')
flags.DEFINE_integer('dim', 128, 'Embedding width.')
flags.DEFINE_integer('steps', 8, 'Steps per configuration, warm-up included.')
flags.DEFINE_integer('warmup_steps', 2, 'Untimed first steps.')
flags.DEFINE_integer('traced_steps', 2, 'Untimed traced steps after the timed ones.')
flags.DEFINE_integer('repeats', 3, 'Fresh processes per configuration; the median is reported.')
flags.DEFINE_bool('prefetch', False, 'Keep tf.data\'s default prefetch buffer of whole batches '
                  '(made ahead of the step, outside the step\'s tensors).')
flags.DEFINE_bool('quick', False, 'B=1024, 4 steps, 1 repeat: a smoke run.')
flags.DEFINE_string('config', None, 'Internal: run one configuration in this process.')

TEMPERATURE = 0.05


def model_fn(features, labels, mode):
  """Two MLP encoders, an in-batch softmax over the batch's documents."""
  del labels
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  init = tf.compat.v1.glorot_uniform_initializer

  def encoder(x, name):
    with tf.compat.v1.variable_scope(name):
      for i in range(FLAGS.depth):
        x = tf.compat.v1.layers.dense(x, FLAGS.width, activation=tf.nn.relu,
                                      kernel_initializer=init(seed=i + 1), name=f'hidden_{i}')
      x = tf.compat.v1.layers.dense(x, FLAGS.dim, kernel_initializer=init(seed=99), name='out')
      return tf.math.l2_normalize(x, axis=-1)

  q = encoder(features['query'], 'query')
  d = encoder(features['doc'], 'doc')
  logits = tf.matmul(q, d, transpose_b=True) / TEMPERATURE
  targets = tf.range(tf.shape(q)[0])
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def run_one(name: str, batch: int, devices: list[str] | None, k: int) -> dict:
  """Trains one configuration in this process; returns its numbers."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from estimator_towers import replicate_model_fn  # pylint: disable=g-import-not-at-top

  def input_fn():
    def batch_of_examples(_):
      return {'query': tf.random.stateless_normal([batch, FLAGS.inputs], seed=[1, 2]),
              'doc': tf.random.stateless_normal([batch, FLAGS.inputs], seed=[3, 4])}
    # The batch dimension unknown to the graph, as a dataset's batch without
    # drop_remainder leaves it: the whole batch's head needs it so.
    dataset = tf.data.Dataset.from_tensors(0).repeat().map(batch_of_examples).map(
        lambda f: tf.nest.map_structure(
            lambda t: tf.compat.v1.placeholder_with_default(t, [None, FLAGS.inputs]), f))
    # tf.data's default optimisations add a prefetch buffer after the map, of
    # whole batches made ahead: the input pipeline's, not the step's (see
    # --prefetch).
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = FLAGS.prefetch
    options.autotune.enabled = FLAGS.prefetch
    return dataset.with_options(options)

  import benchlib  # pylint: disable=g-import-not-at-top
  timer = benchlib.MemoryTimer(FLAGS.steps)

  fn = model_fn if devices is None else replicate_model_fn(model_fn, devices=devices,
                                                           micro_batches=k)
  config = tf.estimator.RunConfig(
      save_checkpoints_steps=None, save_checkpoints_secs=None, save_summary_steps=None,
      log_step_count_steps=None,
      session_config=tf.compat.v1.ConfigProto(device_count={'CPU': len(devices or [0])}))
  est = tf.estimator.Estimator(fn, model_dir=tempfile.mkdtemp(prefix='gc_bench_'),
                               config=config)
  est.train(input_fn, steps=FLAGS.steps + FLAGS.traced_steps, hooks=[timer])
  timed = timer.times[FLAGS.warmup_steps - 1:]
  return {'name': name, 'batch': batch,
          'seconds_per_step': (timed[-1] - timed[0]) / (len(timed) - 1),
          'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          'allocator_peak_mb': max(timer.peaks) / 2**20,
          'rss_before_steps_mb': timer.before_steps[0],
          'step_peak_mb': timer.live[0] / 2**20,
          'live_at_peak': sorted(timer.live[1].items(), key=lambda kv: -kv[1])}


def held_by_design() -> tuple[float, float]:
  """MB (c) must hold beyond (b): the whole batch's input beyond one
  micro-batch's, and the gradient sums (one float32 per trained parameter)."""
  b, k, n, w, d = (FLAGS.batch_size, FLAGS.micro_batches, FLAGS.inputs, FLAGS.width,
                   FLAGS.depth)
  inputs = 2 * b * n * 4 * (1 - 1 / k)
  per_encoder = n * w + w + (d - 1) * (w * w + w) + w * FLAGS.dim + FLAGS.dim
  return inputs / 2**20, 2 * per_encoder * 4 / 2**20


def configurations() -> dict:
  b, k = FLAGS.batch_size, FLAGS.micro_batches
  return {
      'a': (f'(a) plain, batch {b}', b, None, 1),
      'b': (f'(b) plain, batch {b // k}', b // k, None, 1),
      'c': (f'(c) 1 device x {k} micro-batches, batch {b}', b, ['/cpu:0'], k),
  }


def _report(runs: dict, base: float) -> None:
  import benchlib  # pylint: disable=g-import-not-at-top
  b, k, dim = FLAGS.batch_size, FLAGS.micro_batches, FLAGS.dim
  mb = 2**20
  cut = 2 * (2 * b * dim * 4) / mb   # the embeddings and their cached gradient
  head = (b * b - (b // k) ** 2) * 4 / mb   # one [B, B] float matrix, beyond (b)'s [B/k, B/k]
  results = {c: benchlib.medians(rs) for c, rs in runs.items() if c != 'baseline'}
  print(f'{"configuration":40s} {"peak RSS":>9s} {"above base":>11s} {"before steps":>13s} '
        f'{"allocator peak":>15s} {"s/step":>8s}   (MB; medians)')
  for c, r in results.items():
    print(f'{r["name"]:40s} {r["peak_rss_mb"]:9.0f} {r["peak_rss_mb"] - base:11.0f} '
          f'{r["rss_before_steps_mb"] - base:13.0f} {r["allocator_peak_mb"]:15.0f} '
          f'{r["seconds_per_step"]:8.3f}')
    print(f'{"":40s} runs, peak RSS above base: '
          + ', '.join(f'{x["peak_rss_mb"] - base:.0f}' for x in runs[c]))
  above = {c: r['peak_rss_mb'] - base for c, r in results.items()}
  tensors = {c: r['allocator_peak_mb'] for c, r in results.items()}
  print(f'cut tensors (2 x B x {dim} embeddings and their gradient): {cut:.0f} MB; '
        f'one [B, B] matrix of the head beyond (b)\'s [B/k, B/k]: {head:.0f} MB')
  print(f'(c) / ((b) + cut): RSS above baseline {above["c"] / (above["b"] + cut):.2f} '
        f'(goal <= 1.10), allocator peak {tensors["c"] / (tensors["b"] + cut):.2f}; '
        f'(c) / ((b) + cut + head): RSS {above["c"] / (above["b"] + cut + head):.2f}, '
        f'allocator {tensors["c"] / (tensors["b"] + cut + head):.2f}; (c) / (a): RSS '
        f'{above["c"] / above["a"]:.2f}, allocator {tensors["c"] / tensors["a"]:.2f}')
  benchlib.print_live_at_peak(results)
  inputs, sums = held_by_design()
  inherent = inputs + sums
  print(f'held by design beyond (b): the whole batch\'s input beyond one micro-batch\'s '
        f'{inputs:.0f} MB (made by tf.data, outside the step\'s tensors), the gradient sums '
        f'{sums:.0f} MB (one float32 per trained parameter); (c) / ((b) + cut) without them: '
        f'RSS {(above["c"] - inherent) / (above["b"] + cut):.2f}, allocator '
        f'{(tensors["c"] - inherent) / (tensors["b"] + cut):.2f} (goal <= 1.10)')
  own = {c: r['step_peak_mb'] for c, r in results.items()}
  print(f'the step\'s own tensors at its peak: (c) / ((b) + cut) {own["c"] / (own["b"] + cut):.2f}; '
        f'without the gradient sums: {(own["c"] - sums) / (own["b"] + cut):.2f} (the input is '
        f'made by tf.data, not among them)')
  step = {c: r['seconds_per_step'] for c, r in results.items()}
  print(f'(c) / (a) step time: {step["c"] / step["a"]:.2f} (goal <= 1.5)')


_FLAGS_PASSED = ('batch_size', 'micro_batches', 'inputs', 'width', 'depth', 'dim', 'steps',
                 'warmup_steps', 'traced_steps', 'prefetch')  # to each configuration's process


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.batch_size, FLAGS.steps, FLAGS.repeats = 1024, 4, 1
  if FLAGS.config is not None:
    import benchlib  # pylint: disable=g-import-not-at-top
    result = benchlib.baseline_rss() if FLAGS.config == 'baseline' else run_one(
        *configurations()[FLAGS.config])
    print(json.dumps(result))
    return
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import benchlib  # pylint: disable=g-import-not-at-top
  print(f'cached_gradients_bench: {datetime.date.today()}, {benchlib.machine()}; '
        f'B={FLAGS.batch_size}, k={FLAGS.micro_batches}, encoders {FLAGS.depth} x {FLAGS.width} '
        f'ReLU on {FLAGS.inputs} inputs -> {FLAGS.dim}, {FLAGS.steps} steps '
        f'({FLAGS.warmup_steps} warm-up)')
  runs = benchlib.interleaved_processes(__file__, ['baseline', 'a', 'b', 'c'], FLAGS.repeats, _FLAGS_PASSED)
  base = statistics.median(r['peak_rss_mb'] for r in runs['baseline'])
  print(f'baseline (import TensorFlow and estimator_towers): peak RSS {base:.0f} MB '
        f'(median of {FLAGS.repeats})')
  _report(runs, base)


if __name__ == '__main__':
  app.run(main)
