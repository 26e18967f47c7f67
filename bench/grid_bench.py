"""What the fixed shard grid costs: the MLP with shards=N against the same devices without.

benchlib's MLP (--num_features-->hidden-->hidden-10, momentum SGD) on
--num_cpu_devices virtual CPU devices, global batch --batch_size, twice: without
a grid (one tower per device, gradients summed by the placement's rule) and
with `shards=--shards` (the global batch always cut into that many shards,
every sum across them over the fixed tree, the levels above the devices a
fixed-order reduce-scatter and a gather). Both graphs open in this process,
taking turns in --rounds interleaved chunks of --steps steps.

With more shards than devices (S = k N) each device runs k shards one after
the other, as `micro_batches=k` does: a third configuration, 'micro', runs
those same shards without the grid (micro_batches=k), so that grid / micro is
what the fixed cut and order cost, and micro / plain what k smaller shards a
device cost.

Prints steps/sec of each, the ops' own time per traced step (summed over
devices) of each, grid / plain (and grid / micro) as the median of the rounds'
paired ratios with its quartiles and a 95% bootstrap interval of the median
(the goal: >= 0.95 at the interval's low end), and the bytes sent between
devices in one step of each (`estimator_towers.reporting.traffic`) against
the ring bound for the gradients, 2 (N - 1) M with M the trainable variables'
bytes.

  python bench/grid_bench.py              # 4 devices, B = 256, shards = 4
  python bench/grid_bench.py --shards=8   # two shards per device, against micro_batches=2 too
  python bench/grid_bench.py --variable_strategy=collective   # the reduce-scatter
  python bench/grid_bench.py --quick      # a smoke run
  python bench/grid_bench.py --model=resnet --shards=8   # where compute dominates

With --model=resnet (a ResNet-8 with batch norm, B images of 32x32x3) the
grid and plain configurations synchronise the batch norms (the default);
micro_batches cannot (its micro-batches run one after another), so 'micro'
normalises per micro-batch: a reference for the cost of smaller shards only.
"""

from __future__ import annotations

import os
import statistics
import sys

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # pylint: disable=wrong-import-position
import estimator_towers as et  # pylint: disable=wrong-import-position
from estimator_towers.reporting import traffic  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
benchlib.define_mlp_flags(num_cpu_devices=4, batch_size=256, warmup_steps=5, steps=20, rounds=20)
flags.DEFINE_integer('shards', 4, 'The grid: shards of the global batch.')
flags.DEFINE_string('variable_strategy', 'auto', 'Both configurations\' variable strategy.')
flags.DEFINE_integer('traced_steps', 10, 'Traced steps per configuration (ops\' own time).')
flags.DEFINE_bool('quick', False, 'A smoke run: 1 warm-up step, 3 rounds of 3 steps.')
flags.DEFINE_enum('model', 'mlp', ['mlp', 'resnet'], 'The MLP (per-step overhead dominates) '
                  'or a ResNet-8 with batch norm on 32x32x3 images (compute dominates).')

def _configs() -> dict[str, dict]:
  """Each configuration's replicate_model_fn arguments, by name."""
  configs = {'plain': {}, 'grid': {'shards': FLAGS.shards}}
  per_device, left = divmod(FLAGS.shards, FLAGS.num_cpu_devices)
  if per_device > 1 and not left:  # the ResNet's batch norms: per micro-batch (cost only)
    configs['micro'] = {'micro_batches': per_device,
                        **({'sync_batch_norm': False} if FLAGS.model == 'resnet' else {})}
  return configs


def _session(arguments, devices, data):
  """(session, train_op, trainable bytes) of the MLP on `devices`, with `arguments`."""
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    dataset = tf.data.Dataset.from_tensor_slices(data).repeat().batch(FLAGS.batch_size)
    features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset.prefetch(2)).get_next()
    model_fn = benchlib.mlp_model_fn() if FLAGS.model == 'mlp' else _resnet_model_fn()
    spec = et.replicate_model_fn(model_fn, devices=devices, **arguments,
                                 resume_input=False,
                                 variable_strategy=FLAGS.variable_strategy)(
        features, labels, mode=tf.estimator.ModeKeys.TRAIN)
    size = sum(int(np.prod(v.shape)) * v.dtype.size
               for v in tf.compat.v1.trainable_variables())
    session = tf.compat.v1.train.MonitoredSession(tf.compat.v1.train.ChiefSessionCreator(
        config=benchlib.session_config(own_threads=True)))
    return session, spec.train_op, size


def _resnet_model_fn():
  """benchlib's ResNet-8, momentum SGD, the batch norms' updates with the step."""
  def model_fn(features, labels, mode):
    logits = benchlib.resnet8_logits(features, mode == tf.estimator.ModeKeys.TRAIN)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
      train_op = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(
          loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def _data() -> tuple[np.ndarray, np.ndarray]:
  if FLAGS.model == 'mlp':
    return benchlib.synthetic_data()
  rng = np.random.RandomState(0)
  return (rng.randn(1024, 32, 32, 3).astype(np.float32),
          rng.randint(0, benchlib.NUM_CLASSES, 1024).astype(np.int32))


def _bytes(session, fetch) -> int:
  metadata = tf.compat.v1.RunMetadata()
  session.run(fetch, options=traffic.run_options(), run_metadata=metadata)
  return traffic.total_bytes(traffic.transfers(metadata))


def _ops_ms(session, fetch) -> float:
  """The median over --traced_steps traced steps of the ops' own time, summed over devices
  (less moved by a shared machine's load than the wall time)."""
  totals = []
  for _ in range(FLAGS.traced_steps):
    metadata = tf.compat.v1.RunMetadata()
    session.run(fetch, options=traffic.run_options(), run_metadata=metadata)
    totals.append(sum(node.all_end_rel_micros for device in metadata.step_stats.dev_stats
                      for node in device.node_stats) / 1000)
  return statistics.median(totals)


def _print_ratio(slower: str, faster: str, seconds: dict[str, list[float]]) -> None:
  """`slower` / `faster` in steps/sec: the median of the rounds' paired ratios."""
  ratios = [f / s for s, f in zip(seconds[slower], seconds[faster])]
  q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
  low, high = benchlib.median_interval(ratios) if len(ratios) > 1 else (ratios[0],) * 2
  goal = '; goal >= 0.95: the interval\'s low end' if slower == 'grid' else ''
  print(f'{slower} / {faster} steps/sec: {statistics.median(ratios):.3f} [quartiles {q1:.3f}, '
        f'{q3:.3f}; 95% interval of the median {low:.3f}, {high:.3f}] (the median of the '
        f'rounds\' paired ratios{goal})')


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.warmup_steps, FLAGS.steps, FLAGS.rounds = 1, 3, 3
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  data = _data()
  towers = benchlib.cpu_devices()
  configs = _configs()
  names = tuple(configs)
  sessions, sizes = {}, {}
  for name, arguments in configs.items():
    session, fetch, sizes[name] = _session(arguments, towers, data)
    sessions[name] = (session, fetch)
  n = FLAGS.num_cpu_devices
  benchlib.print_header(
      f'{n} virtual CPU devices, global batch {FLAGS.batch_size}; '
      f'{"MLP " + benchlib.mlp_name() if FLAGS.model == "mlp" else "ResNet-8"}; '
      f'grid: shards={FLAGS.shards}; variable_strategy={FLAGS.variable_strategy}',
      f'steps/sec: median of {FLAGS.rounds} interleaved chunks of {FLAGS.steps} steps after '
      f'{FLAGS.warmup_steps} warm-up steps')
  seconds = benchlib.interleaved_seconds_per_step(sessions, names, FLAGS.warmup_steps,
                                                  FLAGS.rounds, FLAGS.steps)
  for name in names:
    print(f'{name:6s} {1 / statistics.median(seconds[name]):8.2f} steps/sec')
  for slower, faster in (('grid', 'plain'), ('grid', 'micro'), ('micro', 'plain')):
    if slower in seconds and faster in seconds:
      _print_ratio(slower, faster, seconds)
  ops = {name: _ops_ms(*sessions[name]) for name in names}
  print('ops\' own time per step, summed over devices: ' + ', '.join(
      f'{name} {ms:.1f} ms' for name, ms in ops.items()))
  m = sizes['grid']
  for name in names:
    print(f'{name:6s} bytes between devices per step: {_bytes(*sessions[name]):,}')
  print(f'trainable bytes M = {m:,}; ring bound for the gradients 2 (N - 1) M = '
        f'{2 * (n - 1) * m:,}; variables pulled by the towers off /cpu:0 (N - 1) M = '
        f'{(n - 1) * m:,}')
  for session, _ in sessions.values():
    session.close()


if __name__ == '__main__':
  app.run(main)
