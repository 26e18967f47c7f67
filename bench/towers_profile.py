"""Where a training step's time goes, per contender, from step stats.

Trains each contender of bench/towers_bench.py (same models, same input;
--contenders) with Estimator, traces --steps steps after a warm-up
(`RunOptions(trace_level=FULL_TRACE)`, `RunMetadata.step_stats`) and prints,
per contender, the untraced step time, the ops executed per step and, per op
type, the ops' own time summed over devices (milliseconds per step), largest
first. Own times of ops that run at once on a shared CPU overlap: compare
their sums between contenders, not with the step time. Also per contender:
how much of a traced step has at least one and at least two ops running (on
two cores, the rest is a core idle), and for synchronised batch norm the
forward sync points' latency: from the last tower's statistics row to the
first tower's normalisation (`batch_norm_sync`'s op names), per layer and
summed over a step.

  python bench/towers_profile.py --model=mlp --num_devices=4
  python bench/towers_profile.py --model=resnet --num_devices=8 --top=25
"""

from __future__ import annotations

import collections
import re
import statistics
import time

from absl import app
from absl import flags
from absl import logging as absl_logging
import tensorflow as tf

import towers_bench as bench

flags.DEFINE_string('model', 'mlp', 'mlp or resnet.')
flags.DEFINE_integer('n', 4, 'Devices of the towered and mirrored runs.')
flags.DEFINE_integer('steps', 20, 'Traced steps.')
flags.DEFINE_integer('timed_steps', 200, 'Untraced steps timed after the traced ones.')
flags.DEFINE_integer('top', 15, 'Op types listed per contender.')
flags.DEFINE_list('profile_contenders', ['plain', 'towered', 'handwritten', 'mirrored'],
                  'Contenders to profile.')
FLAGS = flags.FLAGS


class Tracer(tf.compat.v1.train.SessionRunHook):
  """Traces steps warmup+1 .. warmup+steps; times the untraced steps after them."""

  def __init__(self, warmup: int, steps: int, timed: int):
    self._warmup, self._steps, self._timed = warmup, steps, timed
    self.step = 0
    self.metadata = []
    self.start = self.stop = None

  def before_run(self, run_context):
    if self._warmup < self.step + 1 <= self._warmup + self._steps:
      return tf.compat.v1.train.SessionRunArgs(None, options=tf.compat.v1.RunOptions(
          trace_level=tf.compat.v1.RunOptions.FULL_TRACE))
    return None

  def after_run(self, run_context, run_values):
    self.step += 1
    if self._warmup < self.step <= self._warmup + self._steps:
      self.metadata.append(run_values.run_metadata)
    if self.step == self._warmup + self._steps:
      self.start = time.perf_counter()
    self.stop = time.perf_counter()


_TYPE = re.compile(r'= (\w+)\(')


def op_times(metadata: list) -> tuple[dict, dict, float]:
  """Per op type: (ms of own time per step, ops per step); per device ms; ops per step."""
  own = collections.defaultdict(float)
  count = collections.defaultdict(int)
  device = collections.defaultdict(float)
  for md in metadata:
    for dev in md.step_stats.dev_stats:
      for node in dev.node_stats:
        match = _TYPE.search(node.timeline_label)
        op_type = match.group(1) if match else node.node_name.split(':')[0]
        ms = node.op_end_rel_micros / 1000.0
        own[op_type] += ms
        count[op_type] += 1
        device[dev.device.split('/')[-1]] += ms
  steps = len(metadata)
  return ({k: (own[k] / steps, count[k] / steps) for k in own},
          {k: v / steps for k, v in device.items()}, sum(count.values()) / steps)


def concurrency(metadata: list) -> tuple[float, float]:
  """Median over steps: the shares of a traced step with >= 1 and >= 2 ops running."""
  shares = []
  for md in metadata:
    events = sorted((t, d) for dev in md.step_stats.dev_stats for node in dev.node_stats
                    if node.all_end_rel_micros > 0
                    for t, d in ((node.all_start_micros, 1),
                                 (node.all_start_micros + node.all_end_rel_micros, -1)))
    running, last, one, two = 0, events[0][0], 0, 0
    for t, d in events:
      one += (t - last) if running >= 1 else 0
      two += (t - last) if running >= 2 else 0
      running, last = running + d, t
    span = events[-1][0] - events[0][0]
    shares.append((one / span, two / span))
  return (statistics.median(a for a, _ in shares), statistics.median(b for _, b in shares))


def sync_point_latency(metadata: list) -> tuple[float, float] | None:
  """Median per forward sync point and per step (µs): last tower's row -> first normalisation."""
  per_point, per_step = [], []
  for md in metadata:
    nodes = [n for dev in md.step_stats.dev_stats for n in dev.node_stats]
    rows, normalised = collections.defaultdict(list), collections.defaultdict(list)
    for n in nodes:
      layer, _, op = n.node_name.rpartition('/SyncBatchNorm/')
      if not layer or layer.startswith('gradients'):
        continue
      layer = re.sub(r'^tower_\d+/', '', layer)
      if op == 'concat':
        rows[layer].append(n.all_start_micros + n.all_end_rel_micros)
      elif op == 'FusedBatchNormV3_1':
        normalised[layer].append(n.all_start_micros)
    gaps = [min(normalised[k]) - max(rows[k]) for k in rows if normalised.get(k)]
    if not gaps:
      return None
    per_point.extend(gaps)
    per_step.append(sum(gaps))
  return statistics.median(per_point), statistics.median(per_step)


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  absl_logging.set_verbosity(absl_logging.ERROR)
  strategies = {FLAGS.n: tf.distribute.MirroredStrategy(
      [f'/cpu:{i}' for i in range(FLAGS.n)])}
  for contender in FLAGS.profile_contenders:
    n = 1 if contender == 'plain' else FLAGS.n
    estimator, input_fn = bench.make_estimator(FLAGS.model, contender, n, strategies)
    tracer = Tracer(20, FLAGS.steps, FLAGS.timed_steps)
    estimator.train(input_fn, steps=20 + FLAGS.steps + FLAGS.timed_steps, hooks=[tracer])
    per_type, per_device, ops = op_times(tracer.metadata)
    step_ms = 1000 * (tracer.stop - tracer.start) / FLAGS.timed_steps
    total = sum(ms for ms, _ in per_type.values())
    print(f'\n== {FLAGS.model} {contender} N={n}: {step_ms:.2f} ms/step untraced, '
          f'{ops:.0f} ops/step, own time {total:.2f} ms/step; by device: '
          + ', '.join(f'{d} {ms:.2f}' for d, ms in sorted(per_device.items())))
    for op_type, (ms, k) in sorted(per_type.items(), key=lambda kv: -kv[1][0])[:FLAGS.top]:
      print(f'  {op_type:28s} {ms:7.3f} ms  {k:5.0f} ops')
    one, two = concurrency(tracer.metadata)
    print(f'  traced step with >= 1 op running: {one:.1%}, >= 2 ops: {two:.1%}')
    latency = sync_point_latency(tracer.metadata)
    if latency is not None:
      print(f'  forward sync point, last row -> first normalisation: {latency[0]:.0f} µs '
            f'(median), {latency[1] / 1000:.2f} ms per step')


if __name__ == '__main__':
  app.run(main)
