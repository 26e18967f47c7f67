"""Shared helpers for the tests: data, reference models, Estimators on virtual CPUs.

The reference for almost every test is the plain, single-device model_fn run by
a plain Estimator on the same data.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import tensorflow as tf

NUM_FEATURES = 5
NUM_CLASSES = 3
LEARNING_RATE = 0.5


def cpu_devices(n: int) -> list[str]:
  return [f'/cpu:{i}' for i in range(n)]


def run_config(num_cpus: int = 1, **kwargs) -> tf.estimator.RunConfig:
  """A RunConfig with `num_cpus` virtual CPU devices."""
  kwargs.setdefault('save_checkpoints_steps', 1000)
  kwargs.setdefault('save_summary_steps', 1000)
  kwargs.setdefault('log_step_count_steps', 1000)
  return tf.estimator.RunConfig(
      session_config=tf.compat.v1.ConfigProto(
          device_count={'CPU': max(num_cpus, 1)},
          inter_op_parallelism_threads=2, intra_op_parallelism_threads=1),
      **kwargs)


def make_estimator(model_fn, num_cpus: int = 1, model_dir: str | None = None,
                   params=None, **config_kwargs) -> tf.estimator.Estimator:
  model_dir = model_dir or tempfile.mkdtemp(prefix='et_')
  return tf.estimator.Estimator(model_fn, model_dir=model_dir,
                                config=run_config(num_cpus, **config_kwargs),
                                params=params)


def data(num_examples: int, seed: int = 0):
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, NUM_FEATURES).astype(np.float32)
  y = rng.randint(0, NUM_CLASSES, size=num_examples).astype(np.int32)
  return x, y


def input_fn(x, y, batch_size: int, static_batch: bool = False, epochs: int = 1):
  """Batches of (x, y); static_batch=False leaves the batch dimension unknown."""
  def fn():
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat(epochs)
    return ds.batch(batch_size, drop_remainder=static_batch)
  return fn


def variables(estimator: tf.estimator.Estimator) -> dict[str, np.ndarray]:
  return {n: estimator.get_variable_value(n) for n in estimator.get_variable_names()}


def predictions(estimator, fn, key='logits') -> np.ndarray:
  return np.stack([p[key] for p in estimator.predict(fn, yield_single_examples=True)])


def assert_variables_close(actual: dict, expected: dict, atol: float = 1e-5):
  assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
  for name in expected:
    np.testing.assert_allclose(actual[name], expected[name], atol=atol, rtol=0,
                               err_msg=f'variable {name}')


# --- Reference models ---------------------------------------------------------

def v1_model_fn(features, labels, mode, params):
  """tf.compat.v1.layers + a tf.compat.v1.train optimizer (batch-separable)."""
  x = features['x'] if isinstance(features, dict) else features
  hidden = tf.compat.v1.layers.dense(
      x, 4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  logits = tf.compat.v1.layers.dense(
      hidden, NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=3))
  classes = tf.argmax(logits, 1)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(
        mode, predictions={'logits': logits, 'classes': classes},
        export_outputs={'serving_default': tf.estimator.export.PredictOutput(
            {'logits': logits})})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'accuracy': tf.compat.v1.metrics.accuracy(labels, classes),
        'mean_logit': tf.compat.v1.metrics.mean(logits),
        'auc': tf.compat.v1.metrics.auc(
            tf.equal(labels, 0), tf.nn.softmax(logits)[:, 0]),
    })
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(
      (params or {}).get('learning_rate', LEARNING_RATE))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def keras_model_fn(features, labels, mode, params):
  """tf.keras.layers with BatchNormalization + a Keras legacy optimizer."""
  x = features['x'] if isinstance(features, dict) else features
  training = mode == tf.estimator.ModeKeys.TRAIN
  norm = tf.keras.layers.BatchNormalization(momentum=0.9)
  dense = tf.keras.layers.Dense(
      4, activation='tanh',
      kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))
  head = tf.keras.layers.Dense(
      NUM_CLASSES, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2),
      bias_initializer=tf.keras.initializers.RandomNormal(seed=3))
  logits = head(dense(norm(x, training=training)))
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True))
  if mode == tf.estimator.ModeKeys.EVAL:
    accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      eval_metric_ops={'accuracy': accuracy})
  optimizer = tf.keras.optimizers.legacy.SGD(
      (params or {}).get('learning_rate', LEARNING_RATE))
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  weights = norm.trainable_weights + dense.trainable_weights + head.trainable_weights
  train_op = tf.group(optimizer.get_updates(loss, weights), *norm.updates)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


MODELS = {'v1_layers': v1_model_fn, 'keras_bn': keras_model_fn}
