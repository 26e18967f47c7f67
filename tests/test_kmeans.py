"""Issue 16: towered k-means training is exact and deterministic.

TensorFlow's canned `KMeans` trains without gradients, so the library trains
it on the whole batch on tower 0's device. Its mini-batch update gathers the
old cluster counts n for the learning rate 1 / (n + k) and scatter-adds the
new counts with no edge between the two ops, so in a plain graph the gather
sometimes sees the updated counts (a learning rate of 1 / (n + 2k)): plain
k-means itself is not deterministic (`bench/kmeans_race.py`: 30 plain runs of
3 steps from one checkpoint gave 4 different results with two inter-op
threads, 6 with one; each step read the old or the updated counts by chance).
The plain Estimator is therefore no
reference here; the reference is mini-batch k-means as its code states it
(`clustering_ops._mini_batch_training_op`'s comment), computed in numpy from
the same checkpoint and batches: assign each example to its nearest centre,
then c_j += (sum of its k examples - k c_j) / (n_j + k) and n_j += k.

Each of 12 fresh towered trainings (3 steps, 3 towers, batches of 7 split
3/2/2) must equal it; a single racy step fails the test. Next to each, a plain
training from the same checkpoint must equal the same computation with each
step reading either the old or the updated counts (one of 2^3 results): that
checks the numpy reference against plain every time, and that towered gives
the result plain gives when its reads come first.
"""

import collections
import itertools
import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn

BATCH = 7
NUM_CLUSTERS = 3
NUM_DEVICES = 3
STEPS = 3
RUNS = 8


def _x():
  return np.random.RandomState(7).randn(2 * BATCH, testlib.NUM_FEATURES).astype(np.float32)


def _input_fn():
  return tf.data.Dataset.from_tensor_slices(_x()).repeat().batch(BATCH)


def _kmeans(config, model_dir):
  return tf.compat.v1.estimator.experimental.KMeans(
      NUM_CLUSTERS, config=config, model_dir=model_dir, seed=1)


def _start():
  """A checkpoint with initialised clusters (one plain step), and its values."""
  model_dir = tempfile.mkdtemp(prefix='et_kmeans_')
  plain = _kmeans(testlib.run_config(1), model_dir)
  plain.train(_input_fn, steps=1)
  return model_dir, testlib.variables(plain)


def _copy(model_dir):
  copy = tempfile.mkdtemp(prefix='et_kmeans_')
  shutil.rmtree(copy)
  shutil.copytree(model_dir, copy)
  return copy


def test_towered_kmeans_equals_minibatch_kmeans_every_time():
  start_dir, start = _start()
  counts_name = [n for n in start if n not in ('clusters', 'initialized', 'global_step')]
  assert len(counts_name) == 1, sorted(start)
  x = _x()
  # The plain step consumed batch 0; train() restarts the input: 0, 1, 0.
  batches = [x[:BATCH], x[BATCH:], x[:BATCH]]
  want_centres, want_counts = testlib.minibatch_kmeans_steps(
      start['clusters'], start[counts_name[0]], batches)
  assert not np.allclose(want_centres, start['clusters'])

  outcomes = {''.join(p): testlib.minibatch_kmeans_steps(
      start['clusters'], start[counts_name[0]], batches, reads=''.join(p))[0]
                for p in itertools.product('ou', repeat=STEPS)}
  plain_seen = collections.Counter()
  config = testlib.run_config(NUM_DEVICES)
  for run in range(RUNS):
    model_dir = _copy(start_dir)
    plain = _kmeans(testlib.run_config(1), model_dir)
    plain.train(_input_fn, steps=STEPS)
    got_plain = plain.get_variable_value('clusters')
    matches = [p for p, want in outcomes.items() if _close(got_plain, want)]
    assert matches, f'run {run}: plain matches none of {sorted(outcomes)}'
    plain_seen[matches[0]] += 1
    shutil.rmtree(model_dir)

    model_dir = _copy(start_dir)
    canned = _kmeans(config, model_dir)
    towered = tf.estimator.Estimator(
        replicate_model_fn(canned.model_fn, devices=testlib.cpu_devices(NUM_DEVICES)),
        model_dir=model_dir, config=config)
    towered.train(_input_fn, steps=STEPS)
    got = testlib.variables(towered)
    assert got['global_step'] == start['global_step'] + STEPS
    testlib.assert_close(got['clusters'], want_centres, err_msg=f'run {run}: clusters')
    testlib.assert_close(got[counts_name[0]], want_counts, tol=0,
                         err_msg=f'run {run}: counts')
    shutil.rmtree(model_dir)
  assert os.path.isdir(start_dir)
  print('plain k-means, which counts each step read:', dict(plain_seen))


def _close(actual, expected) -> bool:
  try:
    testlib.assert_close(actual, expected)
  except AssertionError:
    return False
  return True
