"""ResNet-20 for CIFAR-10-shaped data (He et al. 2016), the self-test's speed model.

The installed package does not ship the repository's examples/cifar10, so the
self-test has its own ResNet-20: a 3x3 convolution with 16 filters, three
stages of three version-1 residual units (conv-BN-ReLU, the ReLU after the
addition) with 16, 32 and 64 filters, the last two starting with stride 2,
shortcuts that subsample and zero-pad the channels, global average pooling
and a 10-way dense layer; momentum SGD with L2 weight decay. Channels first
on GPUs (cuDNN's fast layout), channels last on CPUs.
"""

from __future__ import annotations

import tensorflow as tf

from estimator_towers.base import shapes

NUM_CLASSES = 10
UNITS_PER_STAGE = 3   # depth 6 * 3 + 2 = 20
STAGE_FILTERS = (16, 32, 64)


def _conv(x, filters: int, strides: int, data_format: str, name: str):
  return tf.compat.v1.layers.conv2d(
      x, filters, 3, strides=strides, padding='same', use_bias=False,
      data_format=data_format, name=name,
      kernel_initializer=tf.compat.v1.variance_scaling_initializer(scale=2.0, seed=1))


def _batch_norm(x, training: bool, data_format: str, name: str):
  return tf.compat.v1.layers.batch_normalization(
      x, axis=1 if data_format == 'channels_first' else 3, momentum=0.9,
      epsilon=1e-5, training=training, fused=True, name=name)


def _unit(x, filters: int, strides: int, training: bool, data_format: str):
  channels = 1 if data_format == 'channels_first' else 3
  shortcut = x
  if strides > 1:
    shortcut = tf.compat.v1.layers.average_pooling2d(
        shortcut, strides, strides, data_format=data_format)
  extra = filters - shapes.dim(x, channels)
  if extra:
    pad = [[0, 0]] * 4
    pad[channels] = [extra // 2, extra - extra // 2]
    shortcut = tf.pad(shortcut, pad)
  y = _conv(x, filters, strides, data_format, 'conv1')
  y = tf.nn.relu(_batch_norm(y, training, data_format, 'bn1'))
  y = _batch_norm(_conv(y, filters, 1, data_format, 'conv2'), training, data_format, 'bn2')
  return tf.nn.relu(y + shortcut)


def logits(images: tf.Tensor, training: bool, data_format: str) -> tf.Tensor:
  """ResNet-20's logits for channels-last [B, 32, 32, 3] images."""
  x = tf.transpose(images, [0, 3, 1, 2]) if data_format == 'channels_first' else images
  x = _conv(x, STAGE_FILTERS[0], 1, data_format, 'initial_conv')
  x = tf.nn.relu(_batch_norm(x, training, data_format, 'initial_bn'))
  for stage, filters in enumerate(STAGE_FILTERS):
    for index in range(UNITS_PER_STAGE):
      with tf.compat.v1.variable_scope(f'stage{stage + 1}_unit{index + 1}'):
        x = _unit(x, filters, 2 if stage and not index else 1, training, data_format)
  x = tf.reduce_mean(x, [2, 3] if data_format == 'channels_first' else [1, 2])
  return tf.compat.v1.layers.dense(x, NUM_CLASSES, name='logits')


def make_model_fn(data_format: str):
  """A single-device Estimator model_fn training ResNet-20 (TRAIN only)."""
  def model_fn(features, labels, mode):
    out = logits(features, mode == tf.estimator.ModeKeys.TRAIN, data_format)
    kernels = [v for v in tf.compat.v1.trainable_variables() if 'kernel' in v.name]
    loss = (tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, out)
            + 2e-4 * tf.add_n([tf.nn.l2_loss(v) for v in kernels]))
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
      train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn
