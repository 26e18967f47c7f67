"""CIFAR-10 input pipelines: the real binary dataset, or synthetic data.

Two sources behind one interface, keyed by the --data flag value:

- 'cifar10': the binary version of CIFAR-10 (cifar-10-binary.tar.gz from
  https://www.cs.toronto.edu/~kriz/cifar.html). Each record is 1 label byte
  followed by 3072 image bytes: the 1024 red, then green, then blue values of
  a 32x32 image, rows first. Training reads data_batch_{1..5}.bin, evaluation
  test_batch.bin.
- 'synthetic': a deterministic, CIFAR-shaped dataset generated in the graph,
  needing no download. Every class has a fixed smooth colour pattern; an
  example is its class pattern blended with per-example noise, so a ResNet
  learns it within a few hundred steps. Example i is a pure function of i.

Both give uint8 [32, 32, 3] images and int32 labels; `make_input_fn` adds the
usual training augmentation (pad to 40x40, random 32x32 crop, random
left-right flip) and per-image standardization.

Rule: the training input holds no state outside tf.data, so the library saves
its position in every checkpoint and a resumed run reads on where it stopped
(docs/resuming.md). It shuffles with a fixed seed, and each example's crop and
flip are stateless draws keyed by the example's index in its split and its
place in the stream (so every epoch draws anew): the same draws on any
number of devices or workers and after any resume. A stateful
`tf.image.random_crop` in the `map` would make the input restart from its
first element on every resume, with a warning.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import tensorflow as tf

HEIGHT = 32
WIDTH = 32
CHANNELS = 3
NUM_CLASSES = 10
IMAGE_BYTES = HEIGHT * WIDTH * CHANNELS
RECORD_BYTES = 1 + IMAGE_BYTES
TRAIN_FILES = tuple(f'data_batch_{i}.bin' for i in range(1, 6))
EVAL_FILES = ('test_batch.bin',)
# The directory cifar-10-binary.tar.gz extracts to.
EXTRACTED_DIR = 'cifar-10-batches-bin'
PAD = 4
SHUFFLE_BUFFER = 10000
SHUFFLE_SEED = 1
# Keys the augmentation's draws apart from the synthetic data's (seeded 1, 2).
AUGMENT_SEED = 3


class DataError(ValueError):
  """The data the flags name is missing or unusable (reported without a traceback)."""


class CifarBinary:
  """The binary CIFAR-10 files in `data_dir`.

  `data_dir` may be the directory holding the .bin files or the one holding
  the extracted cifar-10-batches-bin/ directory.
  """

  num_train_examples = 50000
  num_eval_examples = 10000

  def __init__(self, data_dir: str | None):
    if not data_dir:
      raise DataError(
          '--data=cifar10 reads the binary CIFAR-10 files and needs --data_dir, '
          'got none. Pass --data_dir=<dir> --download to fetch them into <dir>, '
          'or extract https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz '
          'yourself and pass --data_dir=<dir>/cifar-10-batches-bin, or use '
          '--data=synthetic.')
    nested = os.path.join(data_dir, EXTRACTED_DIR)
    self.data_dir = nested if os.path.isdir(nested) else data_dir
    missing = [f for f in TRAIN_FILES + EVAL_FILES
               if not tf.io.gfile.exists(os.path.join(self.data_dir, f))]
    if missing:
      raise DataError(
          f'--data_dir={data_dir} must hold the binary CIFAR-10 files '
          f'{list(TRAIN_FILES + EVAL_FILES)}, but {missing} are missing from '
          f'{self.data_dir!r}. Pass --download to fetch and extract '
          f'cifar-10-binary.tar.gz there, extract it yourself (the "binary '
          f'version", not the Python one), or use --data=synthetic.')

  def filenames(self, training: bool) -> list[str]:
    names = TRAIN_FILES if training else EVAL_FILES
    return [os.path.join(self.data_dir, name) for name in names]

  def records(self, training: bool) -> tf.data.Dataset:
    """(uint8 [32, 32, 3] image, int32 label) pairs, in file order."""
    return read_binary(self.filenames(training))


def read_binary(filenames: list[str]) -> tf.data.Dataset:
  """Reads CIFAR-10 binary records from `filenames`, in order."""
  return tf.data.FixedLengthRecordDataset(filenames, RECORD_BYTES).map(
      decode_record, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def decode_record(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """One binary record -> (uint8 [32, 32, 3] image, int32 label)."""
  values = tf.io.decode_raw(record, tf.uint8)
  label = tf.cast(values[0], tf.int32)
  planes = tf.reshape(values[1:], [CHANNELS, HEIGHT, WIDTH])
  return tf.transpose(planes, [1, 2, 0]), label


class Synthetic:
  """A deterministic synthetic CIFAR-shaped dataset, generated in the graph.

  Class c has a fixed smooth colour pattern (an 8x8x3 random grid resized to
  32x32); example i of a split is `(1 - noise) * pattern[label_i] + noise *
  uniform_noise_i`, quantised to [0, 255], with label_i uniform over the
  classes. Labels and noise come from stateless random ops seeded by
  (split seed, i), so the data is the same on every run and machine.
  """

  num_train_examples = 50000
  num_eval_examples = 1000
  pattern_seed = 20240
  train_seed = 1
  eval_seed = 2
  noise = 0.8

  def __init__(self, data_dir: str | None = None):
    del data_dir  # Generated, not read.
    rng = np.random.RandomState(self.pattern_seed)
    grid = rng.uniform(0.0, 255.0, size=(NUM_CLASSES, 8, 8, CHANNELS))
    self._grid = grid.astype(np.float32)

  def records(self, training: bool) -> tf.data.Dataset:
    """(uint8 [32, 32, 3] image, int32 label) pairs; example i depends on i only."""
    count = self.num_train_examples if training else self.num_eval_examples
    seed = self.train_seed if training else self.eval_seed
    patterns = tf.image.resize(tf.constant(self._grid), [HEIGHT, WIDTH])

    def example(index):
      label_seed = tf.stack([tf.constant(seed, tf.int64), index])
      noise_seed = tf.stack([tf.constant(seed, tf.int64), index + count])
      label = tf.random.stateless_uniform(
          [], label_seed, minval=0, maxval=NUM_CLASSES, dtype=tf.int32)
      noise = tf.random.stateless_uniform(
          [HEIGHT, WIDTH, CHANNELS], noise_seed, maxval=255.0)
      image = (1.0 - self.noise) * tf.gather(patterns, label) + self.noise * noise
      return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8), label

    return tf.data.Dataset.range(count).map(
        example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


SOURCES = {
    'synthetic': Synthetic,
    'cifar10': CifarBinary,
}


def make_source(name: str, data_dir: str | None = None):
  """The data source for the --data flag value `name`.

  Raises:
    ValueError: for an unknown name, or (cifar10) a missing data_dir or file.
  """
  if name not in SOURCES:
    raise DataError(f'--data must be one of {sorted(SOURCES)}, got --data={name}.')
  return SOURCES[name](data_dir)


def standardize(image: tf.Tensor) -> tf.Tensor:
  """uint8 (or float) image -> float32 image of mean 0 and variance 1."""
  return tf.image.per_image_standardization(tf.cast(image, tf.float32))


def example_seed(index: tf.Tensor, position: tf.Tensor) -> tf.Tensor:
  """The [2] seed of the draws for example `index` read at `position` of the stream."""
  key = tf.stack([tf.constant(AUGMENT_SEED, tf.int64), index])
  return tf.random.experimental.stateless_fold_in(key, position)


def augment(image: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """Pads to 40x40, crops a 32x32 window and flips half the time, drawn by `seed` alone."""
  crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
  image = tf.image.pad_to_bounding_box(image, PAD, PAD, HEIGHT + 2 * PAD,
                                       WIDTH + 2 * PAD)
  image = tf.image.stateless_random_crop(image, [HEIGHT, WIDTH, CHANNELS], crop_seed)
  return tf.image.stateless_random_flip_left_right(image, flip_seed)


def training_examples(source) -> tf.data.Dataset:
  """Augmented, standardized (image, label) pairs: seeded shuffle, repeated forever.

  Every op is a dataset op or stateless, so tf.data saves the position.
  """
  dataset = source.records(True).enumerate()  # (index in the split, example)
  dataset = dataset.shuffle(SHUFFLE_BUFFER, seed=SHUFFLE_SEED).repeat().enumerate()

  def preprocess(position, indexed):
    index, (image, label) = indexed
    image = augment(tf.cast(image, tf.float32), example_seed(index, position))
    return standardize(image), label

  return dataset.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def make_input_fn(source, training: bool, batch_size: int
                  ) -> Callable[[], tf.data.Dataset]:
  """An Estimator input_fn of (images [B, 32, 32, 3] float32, labels [B] int32).

  Training repeats and shuffles forever, augments each example with draws
  keyed by the example (`training_examples`) and drops the last partial
  batch; evaluation reads the split once, in order, keeping the last partial
  batch.
  """
  def input_fn() -> tf.data.Dataset:
    if training:
      dataset = training_examples(source)
    else:
      dataset = source.records(False).map(
          lambda image, label: (standardize(image), label),
          num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    dataset = dataset.batch(batch_size, drop_remainder=training)
    return dataset.prefetch(tf.data.AUTOTUNE)
  return input_fn
