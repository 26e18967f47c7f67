"""The CIFAR-10 example's training input resumes with its position, and its draws are keyed.

Reference: an uninterrupted run of the example's model_fn and input_fn (as
examples/cifar10/train.py builds them: two towers, staged input). A run
stopped mid-epoch and resumed by a second `train()` call must end with every
variable of the uninterrupted run, and no "cannot be positioned" warning.
The augmentation's draws are checked against the stateless ops called
directly with the seed the docstring names (example index, stream position).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import tensorflow as tf

import estimator_towers as et
import testlib

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           os.pardir, 'examples', 'cifar10')
sys.path.insert(0, EXAMPLE_DIR)
import data as cifar_data  # pylint: disable=g-import-not-at-top,wrong-import-position
import model as cifar_model  # pylint: disable=g-import-not-at-top,wrong-import-position

BATCH = 8
STOP, END = 2, 4  # steps of the first train() call, and of both; an epoch is 6250 steps
PARAMS = {'resnet_depth': 8, 'batch_size': BATCH, 'train_steps': END, 'seed': 0,
          'log_every_n_steps': 1}


def _estimator(model_dir: str) -> tuple:
  """The example's towered Estimator (2 towers on virtual CPUs) and its training input_fn."""
  towers = et.make_config(num_cpu_devices=2, intra_op_threads=1, inter_op_threads=2)
  run_config = et.make_run_config(towers, model_dir=model_dir, tf_random_seed=0,
                                  save_checkpoints_steps=END, log_step_count_steps=1)
  model_fn = et.replicate_model_fn(cifar_model.model_fn, plan=towers.plan)
  estimator = tf.estimator.Estimator(model_fn, config=run_config, params=PARAMS)
  input_fn = cifar_data.make_input_fn(cifar_data.Synthetic(), True, BATCH)
  return estimator, et.staged_input_fn(input_fn, plan=towers.plan)


def _variables(estimator) -> dict:
  return {name: estimator.get_variable_value(name) for name in estimator.get_variable_names()
          if not name.startswith(testlib.POSITION_PREFIX)}


def test_the_example_resumes_mid_epoch_exactly_without_a_warning(tmp_path, monkeypatch):
  found = testlib.logged_warnings(monkeypatch)
  whole, input_fn = _estimator(str(tmp_path / 'whole'))
  whole.train(input_fn, max_steps=END)

  resumed, input_fn = _estimator(str(tmp_path / 'resumed'))
  resumed.train(input_fn, max_steps=STOP)
  resumed, input_fn = _estimator(str(tmp_path / 'resumed'))  # a new process would do the same
  resumed.train(input_fn, max_steps=END)

  assert not [w for w in found if 'cannot be positioned' in w], found
  assert any(name.startswith(testlib.POSITION_PREFIX) for name in resumed.get_variable_names())
  assert resumed.get_variable_value('global_step') == END
  testlib.assert_variables_close(_variables(resumed), _variables(whole))


def _first_examples(count: int):
  """The training stream's first `count` (image, label) pairs, as numpy."""
  with tf.Graph().as_default():
    dataset = cifar_data.make_input_fn(cifar_data.Synthetic(), True, count)()
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    with tf.compat.v1.Session() as session:
      return session.run(batch)


def test_the_example_draws_by_the_example_and_its_place_in_the_stream():
  """The stream is the same on every read, and each image is the stateless crop and flip
  of its source example under the seed (index, position) given to the ops by hand."""
  images, labels = _first_examples(4)
  again, _ = _first_examples(4)
  np.testing.assert_array_equal(images, again)

  with tf.Graph().as_default():
    source = cifar_data.Synthetic().records(True).enumerate()
    shuffled = source.shuffle(cifar_data.SHUFFLE_BUFFER, seed=cifar_data.SHUFFLE_SEED).take(4)
    indexed = tf.compat.v1.data.make_one_shot_iterator(shuffled.batch(4)).get_next()
    with tf.compat.v1.Session() as session:
      indices, (raw, raw_labels) = session.run(indexed)
  np.testing.assert_array_equal(labels, raw_labels)

  for position, (index, image) in enumerate(zip(indices, raw)):
    key = tf.random.experimental.stateless_fold_in(
        tf.constant([cifar_data.AUGMENT_SEED, index], tf.int64), tf.constant(position, tf.int64))
    crop_seed, flip_seed = tf.random.experimental.stateless_split(key, 2)
    padded = np.pad(image.astype(np.float32), [(4, 4), (4, 4), (0, 0)])
    want = tf.image.stateless_random_flip_left_right(
        tf.image.stateless_random_crop(padded, [32, 32, 3], crop_seed), flip_seed).numpy()
    want = (want - want.mean()) / max(want.std(), 1 / np.sqrt(want.size))
    np.testing.assert_allclose(images[position], want, atol=1e-4)
