"""Towered training against the plain model_fn and MirroredStrategy, on virtual CPUs.

The same model at the same global batch (--batch_size, 256), in one process:

- plain: the unchanged single-device model_fn, on /cpu:0;
- towered: `replicate_model_fn(model_fn, devices=['/cpu:0', .. '/cpu:N-1'],
  sync_batch_norm=False)` (per-tower batch-norm statistics: the figures
  recorded before synchronised batch norm became the default measure this);
- mirrored: the unchanged model_fn with
  `RunConfig(train_distribute=tf.distribute.MirroredStrategy(devices))`, its
  input_fn batching global / N examples (each replica takes one batch);
- synced: towered with `sync_batch_norm=True`, the default (batch norms normalise with
  the global batch's statistics; run it with --contenders=plain,towered,synced
  --models=resnet);
- handwritten: a reference, not a contender: the towers' scheme written by
  hand for these two models (`handwritten_model_fn`), to tell the scheme's own
  cost on a shared CPU from the library's.

for N in --num_devices, on two models: an MLP (3072-256-256-10, Momentum;
per-step overhead dominates) and a ResNet-8 (CIFAR-shaped input, batch norm,
Momentum; compute dominates). Every configuration is a real `Estimator.train`
on a session with 8 virtual CPU devices (checkpoints, summaries and step
logging off, the same for all); hooks time it:

- time to first step: from the `train()` call to the end of the first step
  (input_fn, model_fn and Estimator's graph construction, session creation
  with variable initialisation, and the first step, which includes
  TensorFlow's graph optimisation and partitioning). Each configuration is
  built --build_rounds times, in rounds that visit every configuration in
  turn (order reversed every other round).
- steady state: each configuration's last build keeps training in a thread
  of its own, paused by a hook between chunks of steps (--warmup_steps
  untimed first; then each configuration's chunk is as many steps as it ran
  in about --chunk_sec during the warm-up); in each of --rounds rounds
  every configuration of the model runs one chunk in turn while the others
  wait (idle: no CPU), so contenders alternate every fraction of a second
  under the same machine load.

Ratios (towered / plain, towered / mirrored, towered / handwritten) are
computed within a round and the median over rounds is quoted; absolute
figures are medians. Input: one fixed synthetic batch, served by tf.data with
an unknown batch dimension (as an input_fn without drop_remainder gives; use
--static_batch for a known one).

  python bench/towers_bench.py              # the full run (under 10 minutes on 2 cores)
  python bench/towers_bench.py --quick      # smoke run (about a minute)

Prints the tables, writes --out (JSON) and --plot (PNG; needs matplotlib,
the `bench` extra). The training threads keep their sessions until the
process ends (see the end of `main`).
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

from absl import app
from absl import flags
from absl import logging as absl_logging
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=g-direct-tensorflow-import

import estimator_towers as et
import benchlib  # pylint: disable=g-import-not-at-top
from benchlib import machine  # pylint: disable=g-import-not-at-top

flags.DEFINE_list('models', ['mlp', 'resnet'], 'Models to run (mlp, resnet).')
flags.DEFINE_list('num_devices', ['2', '4', '8'], 'Device counts N.')
flags.DEFINE_list('contenders', ['plain', 'towered', 'mirrored', 'handwritten'],  # and 'synced'
                  'Contenders to run.')
flags.DEFINE_integer('batch_size', 256, 'Global batch size.')
flags.DEFINE_integer('bert_batch_size', 32, 'Global batch size of --models=bert (sequences).')
flags.DEFINE_integer('lstm_batch_size', 64, 'Global batch size of the LSTM language model '
                     '(sequences of 32 tokens; sync_bn_bench.py --first_step_model=lstm).')
flags.DEFINE_integer('rounds', 30, 'Steady-state rounds (one chunk per configuration each).')
flags.DEFINE_integer('build_rounds', 3, 'Times each configuration is built from scratch '
                     '(time to first step).')
flags.DEFINE_integer('warmup_steps', 20, 'Untimed steps after the first one.')
flags.DEFINE_float('chunk_sec', 0.25, 'Approximate duration of a steady-state chunk.')
flags.DEFINE_string('variable_strategy', 'cpu', 'variable_strategy of the towered runs.')
flags.DEFINE_bool('static_batch', False, 'Batch dimension known at graph construction.')
flags.DEFINE_bool('quick', False, 'Smoke run: 1 build, 2 warm-up steps, 2 rounds of short chunks.')
flags.DEFINE_string('out', 'towers_bench.json', 'JSON results file.')
flags.DEFINE_string('plot', 'towers_bench.png', 'PNG plot file ("" for none).')

FLAGS = flags.FLAGS
MAX_DEVICES = 8
NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)   # CIFAR-shaped; the MLP sees it flattened (3072).
CONTENDERS = ('plain', 'towered', 'synced', 'mirrored', 'handwritten')
RATIOS = (('towered', 'plain'), ('towered', 'mirrored'), ('towered', 'handwritten'),
          ('synced', 'towered'), ('synced', 'plain'))


# --- Models ---------------------------------------------------------------------

def _optimizer():
  return tf.compat.v1.train.MomentumOptimizer(0.01, 0.9)


def _loss(logits, labels):
  return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)


def mlp_logits(x, training):
  """3072-256-256-10 ReLU MLP."""
  del training
  x = tf.reshape(x, [-1, int(np.prod(IMAGE_SHAPE))])
  for i in range(2):
    x = tf.compat.v1.layers.dense(
        x, 256, activation=tf.nn.relu, name=f'hidden{i}',
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
  return tf.compat.v1.layers.dense(x, NUM_CLASSES, name='logits')


resnet_logits = benchlib.resnet8_logits


LOGITS = {'mlp': mlp_logits, 'resnet': resnet_logits}


def plain_model_fn(logits_fn):
  """The single-device model_fn: Momentum, batch-norm updates with the step."""
  def model_fn(features, labels, mode):
    loss = _loss(logits_fn(features['x'], mode == tf.estimator.ModeKeys.TRAIN), labels)
    update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    with tf.control_dependencies(update_ops):
      train_op = _optimizer().minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


def handwritten_model_fn(logits_fn, n: int):
  """The towers' scheme written by hand for these models: a reference, not a library.

  The batch (which must divide by n) is split in n; tower k runs on /cpu:k,
  reading the variables from /cpu:0 (where they live, as with
  variable_strategy='cpu'); one tf.gradients call over the towers' losses
  weighted 1/n, each tower's part on its device; tower 0's batch-norm
  updates; the optimizer applies the sum on /cpu:0. What estimator_towers
  builds for the same models, minus everything that makes it general.
  """
  def model_fn(features, labels, mode):
    xs, ys = tf.split(features['x'], n), tf.split(labels, n)
    losses, update_ops = [], []
    for k in range(n):
      def device(op, k=k):  # variables and their readers stay on /cpu:0
        if any(t.dtype == tf.resource for t in op.inputs) or op.type == 'VarHandleOp':
          return '/cpu:0'
        return f'/cpu:{k}'
      with tf.compat.v1.device(device), tf.compat.v1.variable_scope(
          tf.compat.v1.get_variable_scope(), reuse=k > 0), \
          tf.name_scope(f'tower_{k}'):
        losses.append(_loss(logits_fn(xs[k], True), ys[k]))
        if k == 0:
          update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    with tf.device('/cpu:0'):
      variables = tf.compat.v1.trainable_variables()
      grads = tf.compat.v1.gradients(losses, variables, grad_ys=[tf.constant(1.0 / n)] * n,
                                     colocate_gradients_with_ops=True)
      loss = tf.add_n(losses) / n
      with tf.control_dependencies(update_ops):
        train_op = _optimizer().apply_gradients(zip(grads, variables),
                                                tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


_LSTM_WIDTH, _LSTM_TOKENS = 64, 32   # bench/lstm_bench.py's defaults


def _token_input_fn(batch_size: int):
  """Batches of `batch_size` fixed token sequences (features only), repeated."""
  tokens = benchlib.encoder_tokens(4 * batch_size, _LSTM_TOKENS + 1)
  return lambda: tf.data.Dataset.from_tensor_slices(tokens).repeat().batch(batch_size)


def make_input_fn(batch_size: int, static: bool):
  """One fixed synthetic batch, repeated; its first dimension unknown unless `static`.

  The batch is a constant; each element is a zero-copy slice of it (rows
  [0, n) with n computed at run time, so that shape inference cannot see it).
  """
  rng = np.random.RandomState(0)
  images = rng.rand(batch_size, *IMAGE_SHAPE).astype(np.float32)
  classes = rng.randint(0, NUM_CLASSES, batch_size).astype(np.int32)

  def input_fn():
    x, y = tf.constant(images), tf.constant(classes)
    if static:
      return tf.data.Dataset.from_tensors(({'x': x}, y)).repeat()

    def element(i):
      n = tf.cast(batch_size + 0 * i, tf.int32)  # batch_size, unknown to shape inference
      return {'x': x[:n]}, y[:n]
    return tf.data.Dataset.range(1).repeat().map(element)
  return input_fn


# --- Runs -----------------------------------------------------------------------

def session_config() -> tf.compat.v1.ConfigProto:
  """Estimator's default graph rewriting (one meta-optimizer pass), on MAX_DEVICES CPUs.

  The same for every contender: what Estimator gives a RunConfig without a
  session_config (and `estimator_towers.make_run_config` keeps), with the
  virtual devices the towers need.
  """
  config = tf.compat.v1.ConfigProto(device_count={'CPU': MAX_DEVICES})
  config.graph_options.rewrite_options.meta_optimizer_iterations = (
      rewriter_config_pb2.RewriterConfig.ONE)
  return config


def make_estimator(model: str, contender: str, n: int, strategies: dict,
                   variable_strategy: str | None = None
                   ) -> tuple[tf.estimator.Estimator, Callable]:
  """A fresh Estimator for one configuration, and its input_fn.

  `strategies[n]` is the MirroredStrategy of the 'mirrored' contender;
  `variable_strategy` that of 'towered' (default: --variable_strategy).
  """
  devices = [f'/cpu:{i}' for i in range(n)]
  batch = FLAGS.batch_size
  if model == 'bert':  # BERT's own pre-training model_fn (bench/bert_pretraining.py)
    import bert_pretraining  # pylint: disable=g-import-not-at-top
    model_fn, batch = bert_pretraining.model_fn(), FLAGS.bert_batch_size
  elif model == 'lstm':  # bench/lstm_bench.py's 2-layer LSTM language model, features only
    model_fn, batch = benchlib.lstm_model_fn(_LSTM_WIDTH), FLAGS.lstm_batch_size
  else:
    model_fn = plain_model_fn(LOGITS[model])
  distribute = None
  if contender == 'handwritten':
    model_fn = handwritten_model_fn(LOGITS[model], n)
  elif contender in ('towered', 'synced'):
    model_fn = et.replicate_model_fn(
        model_fn, devices=devices,
        variable_strategy=variable_strategy or FLAGS.variable_strategy,
        sync_batch_norm=contender == 'synced')
  elif contender == 'mirrored':
    distribute = strategies[n]
    batch = FLAGS.batch_size // n  # each replica takes one batch of the input_fn
  config = tf.estimator.RunConfig(
      session_config=session_config(), train_distribute=distribute,
      save_checkpoints_steps=None, save_checkpoints_secs=None,
      save_summary_steps=None, log_step_count_steps=None)
  estimator = tf.estimator.Estimator(
      model_fn, model_dir=tempfile.mkdtemp(prefix='towers_bench_'), config=config)
  if model == 'bert':
    return estimator, bert_pretraining.input_fn(batch)
  if model == 'lstm':
    return estimator, _token_input_fn(batch)
  return estimator, make_input_fn(batch, FLAGS.static_batch)


def process_cpu() -> float:
  """CPU seconds of this process so far, user and system, all threads (TensorFlow's too):
  what a loaded machine does not inflate, unlike wall time."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


class FirstStep(tf.compat.v1.train.SessionRunHook):
  """When the graph was finished, the session created and the first step ended
  (wall time, and the process's CPU seconds: `cpu[...]`)."""

  def __init__(self):
    self.graph_done = self.session_done = self.first_step = None
    self.cpu = {}

  def begin(self):
    self.graph_done, self.cpu['graph'] = time.perf_counter(), process_cpu()

  def after_create_session(self, session, coord):
    self.session_done, self.cpu['session'] = time.perf_counter(), process_cpu()

  def after_run(self, run_context, run_values):
    if self.first_step is None:
      self.first_step, self.cpu['first'] = time.perf_counter(), process_cpu()


def first_step_times(start: float, hook: FirstStep, start_cpu: float | None = None) -> dict:
  """Wall seconds to the first step and its parts; with `start_cpu` (`process_cpu()` at
  the start), the same in process CPU seconds (`*_cpu_sec`)."""
  times = {'first_step_sec': hook.first_step - start,
           'graph_sec': hook.graph_done - start,
           'session_sec': hook.session_done - hook.graph_done,
           'first_run_sec': hook.first_step - hook.session_done}
  if start_cpu is not None:
    times.update(first_step_cpu_sec=hook.cpu['first'] - start_cpu,
                 graph_cpu_sec=hook.cpu['graph'] - start_cpu,
                 session_cpu_sec=hook.cpu['session'] - hook.cpu['graph'],
                 first_run_cpu_sec=hook.cpu['first'] - hook.cpu['session'])
  return times


def time_first_step(model: str, contender: str, n: int, strategies: dict) -> dict:
  """Trains a fresh Estimator for one step; returns the times to it (gc_sec: of which
  the garbage collector's passes)."""
  estimator, input_fn = make_estimator(model, contender, n, strategies)
  hook = FirstStep()
  with benchlib.collections_timed() as collected:
    start = time.perf_counter()
    estimator.train(input_fn, steps=1, hooks=[hook])
  return dict(first_step_times(start, hook), gc_sec=collected[0])


class _Baton(tf.compat.v1.train.SessionRunHook):
  """Lets a training loop run only the steps it is granted (see `OpenRun`)."""

  def __init__(self, run: 'OpenRun'):
    self._run = run

  def after_run(self, run_context, run_values):
    run = self._run
    run.remaining -= 1
    if run.remaining > 0:
      return
    run.chunk_end = time.perf_counter()
    run.done.release()
    run.go.acquire()  # until the next grant


class OpenRun:
  """One configuration's `Estimator.train`, running in a thread, step chunks on demand.

  The thread builds the graph, creates the session and runs the first step,
  then waits; each `chunk(steps)` lets it run that many more steps while the
  caller waits, and returns their wall time. Only one configuration runs at a
  time, so configurations alternate in short chunks: paired measurements under
  the same machine load. Steps are timed from the grant to the end of the
  last step's hooks (Estimator's own per-step work included, for every
  contender alike).
  """

  def __init__(self, model: str, contender: str, n: int, strategies: dict):
    self.estimator, self._input_fn = make_estimator(model, contender, n, strategies)
    self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
    self.remaining, self.chunk_end = 1, None
    self.error = None
    self._first = FirstStep()
    self._start = time.perf_counter()
    self._thread = threading.Thread(target=self._train, daemon=True)
    self._thread.start()
    self._wait()
    self.first_step = first_step_times(self._start, self._first)

  def _train(self):
    try:
      self.estimator.train(self._input_fn, hooks=[self._first, _Baton(self)])
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e
      self.done.release()

  def _wait(self):
    self.done.acquire()
    if self.error is not None:
      raise RuntimeError('training thread failed') from self.error

  def chunk(self, steps: int) -> float:
    self.remaining = steps
    granted = time.perf_counter()
    self.go.release()
    self._wait()
    return self.chunk_end - granted



# --- Report ---------------------------------------------------------------------

def load() -> str:
  try:
    return 'load average ' + ', '.join(f'{v:.2f}' for v in os.getloadavg())
  except OSError:
    return 'load average unknown'


def _median(values):
  return statistics.median(values) if values else float('nan')


def _fmt(value, digits=0):
  return '—' if value is None or value != value else f'{value:,.{digits}f}'


def summarise(steady: list[dict], builds: list[dict], models, counts) -> list[dict]:
  """Medians per (model, contender, N) and medians of the within-round ratios."""
  def of(runs, model, contender, n, key, round_=None):
    n = 1 if contender == 'plain' else n
    return [r[key] for r in runs if r['model'] == model and r['contender'] == contender
            and r['n'] == n and (round_ is None or r['round'] == round_)]

  table = []
  for model in models:
    for n in counts:
      row = {'model': model, 'n': n}
      for key, runs in (('examples_per_sec', steady), ('first_step_sec', builds),
                        ('graph_sec', builds), ('session_sec', builds),
                        ('first_run_sec', builds)):
        for contender in CONTENDERS:
          row[f'{contender}_{key}'] = _median(of(runs, model, contender, n, key))
        if key not in ('examples_per_sec', 'first_step_sec'):
          continue
        for num, den in RATIOS:
          ratios = []
          for r in sorted({run['round'] for run in runs}):
            a, b = of(runs, model, num, n, key, r), of(runs, model, den, n, key, r)
            if a and b:
              ratios.append(a[0] / b[0])
          row[f'{num}_over_{den}_{key}'] = _median(ratios)
      table.append(row)
  return table


def print_table(table: list[dict]) -> None:
  """Two markdown tables: steady-state throughput, and time to first step."""
  for key, title, digits in (('examples_per_sec', 'steady state, examples/second', 0),
                             ('first_step_sec', 'time to first step, seconds', 2)):
    print(f'\n{title}:\n')
    print('| model | N | ' + ' | '.join(CONTENDERS) + ' | '
          + ' | '.join(f'{a} / {b}' for a, b in RATIOS) + ' |')
    print('|---|---|' + '---|' * (len(CONTENDERS) + len(RATIOS)))
    for row in table:
      cells = [_fmt(row[f'{c}_{key}'], digits) for c in CONTENDERS]
      cells += [_fmt(row[f'{a}_over_{b}_{key}'], 2) for a, b in RATIOS]
      print(f"| {row['model']} | {row['n']} | " + ' | '.join(cells) + ' |')


def plot(table: list[dict], models, path: str, title: str) -> bool:
  """Writes the PNG; False (and a note) when matplotlib is not installed."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    print(f'no plot: matplotlib is not installed (pip install -e \'.[bench]\'); '
          f'--plot={path} skipped')
    return False
  matplotlib.use('Agg')
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  figure, axes = pyplot.subplots(2, len(models), figsize=(5.5 * len(models), 8), squeeze=False)
  styles = {'plain': ('k', '--'), 'towered': ('tab:blue', '-'), 'synced': ('tab:green', '-'),
            'mirrored': ('tab:orange', '-'),
            'handwritten': ('tab:gray', ':')}
  for j, model in enumerate(models):
    rows = [r for r in table if r['model'] == model]
    ns = [r['n'] for r in rows]
    for i, (key, label) in enumerate((('examples_per_sec', 'examples / second'),
                                      ('first_step_sec', 'time to first step (s)'))):
      ax = axes[i][j]
      for contender in CONTENDERS:
        values = [r[f'{contender}_{key}'] for r in rows]
        if all(v != v for v in values):
          continue
        color, line = styles[contender]
        name = {'plain': 'plain (1 device)', 'handwritten': 'hand-written towers'}.get(
            contender, contender)
        ax.plot(ns, values, line, color=color, marker='o', label=name)
      ax.set_xticks(ns)
      ax.set_xlabel('devices N')
      ax.set_ylabel(label)
      ax.set_ylim(bottom=0)
      ax.set_title(f'{model}: {label}')
      ax.grid(alpha=0.3)
      ax.legend()
  figure.suptitle(title, fontsize=9)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  return True


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  absl_logging.set_verbosity(absl_logging.ERROR)
  if FLAGS.quick:
    FLAGS.rounds, FLAGS.build_rounds, FLAGS.warmup_steps = 2, 1, 2
    FLAGS.chunk_sec = 0.02
  models = FLAGS.models
  counts = [int(n) for n in FLAGS.num_devices]
  if max(counts) > MAX_DEVICES or min(counts) < 1:
    raise app.UsageError(f'--num_devices: from 1 to {MAX_DEVICES}, got {counts}.')
  if FLAGS.build_rounds < 1 or FLAGS.rounds < 1:
    raise app.UsageError('--rounds and --build_rounds must be at least 1.')
  contenders = [c for c in CONTENDERS if c in FLAGS.contenders]
  # A MirroredStrategy reads the process's devices when it is created: it must
  # exist before any session has run, or it sees one CPU.
  strategies = ({n: tf.distribute.MirroredStrategy([f'/cpu:{i}' for i in range(n)])
                 for n in counts} if 'mirrored' in contenders else {})
  started = time.perf_counter()
  header = (f'{datetime.date.today()}  {machine()}  TensorFlow {tf.__version__}; '
            f'global batch {FLAGS.batch_size}, {FLAGS.rounds} rounds, {FLAGS.build_rounds} '
            f'builds, {"static" if FLAGS.static_batch else "unknown"} batch dimension, '
            f'variable_strategy {FLAGS.variable_strategy}')
  start_load = load()
  print(f'# {header}\n# {start_load} at start', flush=True)
  for contender in contenders:  # the process's first build of each kind pays one-off costs
    time_first_step('mlp', contender, 1 if contender == 'plain' else min(counts), strategies)

  steady, builds = [], []
  for model in models:
    configs = [(c, n) for c in contenders for n in ([1] if c == 'plain' else counts)]
    open_runs = {}
    for b in range(FLAGS.build_rounds):
      for contender, n in (configs if b % 2 == 0 else configs[::-1]):
        if b < FLAGS.build_rounds - 1:
          times = time_first_step(model, contender, n, strategies)
        else:  # the last build is the steady-state run's own
          open_runs[contender, n] = OpenRun(model, contender, n, strategies)
          times = open_runs[contender, n].first_step
        builds.append(dict(times, round=b, model=model, contender=contender, n=n))
        print(f'{time.perf_counter() - started:6.1f}s build {b} {model:6s} {contender:11s} '
              f'N={n}: first step {times["first_step_sec"]:5.2f} s (graph '
              f'{times["graph_sec"]:.2f}, session {times["session_sec"]:.2f}, '
              f'run {times["first_run_sec"]:.2f})', flush=True)
    chunks = {}  # steps per chunk: about --chunk_sec at the warm-up's speed
    for key, run in open_runs.items():
      seconds = run.chunk(FLAGS.warmup_steps)
      chunks[key] = max(2, min(500, round(FLAGS.chunk_sec * FLAGS.warmup_steps / seconds)))
    print(f'{time.perf_counter() - started:6.1f}s warm; steps per chunk: '
          + ' '.join(f'{c[0]}{n}={k}' for (c, n), k in sorted(chunks.items())), flush=True)
    for r in range(FLAGS.rounds):
      line = []
      for contender, n in (configs if r % 2 == 0 else configs[::-1]):
        steps = chunks[contender, n]
        speed = steps * FLAGS.batch_size / open_runs[contender, n].chunk(steps)
        steady.append(dict(examples_per_sec=speed, round=r, model=model,
                           contender=contender, n=n))
        line.append(f'{contender[0]}{n}={speed:.0f}')
      print(f'{time.perf_counter() - started:6.1f}s round {r:2d} {model:6s} ex/s: '
            + ' '.join(sorted(line)), flush=True)

  elapsed = time.perf_counter() - started
  table = summarise(steady, builds, models, counts)
  loads = f'{start_load} at start, {load()} at end'
  print(f'\n# {header}; {elapsed / 60:.1f} min; {loads}')
  print('# ex/s: median steady-state examples/second; first step: median seconds from '
        'train() to the end of step 1; ratios: median over rounds of the ratio within a round')
  print_table(table)
  with open(FLAGS.out, 'w', encoding='utf-8') as f:
    json.dump({'header': header, 'elapsed_sec': elapsed, 'load': loads, 'flags': {
        k: FLAGS[k].value for k in ('models', 'num_devices', 'contenders', 'batch_size',
                                    'rounds', 'build_rounds', 'warmup_steps', 'chunk_sec',
                                    'variable_strategy', 'static_batch',
                                    'quick')},
               'table': table, 'steady': steady, 'builds': builds}, f, indent=1)
  print(f'wrote {FLAGS.out}')
  if FLAGS.plot and plot(table, models, FLAGS.plot, header):
    print(f'wrote {FLAGS.plot}')
  # The training threads still hold their sessions, idle (no CPU). Closing a
  # session of MirroredStrategy's here can block for minutes (in
  # TF_CloseSession), so the process ends without closing them.
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == '__main__':
  app.run(main)
