"""What keyed random draws cost: a dropout-heavy encoder, keyed against per shard.

transformer_bench's encoder (`benchlib.encoder_model_fn`: `tf.einsum`
projections and attention as google-research/bert writes them, features
only), with dropout on the embeddings, the attention probabilities and every
hidden output (rate --dropout, BERT's places), trained with momentum SGD on
--num_cpu_devices virtual CPU devices (towers), global batch --batch_size,
twice: with `random_draws='keyed'` (the default: each
example's masks drawn by its position in the global batch and the global
step, the same on any topology) and with `random_draws='per_shard'` (each
tower draws its own rows from its own stateful stream).

Prints:
- steps/sec of each (the median of --rounds interleaved chunks of --steps
  steps after --warmup_steps, both graphs open in this process, their order
  reversed every other round) and keyed / per shard, the median of the
  rounds' paired ratios with its quartiles (the goal: >= 0.97);
- the random ops per device of each graph (keyed: one stateless op per random
  op per tower, each drawing its own rows only) and all ops per device;
- the ops' own time in a traced step: the random number ops', and the keyed
  draws' other ops' (their keys, counters and rows' offsets: small integer
  ops), with how many of those ran;
- the heavy ops (matrix products, einsums and their gradients) per device;
- the bytes sent between devices in one step of each (the `_Send` / `_Recv`
  pairs of the step's partition graphs, `estimator_towers.reporting.traffic`),
  and what keyed draws add: the tensors that cross devices only in its graph.

  python bench/dropout_bench.py              # 4 devices, B = 64, T = 32, H = 64 (~40 s)
  python bench/dropout_bench.py --quick      # fewer steps (a smoke run)
"""

from __future__ import annotations

import collections
import os
import statistics
import sys

from absl import app
from absl import flags
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # pylint: disable=wrong-import-position
import estimator_towers as et  # pylint: disable=wrong-import-position
from estimator_towers.reporting import traffic  # pylint: disable=wrong-import-position
from estimator_towers.reporting import work_share  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
benchlib.define_mlp_flags(num_cpu_devices=4, batch_size=64, warmup_steps=5, steps=10, rounds=30)
benchlib.define_encoder_flags()
flags.DEFINE_float('dropout', 0.1, 'The rate of every dropout (embeddings, attention '
                   'probabilities, hidden outputs).')
flags.DEFINE_integer('traced_steps', 5, 'Traced steps per configuration (ops\' time).')
flags.DEFINE_bool('quick', False, 'A smoke run: 1 warm-up step, 3 rounds of 3 steps.')

_CONFIGS = ('keyed', 'per_shard')
# The random ops each kind of draw leaves in the graph: keyed, stateless V2 ops; per shard,
# TensorFlow's stateful ones.
_RANDOM_OPS = frozenset(('RandomUniform', 'RandomStandardNormal', 'TruncatedNormal',
                         'RandomUniformInt', 'StatelessRandomUniformV2',
                         'StatelessRandomNormalV2', 'StatelessTruncatedNormalV2',
                         'StatelessRandomUniformIntV2'))


def _session(random_draws, devices, data):
  """(session, train_op, graph) of the encoder on `devices`, drawing as `random_draws` says."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    dataset = tf.data.Dataset.from_tensor_slices(data).repeat().batch(FLAGS.batch_size)
    features = tf.compat.v1.data.make_one_shot_iterator(dataset.prefetch(2)).get_next()
    model_fn = benchlib.encoder_model_fn(FLAGS.width, FLAGS.layers, FLAGS.dropout)
    spec = et.replicate_model_fn(model_fn, devices=devices, random_draws=random_draws)(
        features, None, mode=tf.estimator.ModeKeys.TRAIN)
    session = tf.compat.v1.train.MonitoredSession(tf.compat.v1.train.ChiefSessionCreator(
        config=benchlib.session_config(own_threads=True)))
    return session, spec.train_op, graph


def _cpu_index(device: str) -> int:
  """The virtual CPU an op's device string names (an op without a device: the first)."""
  return tf.DeviceSpec.from_string(device).device_index or 0 if device else 0


def _ops_per_device(graph, types=None) -> list:
  """Ops per virtual CPU device (of `types` only, if given: initializers' not counted)."""
  counts = collections.Counter(_cpu_index(op.device) for op in graph.get_operations()
                               if types is None or (op.type in types
                                                    and '/Initializer/' not in op.name))
  return [counts.get(i, 0) for i in range(FLAGS.num_cpu_devices)]


def _traced_step(session, fetch, types) -> tuple:
  """One traced step: (the tensors sent between devices, the ms of all ops, of the random
  number ops, of the keyed draws' other ops, how many of those ran).

  An op's time is its own (`all_end_rel_micros`), summed over devices (they
  overlap). `types`: op name -> type, of the step's graph.
  """
  metadata = tf.compat.v1.RunMetadata()
  session.run(fetch, options=traffic.run_options(), run_metadata=metadata)
  every = numbers = small = count = 0
  for device in metadata.step_stats.dev_stats:
    for node in device.node_stats:
      micros = node.all_end_rel_micros
      every += micros
      if types.get(node.node_name) in _RANDOM_OPS and '/Initializer/' not in node.node_name:
        numbers += micros
      elif 'keyed_draw' in node.node_name:   # the key, the counter, the rows' offsets
        small += micros
        count += 1
  return traffic.transfers(metadata), every / 1000, numbers / 1000, small / 1000, count


def _quartiles(values):
  if len(values) < 2:
    return values[0], values[0]
  q1, _, q3 = statistics.quantiles(values, n=4)
  return q1, q3


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.warmup_steps, FLAGS.steps, FLAGS.rounds = 1, 3, 3
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  tokens = benchlib.encoder_tokens(1024, FLAGS.seq_length)
  towers = benchlib.cpu_devices()
  sessions, graphs = {}, {}
  for name in _CONFIGS:
    session, fetch, graph = _session(name, towers, tokens)
    sessions[name], graphs[name] = (session, fetch), graph
  benchlib.print_header(
      f'{FLAGS.num_cpu_devices} virtual CPU devices, global batch {FLAGS.batch_size}; encoder: '
      f'{FLAGS.layers} layers, width {FLAGS.width}, {benchlib.ENCODER_HEADS} heads, '
      f'{FLAGS.seq_length} tokens (einsum attention), dropout {FLAGS.dropout} on the '
      f'embeddings, the attention probabilities and every hidden output',
      f'steps/sec: median of {FLAGS.rounds} interleaved chunks of {FLAGS.steps} steps after '
      f'{FLAGS.warmup_steps} warm-up steps')
  seconds = benchlib.interleaved_seconds_per_step(sessions, _CONFIGS, FLAGS.warmup_steps,
                                                  FLAGS.rounds, FLAGS.steps)
  for name in _CONFIGS:
    print(f'{name:10s} {1 / statistics.median(seconds[name]):8.2f} steps/sec')
  ratios = [p / k for k, p in zip(seconds['keyed'], seconds['per_shard'])]
  q1, q3 = _quartiles(ratios)
  print(f'keyed / per_shard steps/sec: {statistics.median(ratios):.3f} '
        f'[quartiles {q1:.3f}, {q3:.3f}] (the median of the rounds\' paired ratios; '
        f'goal >= 0.97)')
  for name in _CONFIGS:
    random_ops = _ops_per_device(graphs[name], _RANDOM_OPS)
    every_op = _ops_per_device(graphs[name])
    heavy = work_share.heavy_ops(graphs[name], towers).values()
    print(f'{name}: random ops per device {random_ops}, heavy ops per device {list(heavy)}, '
          f'all ops per device {every_op}')
  traced = {}
  for name in _CONFIGS:
    types = {op.name: op.type for op in graphs[name].get_operations()}
    traced[name] = [_traced_step(*sessions[name], types) for _ in range(FLAGS.traced_steps)]
  sent = {name: steps[0][0] for name, steps in traced.items()}
  for name in _CONFIGS:
    every, numbers, small, count = (statistics.median(t[i] for t in traced[name])
                                    for i in range(1, 5))
    print(f'{name}: ops\' own time per step {every:.1f} ms (summed over devices): the random '
          f'number ops {numbers:.1f} ms, the keyed draws\' other ops {small:.1f} ms '
          f'({count:.0f} ops); the median of {FLAGS.traced_steps} traced steps')
  for name in _CONFIGS:
    print(f'{name}: bytes between devices in one step {traffic.total_bytes(sent[name]):,} '
          f'({len(sent[name])} tensors)')
  shapes = {name: collections.Counter((t.source, t.destination, t.dtype, t.shape)
                                      for t in sent[name]) for name in _CONFIGS}
  extra = shapes['keyed'] - shapes['per_shard']
  fewer = shapes['per_shard'] - shapes['keyed']
  kinds = collections.Counter(f'{dtype}{list(shape)}' for _, _, dtype, shape in extra.elements())
  print(f'keyed draws send {sum(extra.values())} tensors more '
        f'({", ".join(f"{n} x {kind}" for kind, n in sorted(kinds.items())) or "none"}), '
        f'{sum(fewer.values())} fewer')
  for session, _ in sessions.values():
    session.close()


if __name__ == '__main__':
  app.run(main)
