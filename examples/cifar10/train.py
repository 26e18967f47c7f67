"""Trains a ResNet on CIFAR-10 with data-parallel towers.

Lines that differ from a single-device trainer end with `# estimator_towers:`
(a single-device trainer builds a plain RunConfig and passes the model_fn and
input_fn unwrapped). --help lists this script's flags and the library's
(--num_gpus, --devices, --num_cpu_devices, --allow_cpu_fallback,
--variable_strategy, --staging_depth, session flags). --batch_size is global:
each step splits it across the towers. Every log_every_n_steps steps the log
shows examples/sec and the time left; TensorBoard on the model directory shows
examples_per_sec, train_accuracy over the global batch, and towers/<k>/loss
and towers/<k>/shard_size for each tower.

No download needed (synthetic CIFAR-shaped data, 2 virtual CPU devices):

  python examples/cifar10/train.py --num_cpu_devices=2

Its log says once that the towers after the first are built, not copied:
the model_fn logs the global batch's accuracy (`et.global_mean`) and uses a
`piecewise_constant` learning rate, either of which has every tower built
(model.py's docstring). The start takes longer; the steps are the same.

On the CPU, one device (as TensorFlow's cifar10_estimator's --num_gpus=0):

  python examples/cifar10/train.py --num_gpus=0

Real CIFAR-10 on 4 GPUs; --download fetches cifar-10-binary.tar.gz (162 MB)
into --data_dir once, checks its MD5 and extracts it; later runs reuse it:

  python examples/cifar10/train.py --num_gpus=4 --download \\
      --data_dir=/data/cifar10 --resnet_depth=32 \\
      --train_steps=64000 --eval_every_steps=2000

Asking for more GPUs than the machine shows stops with an error before
anything is created; --allow_cpu_fallback runs the missing towers on the CPU.
"""

from __future__ import annotations

import sys
import tempfile

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

import data as cifar_data  # Sibling modules: this directory is on sys.path.
import download as cifar_download
import estimator_towers as et
import model as cifar_model

flags.DEFINE_enum('data', None, sorted(cifar_data.SOURCES),
                  'Dataset: cifar10 (binary files in --data_dir) or synthetic '
                  '(generated, no download). Default: cifar10 when --data_dir '
                  'is given, synthetic otherwise.')
flags.DEFINE_string('data_dir', None,
                    'Directory of the binary CIFAR-10 files (data_batch_*.bin, '
                    'test_batch.bin) or of the extracted cifar-10-batches-bin/; '
                    'with --download, where to put them.')
flags.DEFINE_bool('download', False,
                  'Fetch CIFAR-10 into --data_dir unless it is there already: '
                  'downloads --data_url, checks the MD5 published with it, '
                  'extracts cifar-10-batches-bin/. Later runs reuse it.')
flags.DEFINE_string('data_url', cifar_download.URL,
                    'Where --download fetches cifar-10-binary.tar.gz: an '
                    'http(s):// or file:// URL, or a local path.')
flags.DEFINE_string('model_dir', None,
                    'Checkpoints and summaries; default: a new temporary directory.')
flags.DEFINE_integer('train_steps', 300,
                     'Training steps (global batches); the default suits the '
                     'synthetic data (real CIFAR-10 needs ~64000 at batch 128).')
flags.DEFINE_integer('eval_every_steps', 100,
                     'Save a checkpoint and evaluate every this many steps '
                     '(0: only at the end).')
flags.DEFINE_integer('eval_steps', None,
                     'Evaluation batches per evaluation; default: the whole '
                     'evaluation split.')
flags.DEFINE_integer('batch_size', 128, 'Global training batch size.')
flags.DEFINE_integer('eval_batch_size', 100, 'Global evaluation batch size.')
flags.DEFINE_integer('resnet_depth', 20, 'ResNet depth, 6n+2: 8, 20, 32, 44, 56, 110.')
flags.DEFINE_enum('resnet_version', '1', ['1', '2'],
                  '1: post-activation units; 2: pre-activation units.')
flags.DEFINE_enum('data_format', 'channels_last', ['channels_last', 'channels_first'],
                  'Layout inside the network; channels_first is faster on GPUs, '
                  'channels_last is needed on CPUs.')
flags.DEFINE_float('learning_rate', 0.1,
                   'Learning rate for a batch of 128, scaled linearly with '
                   '--batch_size; divided by 10 at 50% and 75% of --train_steps.')
flags.DEFINE_float('momentum', 0.9, 'Momentum of the SGD optimizer.')
flags.DEFINE_float('weight_decay', 2e-4, 'L2 weight decay on the kernels.')
flags.DEFINE_float('batch_norm_decay', 0.9, 'Decay of the batch-norm moving averages.')
flags.DEFINE_integer('log_every_n_steps', 50, 'Log loss and accuracy every N steps.')
flags.DEFINE_integer('seed', 0, 'Graph-level random seed and initializer seeds.')
et.define_flags()  # estimator_towers: --num_gpus, --devices, --num_cpu_devices, ...


def _check_depth(depth: int) -> bool:
  try:
    cifar_model.check_depth(depth)
  except ValueError as e:
    raise flags.ValidationError(str(e)) from e
  return True


flags.register_validator('resnet_depth', _check_depth)
flags.register_multi_flags_validator(
    ['download', 'data_dir'], lambda values: not values['download'] or values['data_dir'],
    '--download needs --data_dir=<dir>: the directory to put CIFAR-10 in '
    '(reused by later runs).')

FLAGS = flags.FLAGS


def model_params() -> dict:
  """The model_fn's params, from the flags."""
  return {
      'resnet_depth': FLAGS.resnet_depth,
      'resnet_version': int(FLAGS.resnet_version),
      'data_format': FLAGS.data_format,
      'batch_size': FLAGS.batch_size,
      'learning_rate': FLAGS.learning_rate,
      'momentum': FLAGS.momentum,
      'weight_decay': FLAGS.weight_decay,
      'batch_norm_decay': FLAGS.batch_norm_decay,
      'train_steps': FLAGS.train_steps,
      'log_every_n_steps': FLAGS.log_every_n_steps,
      'seed': FLAGS.seed,
  }


def data_source():
  """The --data source, fetched first with --download.

  Raises:
    cifar_data.DataError: for missing data, or a failed download.
  """
  data_name = FLAGS.data or ('cifar10' if FLAGS.data_dir or FLAGS.download else 'synthetic')
  data_dir = FLAGS.data_dir
  if FLAGS.download and data_name == 'cifar10':
    data_dir = cifar_download.maybe_download_and_extract(data_dir, FLAGS.data_url)
  return data_name, cifar_data.make_source(data_name, data_dir)


def run() -> dict:
  """Trains and evaluates as the flags say; returns the final evaluation."""
  towers = et.config_from_flags()  # estimator_towers:
  data_name, source = data_source()
  model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix='cifar10_')  # After every check.
  logging.info('data=%s, model_dir=%s', data_name, model_dir)

  run_config = et.make_run_config(  # estimator_towers:
      towers,
      model_dir=model_dir,
      save_checkpoints_steps=FLAGS.eval_every_steps or FLAGS.train_steps,
      save_summary_steps=FLAGS.log_every_n_steps,
      log_step_count_steps=FLAGS.log_every_n_steps,
      tf_random_seed=FLAGS.seed)
  model_fn = et.replicate_model_fn(cifar_model.model_fn, plan=towers.plan)  # estimator_towers:
  estimator = tf.estimator.Estimator(model_fn, config=run_config, params=model_params())

  train_input_fn = cifar_data.make_input_fn(source, True, FLAGS.batch_size)
  train_input_fn = et.staged_input_fn(train_input_fn, plan=towers.plan)  # estimator_towers:
  eval_input_fn = cifar_data.make_input_fn(source, False, FLAGS.eval_batch_size)
  eval_input_fn = et.staged_input_fn(eval_input_fn, plan=towers.plan)  # estimator_towers:
  examples_per_sec = et.ThroughputHook(estimator.config, max_steps=FLAGS.train_steps)  # estimator_towers:
  train_spec = tf.estimator.TrainSpec(train_input_fn, max_steps=FLAGS.train_steps,
                                      hooks=[examples_per_sec])
  eval_spec = tf.estimator.EvalSpec(eval_input_fn, steps=FLAGS.eval_steps,
                                    start_delay_secs=0, throttle_secs=0)
  metrics, _ = tf.estimator.train_and_evaluate(estimator, train_spec, eval_spec)
  logging.info('Final evaluation at step %d: accuracy %.4f, loss %.4f (%s)',
               metrics['global_step'], metrics['accuracy'], metrics['loss'],
               model_dir)
  return metrics


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logging.set_verbosity(logging.INFO)
  tf.get_logger().propagate = False  # TensorFlow logs through its own handler already.
  try:
    run()
  except cifar_data.DataError as e:
    sys.exit(f'{argv[0]}: {e}')


if __name__ == '__main__':
  app.run(main)
