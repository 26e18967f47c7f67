"""Synchronised batch norm against unsynced towers; time to first step at N = 8.

One run prints the two tables issue 22 asks for, on bench/towers_bench.py's
ResNet-8 (CIFAR-shaped input, seven fused batch norms, Momentum; global batch
--batch_size) on virtual CPU devices:

1. synced (`sync_batch_norm=True`) against unsynced towers at each N of
   --num_devices: steady-state examples/second and time to first step.
   Steady state: each configuration keeps training in a thread of its own
   and, in each of --rounds rounds, runs one chunk of about --chunk_sec in
   turn while the others wait (towers_bench.OpenRun); the ratio synced /
   unsynced is taken within a round, its median over rounds quoted.
2. time to first step at N = --first_step_n of plain (one device), towered,
   synced and MirroredStrategy, split into: graph (train() until the graph
   is finished: input_fn, model_fn with the towers and the backward pass,
   Estimator's own ops; `model_fn` is the part inside the model_fn), session
   (session creation and variable initialisation) and first run (graph
   optimisation, partitioning, executor creation and the first step).

Each time is also given in process CPU seconds (`*_cpu_sec`: user and
system time of every thread, TensorFlow's included), which a machine loaded
by other jobs inflates far less than wall time. --first_step_model=bert
times BERT's own pre-training model_fn instead (bench/bert_pretraining.py),
--first_step_model=lstm bench/lstm_bench.py's 2-layer LSTM language model with
dropout (global batch --lstm_batch_size); neither has batch norm:
`--first_step_contenders=plain,towered`.

A time to first step is what a user waits for after starting a trainer, so
each is measured in a fresh process (--fresh_processes, the default): the
process first builds and runs the MLP of the same contender for one step
(TensorFlow's and Keras' one-off costs, paid by every contender alike, stay
out), then the measured ResNet-8. --build_rounds builds per configuration,
interleaved (order reversed every other round), medians quoted; ratios are
taken within a round. --nofresh_processes builds everything in this one
long-lived process, as the bench did before 2026-11-25 (there a build's time
also depends on what was built before it: the garbage collector's full
collections walk every object still alive).

  python bench/sync_bn_bench.py            # the full run (about 4 minutes on 2 cores)
  python bench/sync_bn_bench.py --quick    # smoke run
  # time to first step only, each round's ratio to plain (process CPU seconds):
  python bench/sync_bn_bench.py --first_step_only --first_step_contenders=plain,synced,towered \
      --build_rounds=9
  python bench/sync_bn_bench.py --first_step_only --first_step_model=bert \
      --first_step_contenders=plain,towered --build_rounds=3
  python bench/sync_bn_bench.py --first_step_only --first_step_model=lstm \
      --first_step_contenders=plain,towered --build_rounds=4

Where a step's time goes op by op:
  python bench/towers_profile.py --model=resnet --n=4 --profile_contenders=towered,synced
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
from absl import logging as absl_logging
import tensorflow as tf

import benchlib
import towers_bench as tb
from benchlib import machine  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer('first_step_n', 8, 'N of the first-step comparison with plain and mirrored '
                     '(0: skip it).')
flags.DEFINE_bool('fresh_processes', True, 'Time each first step in a fresh process.')
flags.DEFINE_list('first_step_contenders', ['plain', 'towered', 'synced', 'mirrored'],
                  'Contenders of the first-step comparison (plain first).')
flags.DEFINE_enum('first_step_model', 'resnet', ['resnet', 'bert', 'lstm'],
                  'Model of the first-step comparison: resnet (ResNet-8), bert (BERT\'s '
                  'pre-training model_fn, bench/bert_pretraining.py) or lstm '
                  '(bench/lstm_bench.py\'s 2-layer LSTM language model with dropout); bert '
                  'and lstm have no batch norm: synced is towered.')
flags.DEFINE_bool('first_step_only', False, 'Only the first-step comparison (table 2), with each '
                  'round\'s ratio to plain in the same round.')
flags.DEFINE_string('measure_first_step', '', 'Internal: "contender:n"; time that first step '
                    'in this process, print it as JSON and exit.')
FLAGS = flags.FLAGS


class _ModelFnClock:
  """Wall time from the first model_fn call's start to the last one's end.

  MirroredStrategy calls the model_fn once per replica, in threads of its
  own; the span covers them all.
  """

  def __init__(self, estimator: tf.estimator.Estimator):
    self._start = self._end = None
    self.cpu_seconds = 0.0  # the calling threads' CPU seconds, summed
    call = estimator._call_model_fn  # pylint: disable=protected-access

    def timed(*args, **kwargs):
      start, cpu = time.perf_counter(), time.thread_time()
      self._start = start if self._start is None else min(self._start, start)
      try:
        return call(*args, **kwargs)
      finally:
        self._end = max(self._end or 0.0, time.perf_counter())
        self.cpu_seconds += time.thread_time() - cpu
    estimator._call_model_fn = timed  # pylint: disable=protected-access

  @property
  def seconds(self) -> float:
    return self._end - self._start


def first_step(contender: str, n: int, strategies: dict) -> dict:
  """A fresh Estimator's times to its first step, with the model_fn's share.

  With --fresh_processes, in a fresh process of its own (`_measure_and_exit`).
  """
  if FLAGS.fresh_processes:
    return _in_fresh_process(contender, n)
  estimator, input_fn = tb.make_estimator(FLAGS.first_step_model, contender, n, strategies)
  clock = _ModelFnClock(estimator)
  hook = tb.FirstStep()
  with benchlib.collections_timed() as collected:
    start, start_cpu = time.perf_counter(), tb.process_cpu()
    estimator.train(input_fn, steps=1, hooks=[hook])
  return dict(tb.first_step_times(start, hook, start_cpu), model_fn_sec=clock.seconds,
              model_fn_cpu_sec=clock.cpu_seconds, gc_sec=collected[0])


def _in_fresh_process(contender: str, n: int) -> dict:
  """`first_step` in a child process of this script (same flags), after its warm-up."""
  argv = [sys.executable, os.path.abspath(__file__), f'--measure_first_step={contender}:{n}',
          '--nofresh_processes'] + [
              FLAGS[name].serialize() for name in (
                  'batch_size', 'variable_strategy', 'static_batch', 'first_step_model',
                  'bert_batch_size', 'lstm_batch_size')]
  done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
  lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
  if done.returncode != 0 or not lines:
    raise RuntimeError(f'first step of {contender} N={n} in a fresh process failed '
                       f'(exit {done.returncode}):\n{done.stderr[-3000:]}')
  return json.loads(lines[-1][len(_RESULT):])


_RESULT = 'FIRST_STEP '


def _measure_and_exit(spec: str) -> None:
  """The child of `_in_fresh_process`: warm-up on the MLP, then the measured build."""
  contender, n = spec.split(':')
  n = int(n)
  strategies = ({n: tf.distribute.MirroredStrategy([f'/cpu:{i}' for i in range(n)])}
                if contender == 'mirrored' else {})
  tb.time_first_step('mlp', contender, n, strategies)  # one-off costs
  if FLAGS.first_step_model == 'bert':  # and BERT's imports
    import bert_pretraining  # pylint: disable=g-import-not-at-top
    bert_pretraining.bert_model.modules()
  print(_RESULT + json.dumps(first_step(contender, n, strategies)), flush=True)
  os._exit(0)  # pylint: disable=protected-access  # as main()


def _median(values):
  return statistics.median(values) if values else float('nan')


def sync_rates(counts: list[int], strategies: dict, started: float) -> list[dict]:
  """Table 1: per N, synced and unsynced examples/second and first step (medians)."""
  configs = [(c, n) for n in counts for c in ('towered', 'synced')]
  builds = []
  for b in range(FLAGS.build_rounds):
    for contender, n in (configs if b % 2 == 0 else configs[::-1]):
      times = first_step(contender, n, strategies)
      builds.append(dict(times, contender=contender, n=n, round=b))
      print(f'{time.perf_counter() - started:6.1f}s build {b} {contender:8s} N={n}: first '
            f'step {times["first_step_sec"]:.2f} s', flush=True)
  runs = {config: tb.OpenRun('resnet', *config, strategies) for config in configs}
  chunks = {}
  for key, run in runs.items():
    seconds = run.chunk(FLAGS.warmup_steps)
    chunks[key] = max(2, min(500, round(FLAGS.chunk_sec * FLAGS.warmup_steps / seconds)))
  speeds = []
  for r in range(FLAGS.rounds):
    for contender, n in (configs if r % 2 == 0 else configs[::-1]):
      steps = chunks[contender, n]
      speeds.append(dict(contender=contender, n=n, round=r, examples_per_sec=steps *
                         FLAGS.batch_size / runs[contender, n].chunk(steps)))
    print(f'{time.perf_counter() - started:6.1f}s round {r:2d} ex/s: ' + ' '.join(
        f'{s["contender"][0]}{s["n"]}={s["examples_per_sec"]:.0f}'
        for s in speeds if s['round'] == r), flush=True)

  def of(rows, contender, n, key, round_=None):
    return [x[key] for x in rows if x['contender'] == contender and x['n'] == n
            and (round_ is None or x['round'] == round_)]

  table = []
  for n in counts:
    row = {'n': n}
    for key, rows in (('examples_per_sec', speeds), ('first_step_sec', builds)):
      for contender in ('towered', 'synced'):
        row[f'{contender}_{key}'] = _median(of(rows, contender, n, key))
      rounds = sorted({x['round'] for x in rows})
      row[f'ratio_{key}'] = _median([of(rows, 'synced', n, key, r)[0] /
                                     of(rows, 'towered', n, key, r)[0] for r in rounds])
    table.append(row)
  return table


def first_steps(n: int, strategies: dict, started: float) -> dict:
  """Table 2: per contender at N = n, median first step and its parts."""
  contenders = [(c, 1 if c == 'plain' else n) for c in FLAGS.first_step_contenders]
  times = {c: [] for c, _ in contenders}
  for b in range(FLAGS.build_rounds):
    for contender, k in (contenders if b % 2 == 0 else contenders[::-1]):
      times[contender].append(first_step(contender, k, strategies))
      t = times[contender][-1]
      print(f'{time.perf_counter() - started:6.1f}s first step {contender:8s} N={k}: '
            f'{t["first_step_sec"]:.2f} s (graph {t["graph_sec"]:.2f} of which model_fn '
            f'{t["model_fn_sec"]:.2f}, session {t["session_sec"]:.2f}, run '
            f'{t["first_run_sec"]:.2f}; garbage collection {t["gc_sec"]:.2f}); process CPU '
            f'{t["first_step_cpu_sec"]:.2f} s (graph {t["graph_cpu_sec"]:.2f} of which model_fn '
            f'{t["model_fn_cpu_sec"]:.2f}, session {t["session_cpu_sec"]:.2f}, run '
            f'{t["first_run_cpu_sec"]:.2f})', flush=True)
  for contender, ts in times.items():   # within a round: each round's ratio to plain's
    if contender != 'plain' and 'plain' in times:
      ratios = [t['first_step_cpu_sec'] / p['first_step_cpu_sec']
                for t, p in zip(ts, times['plain'])]
      print(f'first step {contender} / plain, process CPU, per round: '
            f'{", ".join(f"{r:.2f}" for r in ratios)} (median {_median(ratios):.2f})', flush=True)
  return {c: {key: _median([t[key] for t in ts]) for key in ts[0]} for c, ts in times.items()}


def print_tables(rates: list[dict], firsts: dict, n: int, rates_table: bool = True) -> None:
  if rates_table:
    print('\nsynced (sync_batch_norm=True) / unsynced towers, ResNet-8:\n')
    print('| N | unsynced ex/s | synced ex/s | synced / unsynced | unsynced first step (s) | '
          'synced first step (s) | synced / unsynced |')
    print('|---|---|---|---|---|---|---|')
  for r in rates:
    print(f"| {r['n']} | {r['towered_examples_per_sec']:,.0f} | "
          f"{r['synced_examples_per_sec']:,.0f} | {r['ratio_examples_per_sec']:.2f} | "
          f"{r['towered_first_step_sec']:.2f} | {r['synced_first_step_sec']:.2f} | "
          f"{r['ratio_first_step_sec']:.2f} |")
  if not firsts:
    return
  model = {'resnet': 'ResNet-8', 'bert': 'BERT pre-training',
           'lstm': '2-layer LSTM language model'}[FLAGS.first_step_model]
  for unit, suffix in (('wall seconds', 'sec'), ('process CPU seconds', 'cpu_sec')):
    print(f'\ntime to first step, {model}, N={n} (plain: one device), medians, {unit}:\n')
    print('| contender | first step | graph | of which model_fn | session | first run | '
          '/ plain | / mirrored |')
    print('|---|---|---|---|---|---|---|---|')
    for contender, t in firsts.items():
      mirrored = (f"{t['first_step_' + suffix] / firsts['mirrored']['first_step_' + suffix]:.2f}"
                  if 'mirrored' in firsts else '')
      print(f"| {contender} | {t['first_step_' + suffix]:.2f} | {t['graph_' + suffix]:.2f} | "
            f"{t['model_fn_' + suffix]:.2f} | {t['session_' + suffix]:.2f} | "
            f"{t['first_run_' + suffix]:.2f} | "
            f"{t['first_step_' + suffix] / firsts['plain']['first_step_' + suffix]:.2f} | "
            f"{mirrored} |")


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  absl_logging.set_verbosity(absl_logging.ERROR)
  if FLAGS.quick:
    FLAGS.rounds, FLAGS.build_rounds, FLAGS.warmup_steps, FLAGS.chunk_sec = 2, 1, 2, 0.02
  if FLAGS.measure_first_step:
    _measure_and_exit(FLAGS.measure_first_step)
  counts = [int(n) for n in FLAGS.num_devices]
  n = FLAGS.first_step_n
  # MirroredStrategy must exist before any session ran (in this process: without fresh processes).
  strategies = ({n: tf.distribute.MirroredStrategy([f'/cpu:{i}' for i in range(n)])}
                if n and not FLAGS.fresh_processes else {})
  batch = {'bert': FLAGS.bert_batch_size, 'lstm': FLAGS.lstm_batch_size}.get(
      FLAGS.first_step_model if FLAGS.first_step_only else 'resnet', FLAGS.batch_size)
  header = (f'{datetime.date.today()}  {machine()}  TensorFlow {tf.__version__}; global batch '
            f'{batch}, {FLAGS.rounds} rounds, {FLAGS.build_rounds} builds'
            f'{" (fresh processes)" if FLAGS.fresh_processes else " (in this process)"}')
  print(f'# {header}\n# {tb.load()} at start', flush=True)
  started = time.perf_counter()
  if not FLAGS.fresh_processes:  # one-off costs (a fresh process pays them before its build)
    for contender in ('plain', 'towered', 'synced', 'mirrored')[:4 if n else 3]:
      tb.time_first_step('mlp', contender, 1 if contender == 'plain' else n or 2, strategies)
  firsts = first_steps(n, strategies, started) if n else {}
  rates = [] if FLAGS.first_step_only else sync_rates(counts, strategies, started)
  print(f'\n# {header}; {(time.perf_counter() - started) / 60:.1f} min; {tb.load()} at end')
  print_tables(rates, firsts, n, rates_table=not FLAGS.first_step_only)
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access  # sessions of MirroredStrategy: see towers_bench


if __name__ == '__main__':
  app.run(main)
