"""How often TensorFlow's own k-means reads its cluster counts before their update.

TensorFlow's mini-batch k-means (`tf.compat.v1.estimator.experimental.KMeans`)
gathers the cluster counts n for its learning rate 1 / (n + k) with no edge
to the scatter-add that adds the batch's counts k, so in a plain v1 graph the
gather may see the counts before the update (1 / (n + k), as its code's
comment states the algorithm) or after it (1 / (n + 2k)), by the executor's
scheduling. The library trains such a model_fn (no gradient request) on the
whole batch on tower 0 and orders every read of a variable before the updates
of it created after the read (`estimator_towers/ordering.py`).

This script starts every run from one checkpoint (clusters initialised by one
plain step), trains --steps steps on the same batches, and names the result
by which learning rate each step used: 'o' when the step read the old counts,
'u' when it read the updated ones (a string like 'oou' per run; '?' when the
result matches no such pattern). It does so --runs times for

  plain       the plain Estimator, --inter_op threads (the suite's setting: 2);
  plain_1     the plain Estimator, one inter-op thread;
  towered     replicate_model_fn over --num_devices virtual CPUs, --inter_op.

and prints, per configuration, how many runs gave each pattern.

  PYTHONPATH=. python bench/kmeans_race.py      # ~5 min on 2 cores
"""

from __future__ import annotations

import collections
import datetime
import itertools
import shutil
import tempfile

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

import estimator_towers as et
from benchlib import machine  # pylint: disable=g-import-not-at-top

_RUNS = flags.DEFINE_integer('runs', 20, 'Trainings per configuration.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Steps per training.')
_INTER_OP = flags.DEFINE_integer('inter_op', 2, 'Inter-op threads (plain and towered).')
_NUM_DEVICES = flags.DEFINE_integer('num_devices', 3, 'Virtual CPU towers.')

_BATCH = 7
_NUM_CLUSTERS = 3
_NUM_FEATURES = 5


def _x() -> np.ndarray:
  return np.random.RandomState(7).randn(2 * _BATCH, _NUM_FEATURES).astype(np.float32)


def _input_fn():
  return tf.data.Dataset.from_tensor_slices(_x()).repeat().batch(_BATCH)


def _config(num_cpus: int, inter_op: int) -> tf.estimator.RunConfig:
  return tf.estimator.RunConfig(
      session_config=tf.compat.v1.ConfigProto(
          device_count={'CPU': num_cpus}, inter_op_parallelism_threads=inter_op,
          intra_op_parallelism_threads=1),
      save_checkpoints_steps=1000, save_summary_steps=1000, log_step_count_steps=1000)


def _kmeans(config, model_dir):
  return tf.compat.v1.estimator.experimental.KMeans(
      _NUM_CLUSTERS, config=config, model_dir=model_dir, seed=1)


def _steps(centres, counts, batches, pattern: str) -> np.ndarray:
  """Mini-batch k-means in float64; step i reads old ('o') or updated ('u') counts."""
  centres, counts = centres.astype(np.float64), counts.astype(np.float64)
  for batch, reads in zip(batches, pattern):
    batch = batch.astype(np.float64)
    nearest = ((batch[:, None, :] - centres[None]) ** 2).sum(-1).argmin(1)
    new = centres.copy()
    for j in range(len(centres)):
      members = batch[nearest == j]
      k = len(members)
      if k:
        n = counts[j] + (k if reads == 'u' else 0)
        new[j] += (members.sum(0) - k * centres[j]) / (n + k)
        counts[j] += k
    centres = new
  return centres


def _pattern(clusters: np.ndarray, references: dict) -> str:
  for pattern, want in references.items():
    if np.all(np.abs(clusters - want) <= 1e-5 * np.maximum(1, np.abs(want))):
      return pattern
  return '?'


def _train(start_dir: str, towered: bool, inter_op: int) -> np.ndarray:
  model_dir = tempfile.mkdtemp(prefix='et_kmeans_race_')
  shutil.rmtree(model_dir)
  shutil.copytree(start_dir, model_dir)
  num_cpus = _NUM_DEVICES.value if towered else 1
  config = _config(num_cpus, inter_op)
  estimator = _kmeans(config, model_dir)
  if towered:
    estimator = tf.estimator.Estimator(
        et.replicate_model_fn(estimator.model_fn,
                              devices=[f'/cpu:{i}' for i in range(num_cpus)]),
        model_dir=model_dir, config=config)
  estimator.train(_input_fn, steps=_STEPS.value)
  clusters = estimator.get_variable_value('clusters')
  shutil.rmtree(model_dir)
  return clusters


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  start_dir = tempfile.mkdtemp(prefix='et_kmeans_race_start_')
  start = _kmeans(_config(1, _INTER_OP.value), start_dir)
  start.train(_input_fn, steps=1)
  counts_name = [n for n in start.get_variable_names()
                 if n not in ('clusters', 'initialized', 'global_step')][0]
  centres, counts = start.get_variable_value('clusters'), start.get_variable_value(counts_name)
  x = _x()
  # The start step consumed batch 0; train() restarts the input: 0, 1, 0, 1, ...
  batches = [x[:_BATCH] if i % 2 == 0 else x[_BATCH:] for i in range(_STEPS.value)]
  references = {''.join(p): _steps(centres, counts, batches, p)
                for p in itertools.product('ou', repeat=_STEPS.value)}

  print(f'{datetime.date.today()}, {machine()}')
  print(f'{_RUNS.value} runs of {_STEPS.value} steps, batch {_BATCH}, '
        f'{_NUM_CLUSTERS} clusters; o = read the old counts (1 / (n + k)), '
        f'u = the updated ones (1 / (n + 2k))')
  for name, towered, inter_op in [('plain', False, _INTER_OP.value),
                                  ('plain_1', False, 1),
                                  ('towered', True, _INTER_OP.value)]:
    seen = collections.Counter(
        _pattern(_train(start_dir, towered, inter_op), references)
        for _ in range(_RUNS.value))
    print(f'{name:8s} inter_op={inter_op}  distinct results: {len(seen)}  '
          + '  '.join(f'{p}: {c}' for p, c in sorted(seen.items())), flush=True)
  shutil.rmtree(start_dir)


if __name__ == '__main__':
  app.run(main)
