"""Trains a ResNet on CIFAR-10 with data-parallel towers.

Lines that differ from a single-device trainer end with `# estimator_towers:`
(a single-device trainer builds a plain RunConfig and passes the model_fn and
input_fn unwrapped). The library's flags (--num_gpus, --devices,
--num_cpu_devices, --variable_strategy, --staging_depth, session flags) are
listed by --helpfull. --batch_size is global: each step splits it across the
towers.

No download needed (synthetic CIFAR-shaped data, 2 virtual CPU devices):

  python examples/cifar10/train.py --num_cpu_devices=2

Real CIFAR-10 (the binary version, cifar-10-binary.tar.gz) on 4 GPUs:

  python examples/cifar10/train.py --num_gpus=4 \
      --data_dir=/data/cifar-10-batches-bin --resnet_depth=32 \
      --train_steps=64000 --eval_every_steps=2000
"""

from __future__ import annotations

import tempfile

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

import data as cifar_data  # Sibling modules: this directory is on sys.path.
import estimator_towers as et
import model as cifar_model

flags.DEFINE_enum('data', None, sorted(cifar_data.SOURCES),
                  'Dataset: cifar10 (binary files in --data_dir) or synthetic '
                  '(generated, no download). Default: cifar10 when --data_dir '
                  'is given, synthetic otherwise.')
flags.DEFINE_string('data_dir', None,
                    'Directory of the binary CIFAR-10 files (data_batch_*.bin, '
                    'test_batch.bin) or of the extracted cifar-10-batches-bin/.')
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


def run() -> dict:
  """Trains and evaluates as the flags say; returns the final evaluation."""
  cifar_model.check_depth(FLAGS.resnet_depth)
  data_name = FLAGS.data or ('cifar10' if FLAGS.data_dir else 'synthetic')
  source = cifar_data.make_source(data_name, FLAGS.data_dir)
  model_dir = FLAGS.model_dir or tempfile.mkdtemp(prefix='cifar10_')
  logging.info('data=%s, model_dir=%s', data_name, model_dir)

  towers = et.config_from_flags()  # estimator_towers:
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
  train_spec = tf.estimator.TrainSpec(train_input_fn, max_steps=FLAGS.train_steps)
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
  run()


if __name__ == '__main__':
  app.run(main)
