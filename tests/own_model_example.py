"""A user's own model for the own-model check's tests, named by module path.

`model_fn` is a small dense classifier with dropout and Adam (slots);
`input_fn` reads its batch size from params. `tower_dependent_model_fn` is
the planted difference: it scales its loss on every tower but the first.

`resnet_model_fn` is a tiny ResNet with the CIFAR-10 example's features
(convolutions without bias, fused batch norm, ReLU, a residual unit with a
strided, zero-padded shortcut, global mean, weight decay, momentum on a
piecewise-constant rate, a global-batch summary), and `resnet_input_fn`
gives it batches whose float32 rounding alone changes its training by far
more than 1e-5: each image comes with its negative and a zero border, so
every batch-norm mean of the first layer is 0 in exact arithmetic and the
border's activations sit on the ReLU's kink, on the side the rounding of the
mean decides (what a deep ResNet has here and there at every step).
"""

import numpy as np
import tensorflow as tf

import estimator_towers as et


def input_fn(params):
  rng = np.random.RandomState(0)
  x = rng.randn(64, 6).astype(np.float32) * np.linspace(0.5, 2.0, 64, dtype=np.float32)[:, None]
  y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices(({'x': x}, y)).repeat().batch(
      params.get('batch_size', 10))


def _logits(features, mode):
  hidden = tf.compat.v1.layers.dense(features['x'], 8, tf.nn.relu, name='hidden')
  hidden = tf.compat.v1.layers.dropout(hidden, 0.2, training=mode == tf.estimator.ModeKeys.TRAIN)
  return tf.compat.v1.layers.dense(hidden, 2, name='logits')


def _spec(mode, loss, params):
  optimizer = tf.compat.v1.train.AdamOptimizer(params.get('learning_rate', 0.05))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def model_fn(features, labels, mode, params):
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, _logits(features, mode))
  return _spec(mode, loss, params)


def tower_dependent_model_fn(features, labels, mode, params):
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, _logits(features, mode))
  if et.current_tower().index > 0:  # reads its tower: a model that differs across towers
    loss *= 1.5
  return _spec(mode, loss, params)


RESNET_BATCH, RESNET_SIZE = 16, 16


def resnet_input_fn():
  rng = np.random.RandomState(0)
  images = rng.randn(RESNET_BATCH // 2, RESNET_SIZE, RESNET_SIZE, 3).astype(np.float32)
  images[:, :2, :2] = 0.0  # a zero corner
  images = np.concatenate([images, -images])  # each image and its negative
  labels = rng.randint(0, 10, RESNET_BATCH).astype(np.int32)
  return tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(RESNET_BATCH)


def _bn_relu(x, training, name, relu=True):
  x = tf.compat.v1.layers.batch_normalization(x, momentum=0.9, epsilon=1e-5, training=training,
                                              fused=True, name=name)
  return tf.nn.relu(x) if relu else x


def _conv(x, filters, strides, name, seed):
  return tf.compat.v1.layers.conv2d(
      x, filters, 3, strides=strides, padding='same', use_bias=False, name=name,
      kernel_initializer=tf.compat.v1.variance_scaling_initializer(scale=2.0, seed=seed))


def _resnet_logits(images, training):
  x = _bn_relu(_conv(images, 8, 1, 'initial_conv', 1), training, 'initial_bn')
  shortcut = tf.pad(tf.compat.v1.layers.average_pooling2d(x, 2, 2), [[0, 0]] * 3 + [[4, 4]])
  with tf.compat.v1.variable_scope('unit'):
    y = _bn_relu(_conv(x, 16, 2, 'conv1', 2), training, 'bn1')
    y = _bn_relu(_conv(y, 16, 1, 'conv2', 3), training, 'bn2', relu=False)
  return tf.compat.v1.layers.dense(tf.reduce_mean(tf.nn.relu(y + shortcut), [1, 2]), 10,
                                   name='logits')


def resnet_model_fn(features, labels, mode):
  logits = _resnet_logits(features, mode == tf.estimator.ModeKeys.TRAIN)
  kernels = [v for v in tf.compat.v1.trainable_variables() if 'kernel' in v.name]
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits) + 2e-4 * tf.add_n(
      [tf.nn.l2_loss(v) for v in kernels])
  step = tf.compat.v1.train.get_global_step()
  rate = tf.compat.v1.train.piecewise_constant(step, [500, 750], [0.0125, 0.00125, 0.000125])
  correct = tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels)
  et.global_mean('train_accuracy', tf.reduce_mean(tf.cast(correct, tf.float32)))
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = tf.compat.v1.train.MomentumOptimizer(rate, 0.9).minimize(loss, step)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
