"""A BERT-like encoder (einsum attention) on towers: data-parallel, like an MLP?

A small Transformer encoder written as google-research/bert writes it
(`tf.einsum` for the projections, the attention scores and the context:
`abc,cde->abde`, `BTNH,BFNH->BNFT`, `BNFT,BTNH->BFNH`, `abcd,cde->abe`),
features only (token ids; the label is a function of them), and the bench
MLP, each trained with momentum SGD on --num_cpu_devices virtual CPU devices
(towers) and on one device (plain), global batch --batch_size.

Prints:
- steps/sec of each configuration (the median of --rounds interleaved chunks
  of --steps steps after --warmup_steps), the towered / plain ratio of the
  encoder and of the MLP, and the encoder's ratio over the MLP's: a model
  that runs on every tower scales as the MLP does (the goal: >= 0.9; an
  encoder run once on the first device on the whole batch scales worse);
- the heavy ops (matrix products, einsums and their gradients) per device of
  the towered encoder's graph, and plain's total;
- each device's peak of live bytes in one traced step (FULL_TRACE
  allocation records, per device): the first device's over the largest of
  the others' (the goal: <= 1.2; a head run once on the whole batch holds
  the whole batch's activations there).

  python bench/transformer_bench.py                 # 4 devices, B = 64, T = 32, H = 64
  python bench/transformer_bench.py --quick         # fewer steps (a smoke run)
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
from estimator_towers.reporting import work_share  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
benchlib.define_mlp_flags(num_cpu_devices=4, batch_size=64, num_features=256, hidden=512,
                          warmup_steps=5, steps=20, rounds=5)
benchlib.define_encoder_flags()
flags.DEFINE_bool('quick', False, 'A smoke run: 1 warm-up step, 3 rounds of 3 steps.')

def _session(model_fn, devices, data):
  """(session, train_op) of `model_fn` on `devices`, features as `data` gives them."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.get_or_create_global_step()
    dataset = tf.data.Dataset.from_tensor_slices(data).repeat().batch(FLAGS.batch_size)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset.prefetch(2)).get_next()
    features, labels = batch if isinstance(batch, tuple) else (batch, None)
    spec = et.replicate_model_fn(model_fn, devices=devices)(
        features, labels, mode=tf.estimator.ModeKeys.TRAIN)
    session = tf.compat.v1.train.MonitoredSession(tf.compat.v1.train.ChiefSessionCreator(
        config=benchlib.session_config(own_threads=True)))
    return session, spec.train_op, graph


def _live_peaks(session, fetch) -> dict:
  """Each device's peak of live bytes in one traced step."""
  metadata = tf.compat.v1.RunMetadata()
  session.run(fetch, options=tf.compat.v1.RunOptions(
      trace_level=tf.compat.v1.RunOptions.FULL_TRACE), run_metadata=metadata)
  peaks = collections.defaultdict(int)
  for stats in metadata.step_stats.dev_stats:
    if 'CPU' not in stats.device.upper() or 'stream' in stats.device:
      continue
    device = stats.device.split('device:')[-1]
    events = sorted((r.alloc_micros, r.alloc_bytes) for n in stats.node_stats
                    for m in n.memory for r in m.allocation_records)
    live = 0
    for _, size in events:
      live += size
      peaks[device] = max(peaks[device], live)
  return dict(peaks)


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.warmup_steps, FLAGS.steps, FLAGS.rounds = 1, 3, 3
  tokens = benchlib.encoder_tokens(1024, FLAGS.seq_length)
  encoder_model_fn = benchlib.encoder_model_fn(FLAGS.width, FLAGS.layers)
  mlp_data = benchlib.synthetic_data(1024)
  towers = benchlib.cpu_devices()
  sessions, graphs = {}, {}
  for name, model_fn, data in (('encoder', encoder_model_fn, tokens),
                               ('mlp', benchlib.mlp_model_fn(), mlp_data)):
    for layout, devices in (('plain', towers[:1]), ('towered', towers)):
      session, fetch, graph = _session(model_fn, devices, data)
      sessions[f'{name} {layout}'] = (session, fetch)
      graphs[f'{name} {layout}'] = graph
  benchlib.print_header(
      f'{FLAGS.num_cpu_devices} virtual CPU devices, global batch {FLAGS.batch_size}; encoder: '
      f'{FLAGS.layers} layers, width {FLAGS.width}, {benchlib.ENCODER_HEADS} heads, '
      f'{FLAGS.seq_length} tokens '
      f'(einsum attention); MLP {benchlib.mlp_name()}',
      f'steps/sec: median of {FLAGS.rounds} interleaved chunks of {FLAGS.steps} steps after '
      f'{FLAGS.warmup_steps} warm-up steps')
  order = list(sessions)
  seconds = benchlib.interleaved_seconds_per_step(sessions, order, FLAGS.warmup_steps,
                                                  FLAGS.rounds, FLAGS.steps)
  rate = {name: 1 / statistics.median(s) for name, s in seconds.items()}
  for name in order:
    print(f'{name:18s} {rate[name]:8.2f} steps/sec')
  ratio = {m: rate[f'{m} towered'] / rate[f'{m} plain'] for m in ('encoder', 'mlp')}
  print(f'towered / plain: encoder {ratio["encoder"]:.2f}, MLP {ratio["mlp"]:.2f}; '
        f'encoder\'s over the MLP\'s: {ratio["encoder"] / ratio["mlp"]:.2f} (goal >= 0.9)')
  counts = work_share.heavy_ops(graphs['encoder towered'], towers)
  plain = sum(work_share.heavy_ops(graphs['encoder plain'], towers[:1]).values())
  print('encoder, heavy ops per device: ' + ', '.join(
      f'{d.split("device:")[-1]} {n}' for d, n in counts.items()) + f' (plain: {plain})')
  peaks = _live_peaks(*sessions['encoder towered'])
  first, others = peaks.get('CPU:0', 0), [v for d, v in peaks.items() if d != 'CPU:0']
  print('encoder, peak live bytes per device in one step (MB): ' + ', '.join(
      f'{d} {v / 2**20:.1f}' for d, v in sorted(peaks.items())) +
        f'; the first over the largest other: {first / max(others or [1]):.2f} (goal <= 1.2)')
  for session, _ in sessions.values():
    session.close()


if __name__ == '__main__':
  app.run(main)
