"""The optimizers and wrappers docs/optimizers.md lists as supported train like one device.

(More patterns, with other models, are in test_real_world.py and test_canned.py.)

Each case: three steps on two towers with a batch of 7 (uneven shards), against
the plain model_fn on one device (same data, same initial values).
"""

import pytest
import tensorflow as tf

import testlib
from estimator_towers import replicate_model_fn

V1 = tf.compat.v1.train
KERAS = tf.keras.optimizers.legacy

OPTIMIZERS = {
    'GradientDescent': lambda: V1.GradientDescentOptimizer(0.5),
    'Momentum(compute_gradients+apply_gradients)': lambda: TwoCalls(V1.MomentumOptimizer(0.3, 0.9)),
    'Momentum(nesterov)': lambda: V1.MomentumOptimizer(0.3, 0.9, use_nesterov=True),
    'Adam': lambda: V1.AdamOptimizer(0.05),
    'Adagrad': lambda: V1.AdagradOptimizer(0.3),
    'Adadelta': lambda: V1.AdadeltaOptimizer(1.0),
    'RMSProp': lambda: V1.RMSPropOptimizer(0.05, momentum=0.5),
    'Ftrl': lambda: V1.FtrlOptimizer(0.3, l1_regularization_strength=0.01),
    'ProximalAdagrad': lambda: V1.ProximalAdagradOptimizer(0.3),
    'MixedPrecisionLossScale(fixed)': lambda: V1.experimental.MixedPrecisionLossScaleOptimizer(
        V1.GradientDescentOptimizer(0.5), 128.0),
    'MixedPrecisionLossScale(dynamic)': lambda: V1.experimental.MixedPrecisionLossScaleOptimizer(
        V1.GradientDescentOptimizer(0.5), 'dynamic'),
    'clip_by_value(compute_gradients+apply_gradients)': lambda: Clipped(
        V1.GradientDescentOptimizer(0.5)),
    'keras.SGD(momentum)': lambda: KERAS.SGD(0.3, momentum=0.9),
    'keras.Adam': lambda: KERAS.Adam(0.05),
    'keras.RMSprop': lambda: KERAS.RMSprop(0.05),
    'keras.Adagrad': lambda: KERAS.Adagrad(0.3),
    'keras.SGD(clipnorm)': lambda: KERAS.SGD(0.5, clipnorm=0.05),
    'keras.SGD(global_clipnorm)': lambda: KERAS.SGD(0.5, global_clipnorm=0.05),
    'keras.LossScaleOptimizer(dynamic)': lambda: tf.keras.mixed_precision.LossScaleOptimizer(
        KERAS.SGD(0.5)),
}


class TwoCalls:
  """minimize() written out as compute_gradients + apply_gradients."""

  def __init__(self, optimizer):
    self.optimizer = optimizer

  def minimize(self, loss, global_step):
    grads_and_vars = self.optimizer.compute_gradients(loss)
    return self.optimizer.apply_gradients(grads_and_vars, global_step)


class Clipped(TwoCalls):
  """Gradients clipped elementwise between compute_gradients and apply_gradients."""

  def minimize(self, loss, global_step):
    grads_and_vars = [(tf.clip_by_value(g, -0.01, 0.01), v)
                      for g, v in self.optimizer.compute_gradients(loss)]
    return self.optimizer.apply_gradients(grads_and_vars, global_step)


def model_fn_with(make_optimizer):
  def model_fn(features, labels, mode, params):
    hidden = tf.compat.v1.layers.dense(
        features, 4, activation=tf.nn.tanh,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
    logits = tf.compat.v1.layers.dense(
        hidden, testlib.NUM_CLASSES,
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    optimizer = make_optimizer()
    global_step = tf.compat.v1.train.get_global_step()
    if isinstance(optimizer, (KERAS.Optimizer, tf.keras.mixed_precision.LossScaleOptimizer)):
      optimizer.iterations = global_step
      train_op = tf.group(optimizer.get_updates(loss, tf.compat.v1.trainable_variables()))
    else:
      train_op = optimizer.minimize(loss, global_step)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return model_fn


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_optimizer_trains_like_one_device(name, tmp_path):
  model_fn = model_fn_with(OPTIMIZERS[name])
  x, y = testlib.data(7)
  fn = testlib.input_fn(x, y, 7, epochs=3)
  plain = testlib.make_estimator(model_fn, model_dir=str(tmp_path / 'plain'))
  plain.train(fn, steps=3)
  towered = testlib.make_estimator(replicate_model_fn(model_fn, devices=testlib.cpu_devices(2)),
                                   num_cpus=2, model_dir=str(tmp_path / 'towered'))
  towered.train(fn, steps=3)
  expected = testlib.variables(plain)
  assert expected['global_step'] == 3
  testlib.assert_variables_close(testlib.variables(towered), expected)
