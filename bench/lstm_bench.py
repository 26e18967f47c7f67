"""A 2-layer LSTM language model on towers: data-parallel through its loops, like an MLP?

A word-level LSTM language model (embeddings, two `LSTMCell` layers with
dropout on their outputs (`DropoutWrapper`: keyed draws inside the loop) in one
`tf.compat.v1.nn.dynamic_rnn` (a While loop), next-token softmax over the
vocabulary), features only (token ids), and the bench MLP, each trained with
momentum SGD on --num_cpu_devices virtual CPU devices (towers) and on one
device (plain), global batch --batch_size.

Prints:
- steps/sec of each configuration (the median of --rounds interleaved chunks
  of --steps steps after --warmup_steps), the towered / plain ratio of the
  LSTM and of the MLP, and the LSTM's ratio over the MLP's (a model whose
  loops run on every tower scales as the MLP does; one run once on the first
  device on the whole batch scales worse);
- the heavy ops per device of the towered LSTM's graph (a While loop counted
  with its body's matrix products: `reporting.work_share`), and plain's total.

  python bench/lstm_bench.py                 # 4 devices, B = 64, T = 32, H = 64
  python bench/lstm_bench.py --quick         # fewer steps (a smoke run)
"""

from __future__ import annotations

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
  """(session, train_op, graph) of `model_fn` on `devices`, features as `data` gives them."""
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


def main(argv):
  del argv
  if FLAGS.quick:
    FLAGS.warmup_steps, FLAGS.steps, FLAGS.rounds = 1, 3, 3
  tokens = benchlib.encoder_tokens(1024, FLAGS.seq_length + 1)
  towers = benchlib.cpu_devices()
  sessions, graphs = {}, {}
  for name, model_fn, data in (('lstm', benchlib.lstm_model_fn(FLAGS.width), tokens),
                               ('mlp', benchlib.mlp_model_fn(), benchlib.synthetic_data(1024))):
    for layout, devices in (('plain', towers[:1]), ('towered', towers)):
      session, fetch, graph = _session(model_fn, devices, data)
      sessions[f'{name} {layout}'] = (session, fetch)
      graphs[f'{name} {layout}'] = graph
  benchlib.print_header(
      f'{FLAGS.num_cpu_devices} virtual CPU devices, global batch {FLAGS.batch_size}; LSTM LM: '
      f'2 layers of {FLAGS.width}, {FLAGS.seq_length} tokens, vocabulary '
      f'{benchlib.ENCODER_VOCAB}; MLP {benchlib.mlp_name()}',
      f'steps/sec: median of {FLAGS.rounds} interleaved chunks of {FLAGS.steps} steps after '
      f'{FLAGS.warmup_steps} warm-up steps')
  order = list(sessions)
  seconds = benchlib.interleaved_seconds_per_step(sessions, order, FLAGS.warmup_steps,
                                                  FLAGS.rounds, FLAGS.steps)
  rate = {name: 1 / statistics.median(s) for name, s in seconds.items()}
  for name in order:
    print(f'{name:18s} {rate[name]:8.2f} steps/sec')
  ratio = {m: rate[f'{m} towered'] / rate[f'{m} plain'] for m in ('lstm', 'mlp')}
  print(f'towered / plain: LSTM {ratio["lstm"]:.2f}, MLP {ratio["mlp"]:.2f}; '
        f'LSTM\'s over the MLP\'s: {ratio["lstm"] / ratio["mlp"]:.2f}')
  counts = work_share.heavy_ops(graphs['lstm towered'], towers)
  plain = sum(work_share.heavy_ops(graphs['lstm plain'], towers[:1]).values())
  print('LSTM, heavy ops per device: ' + ', '.join(
      f'{d.split("device:")[-1]} {n}' for d, n in counts.items()) + f' (plain: {plain})')
  for session, _ in sessions.values():
    session.close()


if __name__ == '__main__':
  app.run(main)
