"""The CIFAR-10 example: its data readers, its synthetic data, --download and short runs.

References: the bytes the test writes itself (binary reader, the archive
--download fetches), a numpy computation (standardization, nearest-class-mean
learnability) and the plain single-device model_fn's graph (checkpoint names of
the towered trainer).
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import subprocess
import sys
import tarfile

from absl import flags
from absl.testing import flagsaver
import numpy as np
import pytest
import tensorflow as tf

# For its side effect: Estimator's graph.pbtxt written by protobuf's C encoder.
import testlib  # pylint: disable=unused-import

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           os.pardir, 'examples', 'cifar10')
sys.path.insert(0, EXAMPLE_DIR)
import data as cifar_data  # pylint: disable=g-import-not-at-top,wrong-import-position
import download as cifar_download  # pylint: disable=g-import-not-at-top,wrong-import-position
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


def run_trainer(model_dir: str, num_devices: int | None = None, *extra: str) -> dict:
  args = ['train.py', f'--model_dir={model_dir}',
          '--resnet_depth=8', '--batch_size=8', '--train_steps=3',
          '--eval_every_steps=0', '--eval_batch_size=8', '--eval_steps=2',
          '--log_every_n_steps=1', '--intra_op_threads=1', '--inter_op_threads=2', *extra]
  if num_devices is not None:
    args.append(f'--num_cpu_devices={num_devices}')
  with flagsaver.flagsaver():
    flags.FLAGS(args)
    return cifar_train.run()


def scalar_tags(model_dir: str) -> dict[str, list[float]]:
  tags = {}
  for path in glob.glob(os.path.join(model_dir, 'events.out.tfevents.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        tags.setdefault(value.tag, []).append(value.simple_value)
  return tags


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
  position = [name for name in names if name.startswith('input_position/')]
  assert position, names  # The example's input is positioned: it resumes where it stopped.
  assert [name for name in names if name not in position] == plain_variable_names(
      {'resnet_depth': 8, 'batch_size': 8})
  # What TensorBoard shows: examples/sec, each tower's scalars, the global accuracy.
  tags = scalar_tags(str(tmp_path))
  assert tags['examples_per_sec'] and all(v > 0 for v in tags['examples_per_sec'])
  sizes = [8 // num_devices + (k < 8 % num_devices) for k in range(num_devices)]
  for k in range(num_devices):
    assert set(tags[f'towers/{k}/shard_size']) == {sizes[k]}
    assert np.all(np.isfinite(tags[f'towers/{k}/loss']))
  assert all(v in {i / 8 for i in range(9)} for v in tags['train_accuracy'])  # Of 8, not a shard.


def test_trainer_with_sync_batch_norm(tmp_path):
  """--sync_batch_norm (a library flag) trains with global batch-norm statistics."""
  metrics = run_trainer(str(tmp_path), 3, '--sync_batch_norm')
  assert metrics['global_step'] == 3
  assert np.isfinite(metrics['loss'])
  graph_files = glob.glob(os.path.join(str(tmp_path), 'graph.pbtxt'))
  graph = tf.compat.v1.GraphDef()
  from google.protobuf import text_format  # pylint: disable=g-import-not-at-top
  text_format.Parse(open(graph_files[0]).read(), graph)
  # Each tower normalises with the global statistics: the fused kernel in
  # inference mode, in a TRAIN graph, on every tower's device.
  synced = [node for node in graph.node
            if node.op == 'FusedBatchNormV3' and not node.attr['is_training'].b]
  assert len({node.device for node in synced}) == 3


def test_num_gpus_zero_trains_on_the_cpu(tmp_path):
  metrics = run_trainer(str(tmp_path), None, '--num_gpus=0')
  assert metrics['global_step'] == 3
  assert np.isfinite(metrics['loss'])
  tags = scalar_tags(str(tmp_path))
  assert 'examples_per_sec' in tags and not any(t.startswith('towers/') for t in tags)


# --- The command line: --help, and errors before anything is created -----------

def run_script(*args: str, tmp_dir: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, TMPDIR=tmp_dir, TF_CPP_MIN_LOG_LEVEL='2',
             PYTHONPATH=os.pathsep.join([os.path.join(EXAMPLE_DIR, os.pardir, os.pardir),
                                         os.environ.get('PYTHONPATH', '')]))
  return subprocess.run([sys.executable, os.path.join(EXAMPLE_DIR, 'train.py'), *args],
                        env=env, capture_output=True, text=True, timeout=240, check=False)


def test_help_lists_the_library_flags(tmp_path):
  result = run_script('--help', tmp_dir=str(tmp_path))
  for flag in ('--num_gpus', '--num_cpu_devices', '--allow_cpu_fallback', '--variable_strategy',
               '--staging_depth', '--download'):
    assert flag in result.stdout, flag
  assert 'replicated: every tower reads its own copy' in ' '.join(result.stdout.split())


def test_bad_flags_stop_before_anything_is_created(tmp_path):
  result = run_script('--num_cpu_devices=0', tmp_dir=str(tmp_path))
  assert result.returncode == 1
  assert ('FATAL Flags parsing error: flag --num_cpu_devices=0: --num_cpu_devices must be a '
          'positive integer' in result.stderr), result.stderr
  assert 'Traceback' not in result.stderr
  assert os.listdir(tmp_path) == []  # No cifar10_* model directory left behind.


# --- --download, against an archive built here in the exact binary format -------

def make_archive(path: str) -> tuple:
  """cifar-10-binary.tar.gz's layout: cifar-10-batches-bin/{data,test}_batch*.bin."""
  source = os.path.join(os.path.dirname(path), 'source')
  written = make_cifar_dir(source)
  with tarfile.open(path, 'w:gz') as tar:
    for name in sorted(os.listdir(source)):
      tar.add(os.path.join(source, name), arcname=f'{cifar_data.EXTRACTED_DIR}/{name}')
    info = tarfile.TarInfo(f'{cifar_data.EXTRACTED_DIR}/batches.meta.txt')
    meta = '\n'.join(['airplane', 'automobile']).encode()
    info.size = len(meta)
    tar.addfile(info, io.BytesIO(meta))
  with open(path, 'rb') as f:
    return written, hashlib.md5(f.read()).hexdigest()


def test_published_md5_is_the_one_checked():
  assert cifar_download.MD5 == 'c32a1d4ab5d03f1284b67883e8d87530'
  assert cifar_download.URL == 'https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz'


@pytest.mark.parametrize('as_url', [True, False])
def test_download_extracts_verifies_and_is_reused(tmp_path, as_url):
  archive = str(tmp_path / 'served' / cifar_download.ARCHIVE)
  os.makedirs(os.path.dirname(archive))
  (_, (test_labels, test_images)), md5 = make_archive(archive)
  url = 'file://' + archive if as_url else archive
  data_dir = str(tmp_path / 'data')

  target = cifar_download.maybe_download_and_extract(data_dir, url, md5)
  assert target == os.path.join(data_dir, cifar_data.EXTRACTED_DIR)
  records = read_all(lambda: cifar_data.make_source('cifar10', data_dir).records(False))
  np.testing.assert_array_equal([label for _, label in records], test_labels)
  for (image, _), raw in zip(records, test_images):
    np.testing.assert_array_equal(image, expected_hwc(raw))

  os.remove(archive)  # The next run needs neither the network nor the archive.
  assert cifar_download.maybe_download_and_extract(data_dir, url, md5) == target


def test_download_rejects_a_checksum_mismatch(tmp_path):
  archive = str(tmp_path / cifar_download.ARCHIVE)
  make_archive(archive)
  data_dir = str(tmp_path / 'data')
  with pytest.raises(cifar_download.DownloadError,
                     match=r'has MD5 [0-9a-f]{32}, not the expected c32a1d4ab5d03f1284b67883e8d87530'):
    cifar_download.maybe_download_and_extract(data_dir, 'file://' + archive)
  assert not os.path.exists(os.path.join(data_dir, cifar_download.ARCHIVE))
  assert not os.path.exists(os.path.join(data_dir, cifar_data.EXTRACTED_DIR))


def test_download_offline_is_a_clear_error(tmp_path):
  with pytest.raises(cifar_download.DownloadError,
                     match=r'Could not fetch CIFAR-10 from --data_url=http://127\.0\.0\.1:9/x\.tar\.gz '
                     r'.*If this machine is offline'):
    cifar_download.maybe_download_and_extract(str(tmp_path), 'http://127.0.0.1:9/x.tar.gz')


def test_download_rejects_an_archive_without_the_files(tmp_path):
  archive = str(tmp_path / 'other.tar.gz')
  with tarfile.open(archive, 'w:gz') as tar:
    info = tarfile.TarInfo('../escape/data_batch_1.bin')
    tar.addfile(info, io.BytesIO(b''))
  md5 = hashlib.md5(open(archive, 'rb').read()).hexdigest()
  with pytest.raises(cifar_download.DownloadError, match=r"has no \[.*'data_batch_1.bin'"):
    cifar_download.maybe_download_and_extract(str(tmp_path / 'data'), archive, md5)
  assert not os.path.exists(tmp_path / 'escape')


def test_trainer_downloads_with_the_flags(tmp_path, monkeypatch):
  archive = str(tmp_path / cifar_download.ARCHIVE)
  _, md5 = make_archive(archive)
  data_dir = str(tmp_path / 'data')
  with pytest.raises(cifar_download.DownloadError, match='not the expected'):
    run_trainer(str(tmp_path / 'model0'), 2, '--download', f'--data_dir={data_dir}',
                f'--data_url=file://{archive}')
  monkeypatch.setattr(cifar_download, 'MD5', md5)  # This archive's, not CIFAR-10's.
  metrics = run_trainer(str(tmp_path / 'model'), 2, '--download', f'--data_dir={data_dir}',
                        f'--data_url=file://{archive}')
  assert metrics['global_step'] == 3
  assert os.path.isfile(os.path.join(data_dir, cifar_data.EXTRACTED_DIR, 'test_batch.bin'))
