"""A user's own model for the own-model check's tests, named by module path.

`model_fn` is a small dense classifier with dropout and Adam (slots);
`input_fn` reads its batch size from params. `tower_dependent_model_fn` is
the planted difference: it scales its loss on every tower but the first.
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
