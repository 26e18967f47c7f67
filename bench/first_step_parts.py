"""Where the time to first step goes, plain against towered, with grappler's passes one by one.

Each contender's first step is timed in a fresh process (after the MLP's
first step, as bench/sync_bn_bench.py does: TensorFlow's one-off costs stay
out), with TensorFlow logging the meta-optimizer's passes
(`TF_CPP_VMODULE=meta_optimizer=1`), and split into:

- graph: train() until the graph is finished (input_fn, model_fn with the
  towers and the backward passes, Estimator's own ops); model_fn: the part
  inside the model_fn;
- session: session creation and variable initialisation (the placement of
  the whole graph, and the graph optimisation and executors of the
  initialisation's runs: `session grappler`);
- first run: the first step's run call: grappler on the step's graph
  (`run grappler`), partitioning and executor creation (`run rest`), and the
  step itself, taken as the second step's time (`step`).

Process CPU seconds of the whole (`first step CPU`) and of each phase
(`*_cpu`) are printed too; grappler's times are the log's (wall). Rounds
interleave the contenders (order reversed every other round); medians are
quoted, and each towered contender's ratio to plain within a round.

  python bench/first_step_parts.py --parts_contenders=plain:1,synced:8,towered:8 --build_rounds=3
  python bench/first_step_parts.py --model=bert --parts_contenders=plain:1,towered:8 --build_rounds=3
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
from absl import logging as absl_logging
import tensorflow as tf

import towers_bench as tb
import sync_bn_bench  # pylint: disable=unused-import  # its flags (--bert_batch_size) and model_fn clock

flags.DEFINE_string('model', 'resnet', 'resnet, mlp or bert (bench/bert_pretraining.py).')
flags.DEFINE_list('parts_contenders', ['plain:1', 'synced:8', 'towered:8'], 'contender:devices, plain first.')
flags.DEFINE_string('measure', '', 'Internal: "contender:n"; time it in this process and exit.')
FLAGS = flags.FLAGS

_RESULT = 'PARTS '
_LOG = re.compile(r'^(\d+-\d+-\d+ \d+:\d+:\d+\.\d+): I .*meta_optimizer\.cc:\d+\] (.*)$')
_KEYS = ('first_step', 'first_step_cpu', 'graph', 'model_fn', 'session', 'session_grappler',
         'first_run', 'run_grappler', 'run_rest', 'step')


class _Marks(tf.compat.v1.train.SessionRunHook):
  """Wall (epoch seconds, to match TensorFlow's log) and process CPU times of the phases."""

  def __init__(self):
    self.marks, self._runs = {}, 0

  def _mark(self, name):
    self.marks[name], self.marks[name + '_cpu'] = time.time(), tb.process_cpu()

  def begin(self):
    self._mark('graph')

  def after_create_session(self, session, coord):
    self._mark('session')

  def before_run(self, run_context):
    self._runs += 1
    self._mark(f'before{self._runs}')

  def after_run(self, run_context, run_values):
    self._mark(f'after{self._runs}')


def _measure_and_exit(spec: str) -> None:
  contender, n = spec.split(':')
  tb.time_first_step('mlp', contender, int(n), {})  # one-off costs
  if FLAGS.model == 'bert':
    import bert_pretraining  # pylint: disable=g-import-not-at-top
    bert_pretraining.bert_model.modules()
  estimator, input_fn = tb.make_estimator(FLAGS.model, contender, int(n), {})
  clock, hook = sync_bn_bench._ModelFnClock(estimator), _Marks()  # pylint: disable=protected-access
  hook._mark('start')  # pylint: disable=protected-access
  sys.stderr.write('MEASURED\n')
  sys.stderr.flush()
  estimator.train(input_fn, steps=2, hooks=[hook])
  print(_RESULT + json.dumps(dict(hook.marks, model_fn=clock.seconds)), flush=True)
  os._exit(0)  # pylint: disable=protected-access


def _grappler(log: str, start: float, end: float) -> tuple[float, collections.Counter]:
  """Seconds of the grappler runs that started in [start, end), and per optimizer."""
  total, passes, begun, last = 0.0, collections.Counter(), None, None
  for line in log.splitlines():
    found = _LOG.match(line)
    if not found:
      continue
    when = datetime.datetime.strptime(found.group(1), '%Y-%m-%d %H:%M:%S.%f').timestamp()
    message = found.group(2)
    if message.startswith('Starting optimization'):
      if begun is not None:
        total += last - begun
      begun = last = when if start <= when < end else None
    elif begun is not None and 'time = ' in message:
      name = re.sub(r'\{.*\}', '', message.split(': Graph size')[0])
      passes[name] += float(re.search(r'time = ([\d.]+)ms', message).group(1)) / 1000
      last = when
  if begun is not None:
    total += last - begun
  return total, passes


def parts(spec: str) -> tuple[dict, collections.Counter]:
  """One fresh process's phases (seconds) and the first run's grappler passes."""
  argv = [sys.executable, os.path.abspath(__file__), f'--measure={spec}'] + [
      FLAGS[name].serialize() for name in ('model', 'batch_size', 'bert_batch_size',
                                           'variable_strategy')]
  env = dict(os.environ, TF_CPP_VMODULE='meta_optimizer=1')
  done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, check=False)
  lines = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
  if done.returncode != 0 or not lines:
    raise RuntimeError(f'{spec} failed (exit {done.returncode}):\n{done.stderr[-3000:]}')
  m = json.loads(lines[-1][len(_RESULT):])
  log = done.stderr.split('MEASURED\n', 1)[1]
  session_grappler, _ = _grappler(log, m['graph'], m['session'])
  run_grappler, passes = _grappler(log, m['session'], m['after1'])
  t = dict(first_step=m['after1'] - m['start'], first_step_cpu=m['after1_cpu'] - m['start_cpu'],
           graph=m['graph'] - m['start'], model_fn=m['model_fn'],
           session=m['session'] - m['graph'], session_grappler=session_grappler,
           first_run=m['after1'] - m['session'], run_grappler=run_grappler,
           step=m['after2'] - m['before2'])
  t['run_rest'] = t['first_run'] - t['run_grappler'] - t['step']
  for phase, begin, end in (('graph', 'start', 'graph'), ('session', 'graph', 'session'),
                            ('first_run', 'session', 'after1')):
    t[phase + '_cpu'] = m[end + '_cpu'] - m[begin + '_cpu']
  return t, passes


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  absl_logging.set_verbosity(absl_logging.ERROR)
  if FLAGS.measure:
    _measure_and_exit(FLAGS.measure)
  specs = FLAGS.parts_contenders
  times = {s: [] for s in specs}
  passes = {s: collections.Counter() for s in specs}
  print(f'# {tb.load()} at start; {FLAGS.model}, {FLAGS.build_rounds} rounds', flush=True)
  for r in range(FLAGS.build_rounds):
    for spec in (specs if r % 2 == 0 else specs[::-1]):
      t, p = parts(spec)
      times[spec].append(t)
      passes[spec].update(p)
      print(f'round {r} {spec}: ' + ', '.join(f'{k} {t[k]:.2f}' for k in _KEYS), flush=True)
  print(f'\n# {tb.load()} at end; medians of {FLAGS.build_rounds} rounds, wall seconds '
        f'(first step CPU: process CPU seconds)\n')
  print('| contender | ' + ' | '.join(k.replace('_', ' ') for k in _KEYS) + ' |')
  print('|---' * (len(_KEYS) + 1) + '|')
  for spec in specs:
    print(f'| {spec} | ' + ' | '.join(
        f'{statistics.median(t[k] for t in times[spec]):.2f}' for k in _KEYS) + ' |')
  plain = specs[0]
  for spec in specs[1:]:
    ratios = [t['first_step_cpu'] / p['first_step_cpu'] for t, p in zip(times[spec], times[plain])]
    print(f'\n{spec} / {plain}, first step CPU, per round: '
          f'{", ".join(f"{x:.2f}" for x in ratios)} (median {statistics.median(ratios):.2f})')
  for spec in specs:
    rounds = FLAGS.build_rounds
    print(f'{spec} first run, grappler passes (mean s): ' + ', '.join(
        f'{k} {v / rounds:.3f}' for k, v in passes[spec].most_common(8)))
  sys.stdout.flush()
  os._exit(0)  # pylint: disable=protected-access


if __name__ == '__main__':
  app.run(main)
