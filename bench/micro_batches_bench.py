"""Micro-batches: peak memory and examples/sec against plain training.

A model whose activations dominate memory (an MLP: 64 inputs, a 4096-wide
hidden layer followed by three elementwise 4096-wide layers, each of which
keeps its [batch, 4096] output for the backward pass, then 10 classes;
plain SGD, so that the weights and optimizer state are a few MB), trained by
a real `Estimator.train` at:

  (a) plain at batch B;
  (b) plain at batch B / k;
  (c) `replicate_model_fn(devices=['/cpu:0'], micro_batches=k)` at batch B;
  (d) `replicate_model_fn(devices=N virtual CPUs, micro_batches=k)` at batch B;
  (e) plain on the first B / k rows of an input of batch B: (e) - (b) is what
      holding (and making) the whole batch's input costs, which (c) must pay.

--model=two_encoders / one_encoder: models with more than one branch, where
the weights are not small beside one micro-batch's activations: a query
encoder and a doc encoder (each 4 x 1024 ReLU dense layers on 256 inputs, a
128-d output), or the query encoder against a given 128-d doc vector; a
per-example loss, the mean of -<q, d>; SGD. At its peak (c) holds, beyond
(b), the whole batch's input and the gradient sums (one float32 per trained
parameter); the bench prints both amounts and the ratios without them.

Peak memory, two ways:

- peak RSS: each configuration runs in a fresh subprocess, which reports its
  peak resident set (`resource.getrusage(RUSAGE_SELF).ru_maxrss`). A baseline
  subprocess that imports TensorFlow and estimator_towers and builds nothing
  gives the interpreter's and TensorFlow's own share, and "above baseline" is
  the peak minus that: everything the training took (graph construction in
  Python, grappler's copies of the graph, the session, weights, input batch,
  activations, and what the C library's allocator keeps after tensors are
  freed); "before steps" is the same, read when the session has been created
  (graph built, before the first step).
- allocator peak: the most bytes TensorFlow's CPU allocator had in use at
  once during a step (the largest `allocator_bytes_in_use` of the steps'
  RunMetadata, FULL_TRACE, on --traced_steps extra untimed steps after the
  timed ones; it varies by some tens of MB from step to step with the order
  in which ops happen to run): the tensors alone, which is what micro-batches
  change.

Speed: examples/sec over the steps after --warmup_steps, timed by a hook
between the end of the last warm-up step and the end of the last step (graph
construction and session creation left out). Input: a random batch made by
tf.data each step from fixed seeds (a static batch dimension), so that no
batch-sized constant sits in the graph; for the encoders, by seeded random
ops in the input_fn itself (no input pipeline, no prefetched batches).

  python bench/micro_batches_bench.py           # B=8192, k=4, N=2
  python bench/micro_batches_bench.py --quick   # B=2048, fewer steps
  python bench/micro_batches_bench.py --model=two_encoders   # or one_encoder
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
flags.DEFINE_integer('num_devices', 2, 'N, virtual CPU devices for (d).')
flags.DEFINE_integer('steps', 8, 'Steps per configuration, warm-up included.')
flags.DEFINE_integer('warmup_steps', 2, 'Untimed first steps.')
flags.DEFINE_integer('traced_steps', 3, 'Untimed traced steps after the timed ones (allocator peak).')
flags.DEFINE_integer('repeats', 3, 'Fresh processes per configuration; the median is reported.')
flags.DEFINE_bool('quick', False, 'B=2048, 5 steps, 1 repeat: a smoke run.')
flags.DEFINE_enum('model', 'mlp', ['mlp', 'two_encoders', 'one_encoder'],
                  'mlp: the MLP above; two_encoders / one_encoder: the branched models above.')
flags.DEFINE_string('config', None, 'Internal: run one configuration in this process.')

WIDTH = 4096
INPUTS = 64
CLASSES = 10
ENCODER_INPUTS = 256
ENCODER_WIDTH = 1024
ENCODER_LAYERS = 4
EMBEDDING = 128


def model_fn(features, labels, mode):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  init = tf.compat.v1.glorot_uniform_initializer
  hidden = tf.compat.v1.layers.dense(features, WIDTH, activation=tf.tanh,
                                     kernel_initializer=init(seed=1))
  for i in range(3):  # elementwise layers: each keeps a [batch, WIDTH] activation
    scale = tf.compat.v1.get_variable(f'scale_{i}', [WIDTH], initializer=tf.ones_initializer())
    shift = tf.compat.v1.get_variable(f'shift_{i}', [WIDTH], initializer=tf.zeros_initializer())
    hidden = tf.tanh(hidden * scale + shift)
  logits = tf.compat.v1.layers.dense(hidden, CLASSES, kernel_initializer=init(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _encoder(x, name: str, seed: int):
  """4 x 1024 ReLU dense layers, then a 128-d linear output."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  init = tf.compat.v1.glorot_uniform_initializer
  with tf.compat.v1.variable_scope(name):
    for i in range(ENCODER_LAYERS):
      x = tf.compat.v1.layers.dense(x, ENCODER_WIDTH, activation=tf.nn.relu,
                                    kernel_initializer=init(seed=seed + i), name=f'dense_{i}')
    return tf.compat.v1.layers.dense(x, EMBEDDING, kernel_initializer=init(seed=seed + 10),
                                     name='out')


def encoders_model_fn(features, labels, mode):
  """Query and doc embeddings (two encoders, or one against a given doc vector);
  a per-example loss: the mean over rows of -<q, d>."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  del labels
  query = _encoder(features['query'], 'query', 1)
  doc = features['doc']
  if FLAGS.model == 'two_encoders':
    doc = _encoder(doc, 'doc', 101)
  loss = tf.reduce_mean(-tf.reduce_sum(query * doc, -1))
  # -<q, d> has no lower bound: a small rate keeps the bench's few steps finite.
  train_op = tf.compat.v1.train.GradientDescentOptimizer(1e-5).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _batch_of_examples(batch: int):
  """The model's batch (features, labels), made in the graph from fixed seeds."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.model == 'mlp':
    x = tf.random.stateless_normal([batch, INPUTS], seed=[1, 2])
    y = tf.random.stateless_uniform([batch], seed=[3, 4], maxval=CLASSES, dtype=tf.int32)
    return x, y
  # Random ops with seeds, not stateless ones: grappler would fold those into
  # constants of the batch's size.
  doc_width = ENCODER_INPUTS if FLAGS.model == 'two_encoders' else EMBEDDING
  return {'query': tf.random.normal([batch, ENCODER_INPUTS], seed=1),
          'doc': tf.random.normal([batch, doc_width], seed=2)}, None


def run_one(name: str, batch: int, devices: list[str] | None, k: int) -> dict:
  """Trains one configuration in this process; returns its numbers."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from estimator_towers import replicate_model_fn  # pylint: disable=g-import-not-at-top

  def input_fn():
    # Made in the graph from fixed seeds, not a numpy constant: a constant of
    # the batch's size would be copied into the GraphDef (and grappler's and
    # the session's copies of it), which would count against larger batches.
    if FLAGS.model != 'mlp':  # no input pipeline at all: no prefetched batches
      return _batch_of_examples(batch)
    return tf.data.Dataset.from_tensors(0).repeat().map(lambda _: _batch_of_examples(batch))

  import benchlib  # pylint: disable=g-import-not-at-top
  timer = benchlib.MemoryTimer(FLAGS.steps)

  plain = model_fn if FLAGS.model == 'mlp' else encoders_model_fn
  rows = batch // k if devices is None else batch  # (e): plain on the first B / k rows
  if devices is None and k > 1:
    whole = plain

    def plain(features, labels, mode):  # pylint: disable=function-redefined
      first = lambda t: None if t is None else t[:rows]
      return whole(tf.nest.map_structure(first, features),
                   tf.nest.map_structure(first, labels), mode)

  fn = plain if devices is None else replicate_model_fn(plain, devices=devices,
                                                           micro_batches=k)
  config = tf.estimator.RunConfig(
      save_checkpoints_steps=None, save_checkpoints_secs=None, save_summary_steps=None,
      log_step_count_steps=None,
      session_config=tf.compat.v1.ConfigProto(device_count={'CPU': len(devices or [0])}))
  est = tf.estimator.Estimator(fn, model_dir=tempfile.mkdtemp(prefix='mb_bench_'),
                               config=config)
  est.train(input_fn, steps=FLAGS.steps + FLAGS.traced_steps, hooks=[timer])
  timed = timer.times[FLAGS.warmup_steps - 1:]
  return {'name': name, 'batch': batch,
          'examples_per_sec': rows * (len(timed) - 1) / (timed[-1] - timed[0]),
          'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          'allocator_peak_mb': max(timer.peaks) / 2**20,
          'rss_before_steps_mb': timer.before_steps[0],
          'step_peak_mb': timer.live[0] / 2**20,
          'live_at_peak': sorted(timer.live[1].items(), key=lambda kv: -kv[1])}


def held_by_design(batch: int, k: int) -> tuple[float, float]:
  """MB that (c) must hold beyond (b): the whole batch's input beyond one
  micro-batch's, and the gradient sums (one float32 per trained parameter)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    features, labels = _batch_of_examples(batch)
    inputs = sum(t.shape.num_elements() * t.dtype.size
                 for t in tf.nest.flatten((features, labels)) if t is not None)
    tf.compat.v1.train.create_global_step()
    (model_fn if FLAGS.model == 'mlp' else encoders_model_fn)(
        features, labels, tf.estimator.ModeKeys.TRAIN)
    sums = sum(v.shape.num_elements() * v.dtype.size
               for v in tf.compat.v1.trainable_variables())
  return inputs * (1 - 1 / k) / 2**20, sums / 2**20


def configurations() -> dict:
  b, k, n = FLAGS.batch_size, FLAGS.micro_batches, FLAGS.num_devices
  return {
      'a': (f'(a) plain, batch {b}', b, None, 1),
      'b': (f'(b) plain, batch {b // k}', b // k, None, 1),
      'c': (f'(c) 1 device x {k} micro-batches, batch {b}', b, ['/cpu:0'], k),
      'd': (f'(d) {n} devices x {k} micro-batches, batch {b}', b,
            [f'/cpu:{i}' for i in range(n)], k),
      'e': (f'(e) plain on {b // k} rows of an input of {b}', b, None, k),
  }


_FLAGS_PASSED = ('batch_size', 'micro_batches', 'num_devices', 'steps', 'warmup_steps',
                 'traced_steps', 'model')  # to each configuration's process


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.batch_size, FLAGS.steps, FLAGS.repeats = 2048, 5, 1
  if FLAGS.config is not None:
    import benchlib  # pylint: disable=g-import-not-at-top
    result = benchlib.baseline_rss() if FLAGS.config == 'baseline' else run_one(
        *configurations()[FLAGS.config])
    print(json.dumps(result))
    return
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import benchlib  # pylint: disable=g-import-not-at-top
  print(f'micro_batches_bench: {datetime.date.today()}, {benchlib.machine()}; '
        f'model {FLAGS.model}, B={FLAGS.batch_size}, k={FLAGS.micro_batches}, N={FLAGS.num_devices}, '
        f'{FLAGS.steps} steps ({FLAGS.warmup_steps} warm-up)')
  runs = benchlib.interleaved_processes(__file__, ['baseline', 'a', 'b', 'c', 'd', 'e'], FLAGS.repeats, _FLAGS_PASSED)
  base = statistics.median(r['peak_rss_mb'] for r in runs['baseline'])
  print(f'baseline (import TensorFlow and estimator_towers): peak RSS {base:.0f} MB '
        f'(median of {FLAGS.repeats})')
  results = {c: benchlib.medians(rs) for c, rs in runs.items() if c != 'baseline'}
  print(f'{"configuration":46s} {"peak RSS":>9s} {"above base":>11s} {"before steps":>13s} '
        f'{"allocator peak":>15s} {"examples/s":>11s}   (MB; medians)')
  for c, r in results.items():
    print(f'{r["name"]:46s} {r["peak_rss_mb"]:9.0f} {r["peak_rss_mb"] - base:11.0f} '
          f'{r["rss_before_steps_mb"] - base:13.0f} {r["allocator_peak_mb"]:15.0f} '
          f'{r["examples_per_sec"]:11.0f}')
    print(f'{"":46s} runs, peak RSS above base: '
          + ', '.join(f'{x["peak_rss_mb"] - base:.0f}' for x in runs[c]))
  above = {c: r['peak_rss_mb'] - base for c, r in results.items()}
  tensors = {c: r['allocator_peak_mb'] for c, r in results.items()}
  speed = {c: r['examples_per_sec'] for c, r in results.items()}
  print(f'(c) / (b) memory: RSS above baseline {above["c"] / above["b"]:.2f} (goal <= 1.10), '
        f'allocator peak {tensors["c"] / tensors["b"]:.2f}; (c) / (a): RSS above baseline '
        f'{above["c"] / above["a"]:.2f}, allocator peak {tensors["c"] / tensors["a"]:.2f}')
  inputs, sums = held_by_design(FLAGS.batch_size, FLAGS.micro_batches)
  excess = above['c'] - above['b']
  print(f'(c) - (b): {excess:.0f} MB RSS above baseline, {tensors["c"] - tensors["b"]:.0f} MB '
        f'allocator peak; held by design: the whole batch\'s input beyond one micro-batch\'s '
        f'{inputs:.0f} MB, the gradient sums {sums:.0f} MB. (c) / (b), RSS above baseline, '
        f'without the input: {(above["c"] - inputs) / above["b"]:.2f}; without the input '
        f'and the sums: {(above["c"] - inputs - sums) / above["b"]:.2f}')
  print(f'the whole batch\'s input, measured: (e) - (b) = {above["e"] - above["b"]:.0f} MB RSS '
        f'above baseline, {tensors["e"] - tensors["b"]:.0f} MB allocator peak; (c) / (e): RSS '
        f'above baseline {above["c"] / above["e"]:.2f}, allocator peak '
        f'{tensors["c"] / tensors["e"]:.2f}')
  benchlib.print_live_at_peak({c: results[c] for c in ('b', 'e', 'c')})
  own = {c: r['step_peak_mb'] for c, r in results.items()}
  print(f'the step\'s own tensors at its peak: (c) / (b) {own["c"] / own["b"]:.2f}; without the '
        f'input beyond one micro-batch\'s and the sums: {(own["c"] - inputs - sums) / own["b"]:.2f}')
  print(f'(c) / (a) examples/sec: {speed["c"] / speed["a"]:.2f} (goal >= 0.9); '
        f'(d) / (a): {speed["d"] / speed["a"]:.2f}')


if __name__ == '__main__':
  app.run(main)
