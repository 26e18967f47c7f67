"""ResNet for CIFAR-10 (He et al. 2016) as an ordinary single-device model_fn.

Depth 6n+2 (ResNet-20, 32, 56, ...): a 3x3 convolution with 16 filters, three
stages of n residual units with 16, 32 and 64 filters (the last two start with
stride 2), global average pooling and a 10-way dense layer. Version 1 units
are conv-BN-ReLU with the ReLU after the addition; version 2 units are
pre-activation (BN-ReLU-conv). Shortcuts that change shape subsample and
zero-pad the channels (the paper's parameter-free option A).

Training: momentum SGD, learning rate piecewise constant on global_step (÷10
at 50% and at 75% of the training steps), L2 weight decay on the kernels. The model_fn is a plain single-device one;
its one line that knows about towers (marked `# estimator_towers:`) makes the
logged and plotted training accuracy cover the global batch rather than tower
0's shard, and works unchanged without towers. That line (`et.global_mean`
asks which tower is being built) and the learning-rate schedule
(`piecewise_constant` is a `tf.cond`) each make the library build every tower
by running this model_fn again instead of copying the first tower's ops; the
log says so once. It costs a longer graph construction at the start; the
steps and the updates are the same.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

import estimator_towers as et

ModeKeys = tf.estimator.ModeKeys
VERSIONS = (1, 2)
STAGE_FILTERS = (16, 32, 64)
DEFAULT_PARAMS = {
    'num_classes': 10,
    'resnet_depth': 20,
    'resnet_version': 1,
    'data_format': 'channels_last',
    'batch_size': 128,          # Global batch: scales the learning rate.
    'learning_rate': 0.1,       # For a batch of 128.
    'momentum': 0.9,
    'weight_decay': 2e-4,
    'batch_norm_decay': 0.9,
    'batch_norm_epsilon': 1e-5,
    'train_steps': 1000,        # Where the learning-rate drops fall.
    'log_every_n_steps': 50,
    'seed': 0,
}


def check_depth(depth: int) -> int:
  """Returns n, the residual units per stage, for a ResNet of `depth` layers.

  Raises:
    ValueError: unless depth = 6n + 2 with n >= 1.
  """
  if (isinstance(depth, bool) or not isinstance(depth, int) or depth < 8
      or (depth - 2) % 6):
    raise ValueError(
        f'resnet_depth must be 6n+2 for n >= 1 (8, 14, 20, 32, 44, 56, 110, '
        f'...), got {depth!r}. Use e.g. --resnet_depth=20.')
  return (depth - 2) // 6


class _ResNet:
  """Builds the network; every initializer gets its own fixed seed."""

  def __init__(self, params: dict, training: bool):
    self.params = params
    self.training = training
    self.channels_axis = 1 if params['data_format'] == 'channels_first' else 3
    self._seeds = itertools.count(params['seed'] * 1000 + 1)

  def conv(self, x, filters: int, strides: int, kernel_size: int = 3, name=None):
    return tf.compat.v1.layers.conv2d(
        x, filters, kernel_size, strides=strides, padding='same', use_bias=False,
        data_format=self.params['data_format'], name=name,
        kernel_initializer=tf.compat.v1.variance_scaling_initializer(
            scale=2.0, seed=next(self._seeds)))

  def batch_norm(self, x, name=None):
    return tf.compat.v1.layers.batch_normalization(
        x, axis=self.channels_axis, momentum=self.params['batch_norm_decay'],
        epsilon=self.params['batch_norm_epsilon'], training=self.training,
        fused=True, name=name)

  def bn_relu(self, x, name=None):
    return tf.nn.relu(self.batch_norm(x, name=name))

  def shortcut(self, x, filters: int, strides: int):
    """Identity, or subsample + zero-pad the channels when the shape changes."""
    in_filters = x.shape[self.channels_axis]
    if strides > 1:
      x = tf.compat.v1.layers.average_pooling2d(
          x, strides, strides, data_format=self.params['data_format'])
    if filters != in_filters:
      extra = filters - in_filters
      pad = [[0, 0], [0, 0], [0, 0], [0, 0]]
      pad[self.channels_axis] = [extra // 2, extra - extra // 2]
      x = tf.pad(x, pad)
    return x

  def unit_v1(self, x, filters: int, strides: int):
    shortcut = self.shortcut(x, filters, strides)
    y = self.bn_relu(self.conv(x, filters, strides, name='conv1'), name='bn1')
    y = self.batch_norm(self.conv(y, filters, 1, name='conv2'), name='bn2')
    return tf.nn.relu(y + shortcut)

  def unit_v2(self, x, filters: int, strides: int):
    shortcut = self.shortcut(x, filters, strides)
    y = self.conv(self.bn_relu(x, name='bn1'), filters, strides, name='conv1')
    y = self.conv(self.bn_relu(y, name='bn2'), filters, 1, name='conv2')
    return y + shortcut

  def __call__(self, images: tf.Tensor) -> tf.Tensor:
    units = check_depth(self.params['resnet_depth'])
    version = self.params['resnet_version']
    if version not in VERSIONS:
      raise ValueError(f'resnet_version must be one of {VERSIONS}, got {version!r}.')
    unit = self.unit_v1 if version == 1 else self.unit_v2
    x = images
    if self.params['data_format'] == 'channels_first':
      x = tf.transpose(x, [0, 3, 1, 2])
    x = self.conv(x, STAGE_FILTERS[0], 1, name='initial_conv')
    if version == 1:
      x = self.bn_relu(x, name='initial_bn')
    for stage, filters in enumerate(STAGE_FILTERS):
      for index in range(units):
        strides = 2 if stage > 0 and index == 0 else 1
        with tf.compat.v1.variable_scope(f'stage{stage + 1}_unit{index + 1}'):
          x = unit(x, filters, strides)
    if version == 2:
      x = self.bn_relu(x, name='final_bn')
    spatial_axes = [2, 3] if self.params['data_format'] == 'channels_first' else [1, 2]
    x = tf.reduce_mean(x, spatial_axes)
    return tf.compat.v1.layers.dense(
        x, self.params['num_classes'], name='logits',
        kernel_initializer=tf.compat.v1.variance_scaling_initializer(
            scale=1.0, distribution='uniform', seed=next(self._seeds)))


def learning_rate_schedule(params: dict) -> tf.Tensor:
  """Base rate (scaled by batch/128), ÷10 at 50% and 75% of train_steps."""
  base = params['learning_rate'] * params['batch_size'] / 128
  steps = params['train_steps']
  boundaries = sorted({max(1, int(steps * 0.5)), max(2, int(steps * 0.75))})
  values = [base * 0.1 ** i for i in range(len(boundaries) + 1)]
  global_step = tf.compat.v1.train.get_or_create_global_step()
  return tf.compat.v1.train.piecewise_constant(global_step, boundaries, values)


def model_fn(features, labels, mode, params):
  """Estimator model_fn: ResNet-(6n+2) on [B, 32, 32, 3] standardized images."""
  params = {**DEFAULT_PARAMS, **(params or {})}
  training = mode == ModeKeys.TRAIN
  logits = _ResNet(params, training)(features)
  classes = tf.argmax(logits, axis=1, output_type=tf.int32)
  probabilities = tf.nn.softmax(logits)
  if mode == ModeKeys.PREDICT:
    predictions = {'classes': classes, 'probabilities': probabilities}
    return tf.estimator.EstimatorSpec(mode, predictions=predictions, export_outputs={
        'serving_default': tf.estimator.export.PredictOutput(predictions)})

  per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  cross_entropy = tf.reduce_mean(per_example)
  kernels = [v for v in tf.compat.v1.trainable_variables() if 'kernel' in v.name]
  weight_decay = params['weight_decay'] * tf.add_n([tf.nn.l2_loss(v) for v in kernels])
  loss = cross_entropy + weight_decay
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'accuracy': tf.compat.v1.metrics.accuracy(labels, classes),
        'cross_entropy': tf.compat.v1.metrics.mean(per_example),
    })

  learning_rate = learning_rate_schedule(params)
  batch_accuracy = tf.reduce_mean(tf.cast(tf.equal(classes, labels), tf.float32))
  train_accuracy = et.global_mean('train_accuracy', batch_accuracy)  # estimator_towers: summary, tensor name
  tf.compat.v1.summary.scalar('learning_rate', learning_rate)
  optimizer = tf.compat.v1.train.MomentumOptimizer(learning_rate, params['momentum'])
  update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
  with tf.control_dependencies(update_ops):  # Batch-norm moving averages.
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  logging_hook = tf.estimator.LoggingTensorHook(
      {'step': tf.compat.v1.train.get_global_step(), 'learning_rate': learning_rate,
       'cross_entropy': cross_entropy, 'train_accuracy': train_accuracy},
      every_n_iter=params['log_every_n_steps'])
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    training_hooks=[logging_hook])
