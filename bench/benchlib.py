"""What the bench scripts share: the MLP they time, its flags, a BERT-style
encoder, the machine they ran on, interleaved timing and paired-change reporting, and fresh processes
per configuration for peak memory.

A script that times the MLP calls `define_mlp_flags(...)` with its own
defaults at import, builds `mlp_model_fn(...)` and `synthetic_data(...)`, and
reports with `print_header` and `paired_change`. What a script measures (its
configurations, its graph variants) stays in the script.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from absl import flags
import numpy as np
import tensorflow as tf

import estimator_towers as et

FLAGS = flags.FLAGS
NUM_CLASSES = 10

# Flags define_mlp_flags() defines belong to the script that calls it: its
# --help lists them.
flags.disclaim_key_flags()


@contextlib.contextmanager
def collections_timed():
  """Yields [seconds]: the garbage collector's passes meanwhile (wall time), when the block ends."""
  total, started = [0.0], [0.0]

  def callback(phase, unused_info):
    if phase == 'start':
      started[0] = time.perf_counter()
    else:
      total[0] += time.perf_counter() - started[0]

  gc.callbacks.append(callback)
  try:
    yield total
  finally:
    gc.callbacks.remove(callback)


def machine() -> str:
  """The CPU model (from lscpu where there is one) and the core count."""
  try:
    lscpu = subprocess.run(['lscpu'], capture_output=True, text=True, check=False).stdout
    model = next((l.split(':', 1)[1].strip() for l in lscpu.splitlines()
                  if l.startswith('Model name')), platform.processor())
  except OSError:
    model = platform.processor()
  return f'{model}, {os.cpu_count()} cores'


def define_mlp_flags(*, num_cpu_devices: int = 2, batch_size: int = 256,
                     num_features: int = 256, hidden: int = 512, warmup_steps: int = 20,
                     steps: int = 200, rounds: int = 5,
                     devices_help: str = 'Towers on this many virtual CPU devices.',
                     batch_help: str = 'Global batch size.',
                     steps_help: str = 'Timed steps per chunk.',
                     warmup_help: str = 'Untimed steps at the start of each run.',
                     rounds_help: str = 'Rounds (one chunk per configuration each).') -> None:
  """The flags of an MLP bench (devices, batch, model size, timing), with its defaults."""
  flags.DEFINE_integer('num_cpu_devices', num_cpu_devices, devices_help)
  flags.DEFINE_integer('batch_size', batch_size, batch_help)
  flags.DEFINE_integer('num_features', num_features, 'Input width.')
  flags.DEFINE_integer('hidden', hidden, 'Width of the two hidden layers.')
  flags.DEFINE_integer('warmup_steps', warmup_steps, warmup_help)
  flags.DEFINE_integer('steps', steps, steps_help)
  flags.DEFINE_integer('rounds', rounds, rounds_help)


def define_encoder_flags(seq_length: int = 32, width: int = 64, layers: int = 2) -> None:
  """The flags of `encoder_model_fn`'s size: --seq_length, --width, --layers."""
  flags.DEFINE_integer('seq_length', seq_length, 'Tokens per example.')
  flags.DEFINE_integer('width', width, 'The encoder\'s hidden width (heads x head size).')
  flags.DEFINE_integer('layers', layers, 'Encoder layers.')


def mlp_name() -> str:
  """The MLP's shape as the headers print it: 256-512-512-10."""
  return f'{FLAGS.num_features}-{FLAGS.hidden}-{FLAGS.hidden}-{NUM_CLASSES}'


def mlp_model_fn(global_mean_accuracy: bool = False) -> Callable:
  """A single-device model_fn: two ReLU layers of --hidden, seeded initial weights.

  TRAIN: momentum SGD on a tf.compat.v1.losses cross-entropy. EVAL: the loss,
  accuracy and the mean logit. Features are a tensor or {'x': tensor}.
  global_mean_accuracy: also report the batch accuracy with et.global_mean.
  """
  def model_fn(features, labels, mode):
    x = features['x'] if isinstance(features, dict) else features
    for i in range(2):
      x = tf.compat.v1.layers.dense(
          x, FLAGS.hidden, activation=tf.nn.relu,
          kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
    logits = tf.compat.v1.layers.dense(
        x, NUM_CLASSES, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=9))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    classes = tf.argmax(logits, 1, output_type=tf.int32)
    if mode == tf.estimator.ModeKeys.EVAL:
      return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
          'accuracy': tf.compat.v1.metrics.accuracy(labels, classes),
          'mean_logit': tf.compat.v1.metrics.mean(logits)})
    if global_mean_accuracy:
      et.global_mean('train_accuracy',
                     tf.reduce_mean(tf.cast(tf.equal(classes, labels), tf.float32)))
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def _conv(x, filters, strides, name):
  return tf.compat.v1.layers.conv2d(
      x, filters, 3, strides=strides, padding='same', use_bias=False, name=name,
      kernel_initializer=tf.compat.v1.variance_scaling_initializer(seed=1))


def _bn(x, training, name):
  return tf.compat.v1.layers.batch_normalization(x, training=training, name=name,
                                                 momentum=0.9)


def resnet8_logits(x, training):
  """ResNet-8: one basic block per stage, 8/16/32 filters, batch norm."""
  x = _conv(x, 8, 1, 'conv0')
  x = tf.nn.relu(_bn(x, training, 'bn0'))
  for stage, filters in enumerate((8, 16, 32)):
    strides = 1 if stage == 0 else 2
    with tf.compat.v1.variable_scope(f'stage{stage}'):
      shortcut = x
      if strides != 1:
        shortcut = tf.compat.v1.layers.conv2d(x, filters, 1, strides=strides, use_bias=False,
                                              name='project')
      y = tf.nn.relu(_bn(_conv(x, filters, strides, 'conv_a'), training, 'bn_a'))
      y = _bn(_conv(y, filters, 1, 'conv_b'), training, 'bn_b')
      x = tf.nn.relu(y + shortcut)
  x = tf.reduce_mean(x, axis=[1, 2])
  return tf.compat.v1.layers.dense(x, NUM_CLASSES, name='logits')


ENCODER_HEADS, ENCODER_VOCAB = 4, 1000


def _glorot(seed: int):
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _layer_norm(x):
  mean, variance = tf.nn.moments(x, [-1], keepdims=True)
  return (x - mean) * tf.math.rsqrt(variance + 1e-6)


def _encoder_layer(x, i: int, width: int, dropout: Callable):
  """One encoder layer, as google-research/bert writes it (`tf.einsum` everywhere)."""
  heads, size = ENCODER_HEADS, width // ENCODER_HEADS
  with tf.compat.v1.variable_scope(f'layer_{i}'):
    q, k, v = (tf.einsum('abc,cde->abde', x, tf.compat.v1.get_variable(
        name, [x.shape[-1], heads, size], initializer=_glorot(3)))
               for name in ('query', 'key', 'value'))
    scores = tf.einsum('BTNH,BFNH->BNFT', k, q) / float(np.sqrt(size))
    context = tf.einsum('BNFT,BTNH->BFNH', dropout(tf.nn.softmax(scores)), v)
    w = tf.compat.v1.get_variable('output', [heads, size, width], initializer=_glorot(4))
    x = _layer_norm(x + dropout(tf.einsum('BFNH,NHD->BFD', context, w)))
    w1 = tf.compat.v1.get_variable('intermediate', [width, 4 * width], initializer=_glorot(5))
    w2 = tf.compat.v1.get_variable('ffn_output', [4 * width, width], initializer=_glorot(6))
    hidden = tf.einsum('abc,cd->abd', tf.nn.gelu(tf.einsum('abc,cd->abd', x, w1)), w2)
    return _layer_norm(x + dropout(hidden))


def encoder_model_fn(width: int, layers: int, dropout: float = 0.0) -> Callable:
  """A BERT-style encoder's single-device model_fn: einsum attention, features only.

  Features are {'ids': [batch, tokens] ids < ENCODER_VOCAB}; the label of an
  example is its first token's parity; momentum SGD. `dropout` > 0: dropout
  of that rate on the embeddings, the attention probabilities and every
  hidden output (BERT's places); 0: none (no random op).
  """
  def drop(x):
    return tf.nn.dropout(x, rate=dropout) if dropout else x

  def model_fn(features, labels, mode):
    del labels
    ids = features['ids']
    table = tf.compat.v1.get_variable('embeddings', [ENCODER_VOCAB, width],
                                      initializer=_glorot(1))
    x = drop(tf.gather(table, ids))
    for i in range(layers):
      x = _encoder_layer(x, i, width, drop)
    logits = tf.compat.v1.layers.dense(tf.reduce_mean(x, 1), 2, kernel_initializer=_glorot(7))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(ids[:, 0] % 2, logits)
    train_op = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def lstm_model_fn(width: int) -> Callable:
  """A 2-layer LSTM language model of `width` units with dropout: predicts each next token.

  Features only ({'ids': [batch, tokens]}, `encoder_tokens`); two `LSTMCell`s
  with dropout on their outputs (`DropoutWrapper`: draws inside the loop) in one
  `tf.compat.v1.nn.dynamic_rnn` (a While loop); momentum SGD.
  """
  def model_fn(features, labels, mode):
    del labels
    ids = features['ids']
    with tf.compat.v1.variable_scope('lm', initializer=_glorot(1)):
      embeddings = tf.compat.v1.get_variable('embeddings', [ENCODER_VOCAB, width])
      cells = tf.compat.v1.nn.rnn_cell.MultiRNNCell([
          tf.compat.v1.nn.rnn_cell.DropoutWrapper(
              tf.compat.v1.nn.rnn_cell.LSTMCell(width), output_keep_prob=0.9)
          for _ in range(2)])
      outputs, _ = tf.compat.v1.nn.dynamic_rnn(
          cells, tf.nn.embedding_lookup(embeddings, ids[:, :-1]), dtype=tf.float32)
      logits = tf.compat.v1.layers.dense(outputs, ENCODER_VOCAB)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(ids[:, 1:], logits)
    train_op = tf.compat.v1.train.MomentumOptimizer(0.01, 0.9).minimize(
        loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def encoder_tokens(num_examples: int, seq_length: int) -> dict:
  """Fixed random token ids for `encoder_model_fn`."""
  rng = np.random.RandomState(0)
  return {'ids': rng.randint(1, ENCODER_VOCAB, [num_examples, seq_length]).astype(np.int32)}


def synthetic_data(num_examples: int = 4096) -> tuple[np.ndarray, np.ndarray]:
  """Fixed random inputs of --num_features and labels of NUM_CLASSES classes."""
  rng = np.random.RandomState(0)
  x = rng.randn(num_examples, FLAGS.num_features).astype(np.float32)
  y = rng.randint(0, NUM_CLASSES, num_examples).astype(np.int32)
  return x, y


def cpu_devices() -> list[str]:
  return [f'/cpu:{i}' for i in range(FLAGS.num_cpu_devices)]


def session_config(own_threads: bool = False, **kwargs) -> tf.compat.v1.ConfigProto:
  """--num_cpu_devices virtual CPUs. own_threads: thread pools of its own (not
  the process-wide ones), so that open sessions waiting for their turn do not
  hold threads of another."""
  return tf.compat.v1.ConfigProto(device_count={'CPU': FLAGS.num_cpu_devices},
                                  use_per_session_threads=own_threads, **kwargs)


def print_header(*lines: str) -> None:
  """The date, machine and TensorFlow version, then the script's own lines."""
  print(f'# {datetime.date.today()}  {machine()}  TensorFlow {tf.__version__}')
  for line in lines:
    print(f'# {line}')


class StepTimer(tf.compat.v1.train.SessionRunHook):
  """Wall and process CPU time of the steps after the first `warmup_steps`."""

  def __init__(self, warmup_steps: int):
    self._warmup = warmup_steps
    self._steps = 0
    self.start = self.stop = self.cpu_start = self.cpu_stop = None

  def after_run(self, run_context, run_values):
    self._steps += 1
    if self._steps == self._warmup:
      self.start, self.cpu_start = time.perf_counter(), time.process_time()
    self.stop, self.cpu_stop = time.perf_counter(), time.process_time()


class MemoryTimer(tf.compat.v1.train.SessionRunHook):
  """Times each of the first `steps` steps, then traces the later ones for the allocator's peak.

  `times`: the end of each timed step (perf_counter); `peaks`: per traced
  step, the most bytes TensorFlow's allocators had in use; `before_steps`:
  the process's peak RSS (MB) once the session exists; `live`:
  `live_at_peak` of the traced step whose own tensors peaked highest.
  """

  def __init__(self, steps: int):
    self._steps = steps
    self.times: list[float] = []
    self.peaks: list[int] = []
    self.before_steps: list[float] = []
    self.live: tuple[int, dict[str, int]] | None = None   # `live_at_peak` of the highest step

  def after_create_session(self, session, coord):
    self.before_steps.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

  def before_run(self, run_context):
    if len(self.times) == self._steps:
      return tf.compat.v1.train.SessionRunArgs(None, options=tf.compat.v1.RunOptions(
          trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    return None

  def after_run(self, run_context, run_values):
    if len(self.times) < self._steps:
      self.times.append(time.perf_counter())
      return
    stats = run_values.run_metadata.step_stats
    self.peaks.append(max(m.allocator_bytes_in_use
                          for d in stats.dev_stats for n in d.node_stats for m in n.memory))
    live = live_at_peak(stats)
    if self.live is None or live[0] > self.live[0]:
      self.live = live


def live_at_peak(step_stats) -> tuple[int, dict[str, int]]:
  """The most bytes the step's own tensors held at once, and which ops' they were.

  A timeline of the step's allocations and deallocations (each op's
  `memory.allocation_records`, FULL_TRACE: outputs and temporaries, freed
  when their last reader is done), walked in time order: returns the peak of
  live bytes and, at that moment, the live bytes per op name (the op that
  allocated them; an output another op forwarded in place stays its
  allocator's). Tensors alive before the step (variables) are not counted.
  """
  events = sorted((r.alloc_micros, r.alloc_bytes, n.node_name)
                  for d in step_stats.dev_stats for n in d.node_stats
                  for m in n.memory for r in m.allocation_records)
  live, by_op, peak, at_peak = 0, {}, 0, {}
  for _, size, op in events:
    live += size
    by_op[op] = by_op.get(op, 0) + size
    if live > peak:
      peak, at_peak = live, dict(by_op)
  return peak, {op: b for op, b in at_peak.items() if b > 0}


# What the tensors alive at a step's peak are, by the name of the op that
# allocated them (the first matching rule; the rest: activations and their
# gradients).
LIVE_GROUPS = (
    ('the batch\'s input', r'^(random_normal|IteratorGetNext|shard_inputs)'),
    ('first pass (the cut)', r'^cached_gradients/'),
    ('the head, cached gradient', r'^chunked_head/'),
    ('weight gradients (sums)', r'(MatMul_grad/MatMul_1|BiasAddGrad)$'),
)


def print_live_at_peak(results: dict[str, dict]) -> None:
  """Per configuration (`step_peak_mb`, `live_at_peak`): MB alive at the step's peak, by group."""
  groups = [label for label, _ in LIVE_GROUPS] + ['activations, their gradients']
  table = {}
  for c, r in results.items():
    table[c] = dict.fromkeys(groups, 0.0)
    for op, size in r['live_at_peak']:
      label = next((l for l, rule in LIVE_GROUPS if re.search(rule, op)), groups[-1])
      table[c][label] += size / 2**20
  print(f'alive at the step\'s peak (its own tensors, FULL_TRACE allocation records; MB): '
        + ', '.join(f'{c} {r["step_peak_mb"]:.0f}' for c, r in results.items()))
  for label in groups:
    print(f'  {label:32s}' + ''.join(f' {c} {table[c][label]:6.1f}' for c in results))


def paired_change(values: Sequence[float], baseline: Sequence[float]
                  ) -> tuple[float, float, float]:
  """Median, first and third quartile over rounds of the % change from `baseline`
  in the same round (paired, so that load drifting between rounds cancels)."""
  changes = [100 * (v / b - 1) for v, b in zip(values, baseline)]
  if len(changes) < 2:
    return changes[0], changes[0], changes[0]
  q1, _, q3 = statistics.quantiles(changes, n=4)
  return statistics.median(changes), q1, q3


def median_interval(values: Sequence[float], level: float = 0.95, resamples: int = 10000,
                    seed: int = 0) -> tuple[float, float]:
  """A bootstrap confidence interval (percentile, `level`) of the median of `values`: the
  range in which the median of the rounds' paired ratios lies, beyond a shared machine's
  round-to-round noise."""
  rng = np.random.RandomState(seed)
  data = np.asarray(values, dtype=np.float64)
  medians = np.median(rng.choice(data, size=(resamples, len(data)), replace=True), axis=1)
  tail = (1 - level) / 2 * 100
  return float(np.percentile(medians, tail)), float(np.percentile(medians, 100 - tail))


def interleaved_seconds_per_step(sessions: dict[str, tuple[Any, Any]], order: Sequence[str],
                                 warmup_steps: int, rounds: int, steps: int
                                 ) -> dict[str, list[float]]:
  """Seconds per step of each `(session, fetch)`, one chunk of `steps` per round each.

  After `warmup_steps` untimed steps per session, every round runs one chunk
  of each configuration in `order` (reversed every other round), so that the
  configurations alternate under the same machine load.
  """
  for session, fetch in sessions.values():
    for _ in range(warmup_steps):
      session.run(fetch)
  seconds = {name: [] for name in order}
  for round_index in range(rounds):
    for name in (order if round_index % 2 == 0 else order[::-1]):
      session, fetch = sessions[name]
      start = time.perf_counter()
      for _ in range(steps):
        session.run(fetch)
      seconds[name].append((time.perf_counter() - start) / steps)
  return seconds


def open_towered_session(model_fn: Callable, plan: et.DevicePlan, mode: str,
                         data: tuple[np.ndarray, np.ndarray], drop_remainder: bool,
                         fetch: Callable[[Any], Any], *,
                         run_config: tf.estimator.RunConfig | None = None,
                         hooks: Callable[[Any], list] = lambda spec: [],
                         gating: Any = None) -> tuple[Any, Any]:
  """A towered graph of `mode` on repeated batches of `data`, built as Estimator
  builds it, in an open MonitoredSession of its own threads.

  `fetch(spec)`: what a step runs; `hooks(spec)`: the session's hooks (both
  called in the graph); `gating`: a context manager the model_fn is built in
  (a graph variant). Returns (session, fetch), as interleaved_seconds_per_step
  takes them.
  """
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    dataset = tf.data.Dataset.from_tensor_slices(data).repeat().batch(
        FLAGS.batch_size, drop_remainder=drop_remainder).prefetch(2)
    features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    with gating or contextlib.nullcontext():
      spec = et.replicate_model_fn(model_fn, plan=plan)(
          features, labels, mode=mode, config=run_config)
    step = fetch(spec)
    session = tf.compat.v1.train.MonitoredSession(
        tf.compat.v1.train.ChiefSessionCreator(config=session_config(own_threads=True)),
        hooks=hooks(spec))
    return session, step


# --- Fresh processes per configuration (peak memory) -------------------------

def baseline_rss() -> dict:
  """The peak RSS of this process, which imported TensorFlow and estimator_towers only."""
  return {'name': 'baseline',
          'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def in_fresh_process(script: str, config: str, flag_names: Sequence[str]) -> dict:
  """`script --config=config` in a new process, with this process's values of
  `flag_names`: the JSON of its last output line."""
  script = os.path.abspath(script)
  root = os.path.dirname(os.path.dirname(script))
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2',
             PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
  args = [sys.executable, script, f'--config={config}'] + [
      f'--{name}={getattr(FLAGS, name)}' for name in flag_names]
  out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def interleaved_processes(script: str, configs: Sequence[str], repeats: int,
                          flag_names: Sequence[str]) -> dict[str, list[dict]]:
  """Each configuration's results, `repeats` fresh processes each, interleaved.

  Peak RSS moves by some tens of MB from process to process (the C library's
  arenas, thread timing): report the median of each configuration's runs.
  """
  runs = {c: [] for c in configs}
  for _ in range(repeats):
    for c in configs:
      runs[c].append(in_fresh_process(script, c, flag_names))
  return runs


def medians(runs: list[dict]) -> dict:
  """One configuration's runs as one: each number replaced by its median."""
  out = dict(runs[0])
  for key, value in runs[0].items():
    if isinstance(value, (int, float)):
      out[key] = statistics.median(r[key] for r in runs)
  return out
