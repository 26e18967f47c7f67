"""What building a towered graph costs, in measures a loaded machine does not distort.

Wall-clock times to first step (bench/towers_bench.py, bench/sync_bn_bench.py)
stretch with every other job on the machine. This script prints, for
bench/towers_bench.py's models at N = --n (plain: one device):

1. the model_fn's graph construction: CPU seconds of the building thread
   (`time.thread_time`, which other processes do not inflate; median of
   --build_rounds builds, contenders interleaved), the graph's op count, and
   how long the garbage collector ran during each build (wall time; its full
   passes over a large heap take a few tenths of a second, at points the
   process's history decides);
2. the CPU seconds of importing that same graph from its GraphDef
   (`tf.graph_util.import_graph_def` into an empty graph, median of the
   builds): what building it would cost if its ops were copied instead of
   built op by op in Python (the floor of building one tower and instancing
   it for the others);
3. the executed graph of a training step: the partition graphs TensorFlow
   runs (after grappler), their node count and node types
   (`RunOptions(output_partition_graphs=True)`; with --show_types, the
   histogram), which tells whether a change to graph construction changed
   what a step executes.

  python bench/build_cost.py --model=resnet --n=8 --profile_contenders=plain,towered,synced
  # the readers following every tower's part of a sync point's table (as before
  # `base.tower_parts`), against their own tower's part only:
  python bench/build_cost.py --model=resnet --n=8 \
      --profile_contenders=synced,synced_every_part --build_rounds=7
  PYTHONPATH=<other checkout> python bench/build_cost.py ...   # the same for another build
"""

from __future__ import annotations

import collections
import contextlib
import gc
import statistics
import time

from absl import app
from absl import flags
from absl import logging as absl_logging
import tensorflow as tf

from estimator_towers.base import tower_parts
import benchlib
import towers_bench as tb

flags.DEFINE_string('model', 'resnet', 'mlp, resnet or bert (bench/bert_pretraining.py).')
flags.DEFINE_integer('n', 8, 'Devices of the towered contenders.')
flags.DEFINE_list('profile_contenders', ['plain', 'towered', 'synced'], 'Contenders (and '
                  'synced_every_part: synced, with the row reader and the loss algebra '
                  'following every tower\'s part of a sync point\'s table).')
flags.DEFINE_bool('show_types', False, 'Print the executed graph\'s node types.')
FLAGS = flags.FLAGS


def build_seconds(contender: str) -> tuple[float, int, float, float]:
  """CPU seconds of the model_fn call building a TRAIN graph, its ops, CPU seconds to import
  it, and the seconds of garbage collection during the model_fn call."""
  n = 1 if contender == 'plain' else FLAGS.n
  estimator, input_fn = tb.make_estimator(FLAGS.model, _built(contender), n, {})
  with _every_part(contender), tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    batch = tf.compat.v1.data.make_one_shot_iterator(input_fn()).get_next()
    features, labels = batch if isinstance(batch, tuple) else (batch, None)  # bert: no labels
    gc.collect()   # each build from a collected heap: earlier builds' garbage is not its cost
    start = time.thread_time()
    with benchlib.collections_timed() as collected:
      estimator._call_model_fn(features, labels, tf.estimator.ModeKeys.TRAIN,  # pylint: disable=protected-access
                               estimator.config)
    seconds = time.thread_time() - start
  graph_def = graph.as_graph_def()
  with tf.Graph().as_default():
    start = time.thread_time()
    tf.graph_util.import_graph_def(graph_def, name='')
    imported = time.thread_time() - start
  return seconds, len(graph.get_operations()), imported, collected[0]


def _built(contender: str) -> str:
  return 'synced' if contender == 'synced_every_part' else contender


@contextlib.contextmanager
def _every_part(contender: str):
  """For synced_every_part: walks over one tower's graph follow every part of a table."""
  if contender != 'synced_every_part':
    yield
    return
  others = tower_parts.others
  tower_parts.others = lambda graph, names: None
  try:
    yield
  finally:
    tower_parts.others = others


class _Partitions(tf.compat.v1.train.SessionRunHook):
  """The partition graphs of the second step."""

  def __init__(self):
    self.step, self.graphs = 0, None

  def before_run(self, run_context):
    self.step += 1
    if self.step == 2:
      return tf.compat.v1.train.SessionRunArgs(None, options=tf.compat.v1.RunOptions(
          output_partition_graphs=True))
    return None

  def after_run(self, run_context, run_values):
    if self.step == 2:
      self.graphs = run_values.run_metadata.partition_graphs


def executed(contender: str) -> collections.Counter:
  """Node types of the graphs a training step executes."""
  n = 1 if contender == 'plain' else FLAGS.n
  estimator, input_fn = tb.make_estimator(FLAGS.model, _built(contender), n, {})
  hook = _Partitions()
  with _every_part(contender):
    estimator.train(input_fn, steps=3, hooks=[hook])
  return collections.Counter(node.op for graph in hook.graphs for node in graph.node)


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  absl_logging.set_verbosity(absl_logging.ERROR)
  contenders = FLAGS.profile_contenders
  build_seconds('towered')  # one-off costs
  times = {c: [] for c in contenders}
  for r in range(FLAGS.build_rounds):
    for contender in (contenders if r % 2 == 0 else contenders[::-1]):
      times[contender].append(build_seconds(contender))
  print(f'# {tb.load()}; {FLAGS.model}, N={FLAGS.n} (plain: 1), {FLAGS.build_rounds} builds\n')
  print('| contender | model_fn CPU s (median) | of which garbage collection (s: each build) | '
        'graph ops | whole graph imported, CPU s (median) | executed nodes per step |')
  print('|---|---|---|---|---|---|')
  for contender in contenders:
    types = executed(contender)
    print(f'| {contender} | {statistics.median(t[0] for t in times[contender]):.3f} | '
          f'{" / ".join(f"{t[3]:.3f}" for t in times[contender])} | '
          f'{times[contender][0][1]:,} | '
          f'{statistics.median(t[2] for t in times[contender]):.3f} | '
          f'{sum(types.values()):,} |', flush=True)
    if FLAGS.show_types:
      print('  ' + ', '.join(f'{k} {v}' for k, v in sorted(types.items())))


if __name__ == '__main__':
  app.run(main)
