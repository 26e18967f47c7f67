"""The CIFAR-10 example: its data readers, its synthetic data and a short run.

References: the bytes the test writes itself (binary reader), a numpy
computation (standardization, nearest-class-mean learnability) and the plain
single-device model_fn's graph (checkpoint names of the towered trainer).
"""

from __future__ import annotations

import os
import sys

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           os.pardir, 'examples', 'cifar10')
sys.path.insert(0, EXAMPLE_DIR)
import data as cifar_data  # pylint: disable=g-import-not-at-top,wrong-import-position
import model as cifar_model  # pylint: disable=g-import-not-at-top,wrong-import-position
import train as cifar_train  # pylint: disable=g-import-not-at-top,wrong-import-position

PIXELS = 32 * 32


def read_all(make_dataset, limit: int | None = None) -> list:
  """Every element (at most `limit`) of make_dataset() as numpy, in graph mode."""
  elements = []
  with tf.Graph().as_default():
    dataset = make_dataset()
    if limit is not None:
      dataset = dataset.take(limit)
    next_element = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    with tf.compat.v1.Session() as session:
      while True:
        try:
          elements.append(session.run(next_element))
        except tf.errors.OutOfRangeError:
          return elements


def write_bin(path: str, labels, images_chw: np.ndarray) -> None:
  """CIFAR-10 binary records: a label byte, then 3072 bytes (R, G, B planes)."""
  with open(path, 'wb') as f:
    for label, image in zip(labels, images_chw):
      f.write(bytes([label]))
      f.write(image.astype(np.uint8).tobytes())


def expected_hwc(record_bytes: np.ndarray) -> np.ndarray:
  """Pixel (h, w) of channel c is byte c * 1024 + h * 32 + w of the image."""
  h, w, c = np.meshgrid(np.arange(32), np.arange(32), np.arange(3), indexing='ij')
  return record_bytes[c * PIXELS + h * 32 + w]


def random_records(count: int, seed: int):
  rng = np.random.RandomState(seed)
  labels = rng.randint(0, 10, size=count)
  images = rng.randint(0, 256, size=(count, 3 * PIXELS)).astype(np.uint8)
  return labels, images


def make_cifar_dir(root: str, nested: bool = False) -> tuple:
  """A fake CIFAR-10 directory: 2 records per training file, 3 for testing."""
  directory = os.path.join(root, cifar_data.EXTRACTED_DIR) if nested else root
  os.makedirs(directory, exist_ok=True)
  train = [random_records(2, seed) for seed in range(5)]
  for name, (labels, images) in zip(cifar_data.TRAIN_FILES, train):
    write_bin(os.path.join(directory, name), labels, images)
  test_labels, test_images = random_records(3, 99)
  write_bin(os.path.join(directory, 'test_batch.bin'), test_labels, test_images)
  train_labels = np.concatenate([labels for labels, _ in train])
  train_images = np.concatenate([images for _, images in train])
  return (train_labels, train_images), (test_labels, test_images)


def test_binary_reader_returns_the_written_records(tmp_path):
  labels, images = random_records(4, seed=7)
  labels[0], labels[-1] = 0, 9
  path = str(tmp_path / 'tiny.bin')
  write_bin(path, labels, images)
  records = read_all(lambda: cifar_data.read_binary([path]))
  assert len(records) == len(labels)
  for (image, label), want_label, want_bytes in zip(records, labels, images):
    assert image.dtype == np.uint8 and image.shape == (32, 32, 3)
    assert label == want_label
    np.testing.assert_array_equal(image, expected_hwc(want_bytes))


@pytest.mark.parametrize('nested', [False, True])
def test_cifar_input_fns_standardize_and_augment(tmp_path, nested):
  (train_labels, _), (test_labels, test_images) = make_cifar_dir(str(tmp_path), nested)
  source = cifar_data.make_source('cifar10', str(tmp_path))

  # Evaluation: the whole test file, in order, last batch partial, standardized.
  batches = read_all(cifar_data.make_input_fn(source, False, 2))
  images = np.concatenate([b[0] for b in batches])
  assert [len(b[1]) for b in batches] == [2, 1]
  np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), test_labels)
  for image, raw in zip(images, test_images):
    x = expected_hwc(raw).astype(np.float64)
    want = (x - x.mean()) / max(x.std(), 1 / np.sqrt(x.size))
    np.testing.assert_allclose(image, want, atol=1e-4)

  # Training: endless full batches of augmented images of the training files.
  batches = read_all(cifar_data.make_input_fn(source, True, 4), limit=6)
  assert len(batches) == 6
  for images, labels in batches:
    assert images.shape == (4, 32, 32, 3) and images.dtype == np.float32
    assert set(labels) <= set(train_labels)


def test_cifar_without_data_dir_is_an_error():
  with pytest.raises(ValueError, match='needs --data_dir'):
    cifar_data.make_source('cifar10', None)


def test_cifar_missing_files_is_an_error(tmp_path):
  write_bin(str(tmp_path / 'test_batch.bin'), *random_records(1, 0))
  with pytest.raises(ValueError, match=r"data_batch_1\.bin.*are missing"):
    cifar_data.make_source('cifar10', str(tmp_path))


def test_bad_resnet_depth_is_an_error():
  with pytest.raises(ValueError, match='resnet_depth must be 6n\\+2.*got 21'):
    cifar_model.check_depth(21)


def synthetic(training: bool, limit: int):
  records = read_all(lambda: cifar_data.Synthetic().records(training), limit)
  return (np.stack([image for image, _ in records]),
          np.array([label for _, label in records]))


def test_synthetic_data_is_deterministic_balanced_and_learnable():
  images, labels = synthetic(False, None)
  again_images, again_labels = synthetic(False, None)
  np.testing.assert_array_equal(images, again_images)
  np.testing.assert_array_equal(labels, again_labels)
  assert images.shape == (cifar_data.Synthetic.num_eval_examples, 32, 32, 3)
  assert images.dtype == np.uint8
  counts = np.bincount(labels, minlength=10)
  assert len(counts) == 10 and counts.min() >= 60 and counts.max() <= 140, counts

  # Training and evaluation examples differ, but share the class patterns: a
  # nearest-class-mean classifier fit on training examples beats chance by far.
  train_images, train_labels = synthetic(True, 500)
  assert not np.array_equal(train_images[:100], images[:100])
  flat = train_images.reshape(len(train_images), -1).astype(np.float64)
  means = np.stack([flat[train_labels == c].mean(0) for c in range(10)])
  test = images.reshape(len(images), -1).astype(np.float64)
  distances = ((test[:, None, :] - means[None]) ** 2).sum(-1)
  assert (distances.argmin(1) == labels).mean() > 0.5


def run_trainer(model_dir: str, num_devices: int) -> dict:
  args = ['train.py', f'--model_dir={model_dir}', f'--num_cpu_devices={num_devices}',
          '--resnet_depth=8', '--batch_size=8', '--train_steps=3',
          '--eval_every_steps=0', '--eval_batch_size=8', '--eval_steps=2',
          '--log_every_n_steps=1', '--intra_op_threads=1', '--inter_op_threads=2']
  with flagsaver.flagsaver():
    flags.FLAGS(args)
    return cifar_train.run()


def plain_variable_names(params: dict) -> list[str]:
  """Variables of the plain model_fn's TRAIN graph (what a checkpoint holds)."""
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    cifar_model.model_fn(tf.zeros([8, 32, 32, 3]), tf.zeros([8], tf.int32),
                         tf.estimator.ModeKeys.TRAIN, params)
    return sorted(v.op.name for v in tf.compat.v1.global_variables())


@pytest.mark.parametrize('num_devices', [2, 3])  # 3 does not divide the batch of 8.
def test_trainer_runs_and_checkpoints_plain_variables(tmp_path, num_devices):
  metrics = run_trainer(str(tmp_path), num_devices)
  assert metrics['global_step'] == 3
  assert 0.0 <= metrics['accuracy'] <= 1.0
  assert np.isfinite(metrics['loss'])
  checkpoint = tf.train.latest_checkpoint(str(tmp_path))
  assert checkpoint is not None and checkpoint.endswith('-3')
  names = sorted(name for name, _ in tf.train.list_variables(checkpoint))
  assert names == plain_variable_names({'resnet_depth': 8, 'batch_size': 8})
