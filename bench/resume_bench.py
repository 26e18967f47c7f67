"""What saving the training input's position costs: resume time and checkpoint bytes.

A towered Estimator (--num_cpu_devices virtual CPU devices, a linear model of
4 weights: its steps cost next to nothing) reads `from_tensor_slices` of
--num_records records {x: float32[4], label: int64} (24 bytes each),
`shuffle(--buffer, seed)`, `repeat()`, a `map` doing --map_work arithmetic
per record (a chain of small matrix products, so that reading the input again
costs visibly) and `batch(--batch_size)`.

1. Resume time. It trains once to step --early_step and once to step
   --late_step (each a checkpoint holding the variables and the input's
   position), then, --repeats times in turns, resumes each on a fresh copy of
   its model_dir: `estimator.train(input_fn, max_steps=step + 1)`, timed in
   this process from the call to its return (building the graph, creating the
   session with the restore, Estimator's checkpoint at the session's start,
   the first step, the checkpoint at the end). It prints the median of each
   phase (a hook's `begin`, `after_create_session`, first `after_run`), the
   restore itself (the Saver's `restore`, variables and input position), and
   the ratio late / early of the whole call and of the restore. For contrast,
   the replay a run without a saved position would need to reach the same
   place: `resume_input=False` and the input_fn's dataset followed by
   `.skip(--late_step)` (batches), resumed from the same checkpoint.

2. Checkpoint bytes. Short trainings (--size_steps steps) unstaged with
   `shuffle(b)` for each b of --buffers, and staged with staging depth
   --staging_depth: the bytes of each `input_position/*` key
   (`tf.train.load_checkpoint`: the length of the serialized tensors), the
   checkpoint's .data files against the same run with `resume_input=False`,
   the bytes per buffered record, and what the staged batches (the pending
   global batches) add.

  nice python bench/resume_bench.py       # 2 virtual CPUs, 10 against 10,000 steps (~1.5 min)
  python bench/resume_bench.py --late_step=1000 --repeats=3 --buffers=10000   # a quick run
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # pylint: disable=wrong-import-position
import estimator_towers as et  # pylint: disable=wrong-import-position
from estimator_towers.inputs import position  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_integer('num_cpu_devices', 2, 'Towers on this many virtual CPU devices.')
flags.DEFINE_integer('num_records', 20000, 'Records of the dataset (repeated).')
flags.DEFINE_integer('buffer', 10000, 'The shuffle buffer of the resume-time runs.')
flags.DEFINE_integer('batch_size', 32, 'Global batch size.')
flags.DEFINE_integer('map_work', 16, 'Per record, three products of [n, n] matrices in the '
                     'map (0: no map).')
flags.DEFINE_integer('early_step', 10, 'The early checkpoint\'s step.')
flags.DEFINE_integer('late_step', 10000, 'The late checkpoint\'s step.')
flags.DEFINE_integer('repeats', 7, 'Timed resumes of each checkpoint (medians reported).')
flags.DEFINE_integer('replay_repeats', 2, 'Timed replays (in the first rounds).')
flags.DEFINE_list('buffers', ['1000', '10000'], 'Shuffle buffers whose checkpoint bytes '
                  'are read.')
flags.DEFINE_integer('staging_depth', 2, 'Staging depth of the staged checkpoint.')
flags.DEFINE_integer('size_steps', 5, 'Steps of each checkpoint-size run.')
flags.DEFINE_integer('seed', 7, 'The shuffle\'s seed.')

RECORD_BYTES = 4 * 4 + 8  # x: float32[4], label: int64


def records() -> tuple[dict, np.ndarray]:
  rng = np.random.RandomState(0)
  x = rng.randn(FLAGS.num_records, 4).astype(np.float32)
  label = rng.randint(0, 100, FLAGS.num_records).astype(np.int64)
  return {'x': x}, label


def work(features: dict, label: tf.Tensor) -> tuple[dict, tf.Tensor]:
  """Per-record arithmetic (the result changes x by less than float32 rounding)."""
  n = FLAGS.map_work
  a = tf.reshape(tf.tile(features['x'], [n * n // 4 + 1])[:n * n], [n, n]) * 0.1
  for _ in range(3):
    a = tf.matmul(a, a) / float(n)
  return {'x': features['x'] + 1e-30 * tf.reduce_sum(a)}, label


def make_input_fn(buffer: int, skip: int = 0):
  def input_fn():
    dataset = tf.data.Dataset.from_tensor_slices(records())
    dataset = dataset.shuffle(buffer, seed=FLAGS.seed).repeat()
    if FLAGS.map_work:
      dataset = dataset.map(work)
    dataset = dataset.batch(FLAGS.batch_size)
    return dataset.skip(skip) if skip else dataset
  return input_fn


def model_fn(features, labels, mode):
  w = tf.compat.v1.get_variable('w', [4], initializer=tf.compat.v1.zeros_initializer())
  prediction = tf.reduce_sum(features['x'] * w, 1)
  loss = tf.reduce_mean(tf.square(prediction - tf.cast(labels, tf.float32) / 100.0))
  train_op = tf.compat.v1.train.GradientDescentOptimizer(1e-3).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def make_plan(resume_input: bool = True, staging_depth: int = 0) -> et.DevicePlan:
  return et.make_plan(devices=[f'/cpu:{i}' for i in range(FLAGS.num_cpu_devices)],
                      staging_depth=staging_depth, resume_input=resume_input)


def estimator(model_dir: str, plan: et.DevicePlan | None = None) -> tf.estimator.Estimator:
  plan = plan or make_plan()
  config = tf.estimator.RunConfig(
      model_dir=model_dir, save_checkpoints_steps=10**9, save_summary_steps=10**9,
      log_step_count_steps=10**9,
      session_config=tf.compat.v1.ConfigProto(device_count={'CPU': FLAGS.num_cpu_devices}))
  return tf.estimator.Estimator(et.replicate_model_fn(model_fn, plan=plan), config=config)


# --- 1. Resume time -----------------------------------------------------------

class Phases(tf.compat.v1.train.SessionRunHook):
  """perf_counter at the graph's end (begin), the session's start and the first step's end."""

  def __init__(self):
    self.times = {}

  def begin(self):
    self.times['graph'] = time.perf_counter()

  def after_create_session(self, session, coord):
    self.times['session'] = time.perf_counter()

  def after_run(self, run_context, run_values):
    self.times.setdefault('step', time.perf_counter())


class SaverTimer:
  """Seconds in the outermost Saver.restore and Saver.save calls while it is installed."""

  def __init__(self):
    self.seconds = {'restore': 0.0, 'save': 0.0}
    self._depth = 0
    self._saved = []

  def _wrap(self, name, original):
    def method(saver, *args, **kwargs):
      self._depth += 1
      start = time.perf_counter()
      try:
        return original(saver, *args, **kwargs)
      finally:
        self._depth -= 1
        if not self._depth:
          self.seconds[name] += time.perf_counter() - start
    return method

  def __enter__(self):
    for cls in (tf.compat.v1.train.Saver, position.PositionSaver):
      for name in self.seconds:
        if name in cls.__dict__:
          self._saved.append((cls, name, cls.__dict__[name]))
          setattr(cls, name, self._wrap(name, cls.__dict__[name]))
    return self

  def __exit__(self, *unused):
    for cls, name, original in self._saved:
      setattr(cls, name, original)


def resume_once(model_dir: str, step: int, replay: bool) -> dict:
  """Seconds of each phase of train(max_steps=step + 1) on a copy of `model_dir`."""
  copy = tempfile.mkdtemp(prefix='resume_bench_')
  shutil.rmtree(copy)
  shutil.copytree(model_dir, copy)
  input_fn = make_input_fn(FLAGS.buffer, skip=step if replay else 0)
  hook = Phases()
  est = estimator(copy, make_plan(resume_input=not replay))
  with SaverTimer() as saver:
    start = time.perf_counter()
    est.train(input_fn, max_steps=step + 1, hooks=[hook])
    end = time.perf_counter()
  assert est.get_variable_value('global_step') == step + 1
  shutil.rmtree(copy, ignore_errors=True)
  t = hook.times
  return {'graph': t['graph'] - start, 'session': t['session'] - t['graph'],
          'step': t['step'] - t['session'], 'end': end - t['step'], 'total': end - start,
          'restore': saver.seconds['restore'], 'saves': saver.seconds['save']}


def resume_time() -> None:
  print(f'\n## 1. Resume time: train(max_steps=step + 1) on a copy of the checkpoint at step')
  dirs = {}
  for step in (FLAGS.early_step, FLAGS.late_step):
    dirs[step] = tempfile.mkdtemp(prefix=f'resume_bench_{step}_')
    start = time.perf_counter()
    estimator(dirs[step]).train(make_input_fn(FLAGS.buffer), max_steps=step)
    print(f'(trained to step {step:,} in {time.perf_counter() - start:.1f} s)', flush=True)
  cases = [(f'resume at {FLAGS.early_step:,}', FLAGS.early_step, False),
           (f'resume at {FLAGS.late_step:,}', FLAGS.late_step, False),
           (f'replay to {FLAGS.late_step:,}', FLAGS.late_step, True)]
  runs = {name: [] for name, _, _ in cases}
  for r in range(FLAGS.repeats):
    done = []
    for name, step, replay in (cases if r % 2 == 0 else cases[::-1]):
      if not replay or r < FLAGS.replay_repeats:
        runs[name].append(resume_once(dirs[step], step, replay))
        done.append(f'{name} {runs[name][-1]["total"]:.2f} s')
    print(f'round {r}: ' + ', '.join(done), flush=True)
  phases = ('graph', 'session', 'restore', 'step', 'end', 'saves', 'total')
  print('\nmedian seconds (graph: the model_fn and input_fn built; session: created, with '
        'the restore and Estimator\'s checkpoint at its start; restore: the Saver\'s restore, '
        'part of session; step: the first step; end: to train()\'s return, the last '
        'checkpoint; saves: both checkpoints\' Saver.save)')
  print(f'{"":22s}{"resumes":>8s}' + ''.join(f'{p:>9s}' for p in phases))
  median = {name: {p: statistics.median(r[p] for r in runs[name]) for p in phases}
            for name in runs}
  for name in runs:
    print(f'{name:22s}{len(runs[name]):8d}' + ''.join(f'{median[name][p]:9.3f}' for p in phases))
  early, late, replay = (median[name] for name, _, _ in cases)
  print(f'\nresume at {FLAGS.late_step:,} / resume at {FLAGS.early_step:,}: whole call '
        f'{late["total"] / early["total"]:.2f}x (requirement: <= 1.2x), restore '
        f'{late["restore"] / early["restore"]:.2f}x')
  print(f'replay of {FLAGS.late_step:,} batches instead (resume_input=False, '
        f'dataset.skip({FLAGS.late_step})): whole call {replay["total"]:.2f} s, '
        f'{replay["total"] / late["total"]:.1f}x the positioned resume; its first step '
        f'{replay["step"]:.2f} s against {late["step"]:.3f} s')
  for d in dirs.values():
    shutil.rmtree(d, ignore_errors=True)


# --- 2. Checkpoint bytes --------------------------------------------------------

def checkpoint_bytes(buffer: int, resume_input: bool, staging_depth: int = 0) -> dict:
  """{key: (bytes, rows)} of the input_position/* keys, and the .data files' bytes ('.data').

  A key's bytes: the length of its serialized string(s); rows: pending's global batches.
  """
  model_dir = tempfile.mkdtemp(prefix='resume_bench_size_')
  plan = make_plan(resume_input, staging_depth)
  input_fn = make_input_fn(buffer)
  if staging_depth:
    input_fn = et.staged_input_fn(input_fn, plan)
  estimator(model_dir, plan).train(input_fn, max_steps=FLAGS.size_steps)
  path = tf.train.latest_checkpoint(model_dir)
  reader = tf.train.load_checkpoint(path)
  out = {'.data': (sum(os.path.getsize(f) for f in glob.glob(path + '.data-*')), 0)}
  for name in ('iterator', 'pending', 'fingerprint'):
    key = f'{position.NAME}/{name}'
    if reader.has_tensor(key):
      value = np.asarray(reader.get_tensor(key), dtype=object)
      out[name] = (sum(len(v) for v in value.flat), value.shape[0] if value.ndim else 1)
  shutil.rmtree(model_dir, ignore_errors=True)
  return out


def sizes() -> None:
  print(f'\n## 2. Checkpoint bytes: records of {RECORD_BYTES} bytes {{x: float32[4], '
        f'label: int64}}, batch {FLAGS.batch_size}, after {FLAGS.size_steps} steps')
  cases = [(f'shuffle({b}), unstaged', int(b), 0) for b in FLAGS.buffers]
  cases.append((f'shuffle({cases[-1][1]}), staged depth {FLAGS.staging_depth}', cases[-1][1],
                FLAGS.staging_depth))
  print(f'{"":34s}{"iterator":>11s}{"pending":>9s}{"batches":>8s}{"fingerprint":>12s}'
        f'{".data":>11s}{"without":>9s}{"added":>11s}   (bytes; without: resume_input=False)')
  got = {}
  for name, buffer, depth in cases:
    got[name] = w = checkpoint_bytes(buffer, True, depth)
    without = checkpoint_bytes(buffer, False, depth)['.data'][0]
    iterator, pending, fingerprint = (w.get(k, (0, 0)) for k in ('iterator', 'pending',
                                                                 'fingerprint'))
    print(f'{name:34s}{iterator[0]:11,d}{pending[0]:9,d}{pending[1]:8d}{fingerprint[0]:12,d}'
          f'{w[".data"][0]:11,d}{without:9,d}{w[".data"][0] - without:11,d}')
  (first, b0, _), (last, b1, _), (staged, _, _) = cases[0], cases[-2], cases[-1]
  state = lambda name: got[name]['iterator'][0]
  print(f'\nper buffered record: {state(last) / b1:.1f} bytes of iterator state at '
        f'shuffle({b1}) ({state(last) / b1 / RECORD_BYTES:.1f}x the record\'s {RECORD_BYTES} '
        f'bytes)' + (f'; from shuffle({b0}) to shuffle({b1}): '
                     f'{(state(last) - state(first)) / (b1 - b0):.1f} bytes per added record'
                     if b1 != b0 else ''))
  size, batches = got[staged]['pending']
  print(f'staging depth {FLAGS.staging_depth}: {batches} pending global batches, {size:,} bytes '
        f'({size / max(batches, 1):,.0f} per batch of {FLAGS.batch_size} records, '
        f'{size / max(batches, 1) / FLAGS.batch_size:.1f} per record)')


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  logging.set_verbosity(logging.ERROR)
  benchlib.print_header(
      f'{FLAGS.num_cpu_devices} virtual CPU towers, linear model of 4 weights, '
      f'from_tensor_slices of {FLAGS.num_records:,} records, shuffle({FLAGS.buffer}, '
      f'seed).repeat(), map of {FLAGS.map_work}x{FLAGS.map_work} products x3, '
      f'batch({FLAGS.batch_size})')
  start = time.perf_counter()
  resume_time()
  sizes()
  print(f'\n(bench wall time {time.perf_counter() - start:.0f} s)')


if __name__ == '__main__':
  app.run(main)
