"""Cost of an exact in-batch softmax on towers (docs/cross_example.md).

A two-tower retrieval model (MLP encoders, embeddings of width D, global
batch B) trained with momentum SGD by Estimator, on N virtual CPU devices:

- `in_batch`: softmax over the batch's documents (`q @ d^T / t`, labels
  `tf.range(B)`): its head is made of rows (`row_wise_head`: each tower its
  own rows against the gathered documents; `--single_head`: the head once on
  the first tower's device, `whole_batch_head`);
- `per_example`: the same towers with a per-example loss (a logistic loss of
  each pair's own score), the loss algebra's scalars-only path.

Prints, per N: steps/sec of each (the median of --repeats alternating runs
of --steps timed steps after --warmup), their ratio towered / plain, the
ratio of those ratios (the goal: >= 0.95), that ratio's ceiling where the
towered head costs exactly what plain's head costs (a step of towered
per_example plus plain's head, in_batch's plain step less per_example's: to
beat the ceiling the towers' head must run faster than plain's own head on
the same cores), the bytes that cross devices
in one step (`estimator_towers.traffic`, the second step's `_Send`/`_Recv`
pairs) and what in_batch adds to per_example's, against the gathered
tensors' size (single head: q and d to the first tower, 2 (N-1)/N * B * D * 4
bytes forward, as much back; row-wise: d all-gathered, each tower receiving
the N-1 other towers' rows, (N-1) * B * D * 4 bytes forward, as much back, and
the per-row values, (N-1)/N * B * 4 each way), and the head's largest tensor
on each device (run once, its shapes at run time).

  python bench/cross_example_bench.py                    # B = 1024, D = 128, N = 2, 4
  python bench/cross_example_bench.py --quick            # B = 256, fewer steps
  python bench/cross_example_bench.py --steps=200 --repeats=5 --intra_op_threads=1 \
      --inter_op_threads=2                               # one thread per op (each device a unit)
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

import benchlib
import estimator_towers as et
from estimator_towers.reporting import traffic

flags.DEFINE_integer('batch', 1024, 'global batch B')
flags.DEFINE_integer('width', 128, 'embedding width D')
flags.DEFINE_list('devices', ['2', '4'], 'tower counts N')
flags.DEFINE_integer('steps', 30, 'timed steps per run')
flags.DEFINE_integer('warmup', 5, 'steps before timing')
flags.DEFINE_integer('repeats', 3, 'alternating runs per configuration')
flags.DEFINE_bool('quick', False, 'B = 256, 10 steps, 1 repeat')
flags.DEFINE_integer('intra_op_threads', 0, 'threads per op (0: TensorFlow\'s default)')
flags.DEFINE_integer('inter_op_threads', 0, 'ops at once (0: TensorFlow\'s default)')
flags.DEFINE_bool('single_head', False, 'the head once on the first tower (not row-wise)')
FLAGS = flags.FLAGS
FEATURES = 64


def _encoder(x, name):
  with tf.compat.v1.variable_scope(name):
    h = tf.compat.v1.layers.dense(x, 256, tf.nn.relu, name='hidden',
                                  kernel_initializer=tf.compat.v1.glorot_uniform_initializer(1))
    return tf.math.l2_normalize(tf.compat.v1.layers.dense(
        h, FLAGS.width, name='out',
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(2)), -1)


def model_fn(features, labels, mode, params):
  q = _encoder(features['query'], 'query')
  d = _encoder(features['doc'], 'doc')
  if params['loss'] == 'in_batch':
    logits = tf.matmul(q, d, transpose_b=True) / 0.05
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        tf.range(tf.shape(q)[0]), logits))
  else:
    scores = tf.reduce_sum(q * d, -1) / 0.05
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(tf.ones_like(scores), scores))
  train_op = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def input_fn():
  rng = np.random.RandomState(0)
  n = FLAGS.batch * 4
  data = {'query': rng.randn(n, FEATURES).astype(np.float32),
          'doc': rng.randn(n, FEATURES).astype(np.float32)}
  return tf.data.Dataset.from_tensor_slices(data).repeat().batch(FLAGS.batch)


def _estimator(loss, num_devices):
  fn = model_fn if num_devices == 1 else et.replicate_model_fn(
      model_fn, devices=[f'/cpu:{i}' for i in range(num_devices)])
  if FLAGS.single_head and num_devices > 1:
    fn = _single_head(fn)
  config = tf.estimator.RunConfig(
      session_config=tf.compat.v1.ConfigProto(
          device_count={'CPU': max(num_devices, 1)},
          intra_op_parallelism_threads=FLAGS.intra_op_threads,
          inter_op_parallelism_threads=FLAGS.inter_op_threads),
      save_checkpoints_steps=None, save_checkpoints_secs=None, save_summary_steps=None,
      log_step_count_steps=100000)
  return tf.estimator.Estimator(fn, model_dir=tempfile.mkdtemp(prefix='xb_'), config=config,
                                params={'loss': loss})


class _Timer(tf.compat.v1.train.SessionRunHook):
  def __init__(self, skip):
    self.skip, self.runs, self.start = skip, 0, None

  def before_run(self, run_context):
    self.runs += 1
    if self.runs == self.skip + 1:
      self.start = time.perf_counter()

  def end(self, session):
    self.seconds = time.perf_counter() - self.start


def steps_per_sec(loss, num_devices):
  timer = _Timer(FLAGS.warmup)
  _estimator(loss, num_devices).train(input_fn, steps=FLAGS.warmup + FLAGS.steps,
                                      hooks=[timer])
  return FLAGS.steps / timer.seconds


def _single_head(model):
  """`model` with the single head: the row-wise split refused (a bench switch)."""
  from estimator_towers.heads import row_wise_head  # pylint: disable=g-import-not-at-top
  def fn(features, labels, mode, params):   # Estimator checks a model_fn's arguments' names
    original = row_wise_head.build
    row_wise_head.build = lambda *a, **k: 'the single head (--single_head)'
    try:
      return model(features, labels, mode, params)
    finally:
      row_wise_head.build = original
  return fn


def largest_head_tensors(num_devices):
  """Per device, the head's largest tensor (elements, shape) in one step of in_batch."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features = tf.compat.v1.data.make_one_shot_iterator(input_fn()).get_next()
    fn = et.replicate_model_fn(model_fn, devices=[f'/cpu:{i}' for i in range(num_devices)])
    if FLAGS.single_head:
      fn = _single_head(fn)
    fn(features, None, tf.estimator.ModeKeys.TRAIN, {'loss': 'in_batch'})
    made = [t for op in graph.get_operations() for t in op.outputs
            if op.name.startswith(('row_wise_head/', 'whole_batch_head/')) and t.dtype.is_floating]
    config = tf.compat.v1.ConfigProto(device_count={'CPU': num_devices})
    with tf.compat.v1.Session(config=config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      values = session.run(made)
  largest = {}
  for t, value in zip(made, values):
    device = t.op.device or 'unplaced'
    if value.size > largest.get(device, (0, None))[0]:
      largest[device] = (value.size, value.shape)
  return largest


def step_bytes(loss, num_devices):
  hook = traffic.TransferHook()
  _estimator(loss, num_devices).train(input_fn, steps=2, hooks=[hook])
  return traffic.total_bytes(hook.transfers)


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.batch, FLAGS.steps, FLAGS.repeats = 256, 10, 1
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  print(f'cross_example_bench {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, '
        f'{benchlib.machine()}, B = {FLAGS.batch}, D = {FLAGS.width}, '
        f'{FLAGS.steps} timed steps x {FLAGS.repeats} alternating runs, threads per op '
        f'{FLAGS.intra_op_threads or "default"}, ops at once {FLAGS.inter_op_threads or "default"}')
  for n in [int(d) for d in FLAGS.devices]:
    rates = {key: [] for key in ('in_batch:1', 'in_batch:n', 'per_example:1', 'per_example:n')}
    for _ in range(FLAGS.repeats):
      for loss in ('in_batch', 'per_example'):
        rates[f'{loss}:1'].append(steps_per_sec(loss, 1))
        rates[f'{loss}:n'].append(steps_per_sec(loss, n))
    med = {k: statistics.median(v) for k, v in rates.items()}
    in_batch, per_example = med['in_batch:n'] / med['in_batch:1'], (
        med['per_example:n'] / med['per_example:1'])
    extra = step_bytes('in_batch', n) - step_bytes('per_example', n)
    shard, width = FLAGS.batch // n, FLAGS.width
    if FLAGS.single_head:
      gathered, what = 2 * 2 * (n - 1) * shard * width * 4, 'q and d of the N-1 other towers'
    else:
      gathered = 2 * n * (n - 1) * shard * width * 4 + 2 * (n - 1) * shard * 4
      what = 'd all-gathered: each tower the N-1 others\' rows; the per-row values'
    largest = ', '.join(f'{device} {shape[0]} x {shape[1]}' if len(shape) == 2 else
                        f'{device} {shape}' for device, (_, shape)
                        in sorted(largest_head_tensors(n).items()))
    print(f'N = {n}: steps/sec in_batch plain {med["in_batch:1"]:.2f} towered '
          f'{med["in_batch:n"]:.2f} ({in_batch:.3f} x), per_example plain '
          f'{med["per_example:1"]:.2f} towered {med["per_example:n"]:.2f} ({per_example:.3f} x); '
          f'in_batch / per_example = {in_batch / per_example:.3f}')
    head = 1 / med['in_batch:1'] - 1 / med['per_example:1']   # plain's head, seconds per step
    ceiling = (1 / med['in_batch:1']) / (1 / med['per_example:n'] + head) / per_example
    print(f'  ceiling with a towered head as fast as plain\'s ({head * 1e3:.2f} ms per step): '
          f'in_batch / per_example = {ceiling:.3f}')
    print(f'  bytes per step: in_batch adds {extra} to per_example\'s; the gathered rows '
          f'and their gradients ({what}, both ways) are {gathered}; '
          f'largest head tensor per device: {largest}')


if __name__ == '__main__':
  app.run(main)
