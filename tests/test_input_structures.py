"""Every input structure Estimator allows trains on every layout as plain.

The matrix: features a dict or a Tensor; labels absent (the input_fn yields
features only, as BERT's pre-training does), a Tensor or a dict; a loss that
is a mean over examples or a token ratio (a masked sum over a masked count, as
BERT's masked-LM loss, which the loss algebra rebuilds); and the layouts
2 towers copied, 2 towers built (the model_fn asks `current_tower()`),
1 device x 2 micro-batches and 2 devices x 2 micro-batches. Reference: the
plain single-device model_fn on the same batches, from the same explicit
initial values, after 2 steps of momentum SGD; every variable and slot within
testlib's tolerance.

Also: features only under staged input, and a signature without `labels`
(Estimator's model_fn may leave it out when the input has none).
"""

import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_graph import EstimatorGraph
from estimator_towers import current_tower
from estimator_towers import make_plan
from estimator_towers import replicate_model_fn
from estimator_towers import staged_input_fn

ModeKeys = tf.estimator.ModeKeys
BATCH = 7  # uneven shards on every layout
STEPS = 2
FEATURES = ('dict', 'tensor')
LABELS = ('absent', 'tensor', 'dict')
LOSSES = ('mean', 'token_ratio')
LAYOUTS = {
    'copied': dict(devices=2, micro_batches=1, ask_tower=False),
    'built': dict(devices=2, micro_batches=1, ask_tower=True),
    'micro': dict(devices=1, micro_batches=2, ask_tower=False),
    '2x2': dict(devices=2, micro_batches=2, ask_tower=False),
}


def make_data(seed=0):
  rng = np.random.RandomState(seed)
  x = rng.randn(BATCH * STEPS, 4).astype(np.float32)
  mask = (rng.rand(BATCH * STEPS, 3) < 0.7).astype(np.float32)
  mask[:, 0] = 1.0  # at least one token per example
  y = rng.randint(0, 3, BATCH * STEPS).astype(np.int32)
  return x, mask, y


def make_input_fn(features_kind, labels_kind, seed=0):
  x, mask, y = make_data(seed)

  def input_fn():
    features = {'x': x, 'mask': mask} if features_kind == 'dict' else np.concatenate(
        [x, mask], axis=1)
    if labels_kind == 'absent':
      data = features
    elif labels_kind == 'tensor':
      data = (features, y)
    else:
      data = (features, {'y': y, 'weight': (y + 1).astype(np.float32)})
    return tf.data.Dataset.from_tensor_slices(data).batch(BATCH)

  return input_fn


def make_model_fn(loss_kind, ask_tower):

  def model_fn(features, labels, mode):
    if ask_tower:
      current_tower()  # the towers are built, not copied
    if isinstance(features, dict):
      x, mask = features['x'], features['mask']
    else:
      x, mask = features[:, :4], features[:, 4:]
    if labels is None:  # features only: the targets come from the features
      y = tf.cast(x[:, 0] > 0, tf.int32)
    elif isinstance(labels, dict):
      y = labels['y']
    else:
      y = labels
    hidden = tf.compat.v1.layers.dense(
        x, 5, activation=tf.nn.tanh,
        kernel_initializer=tf.compat.v1.constant_initializer(
            np.linspace(-1, 1, 20).reshape(4, 5)))
    logits = tf.compat.v1.layers.dense(
        hidden, 3, kernel_initializer=tf.compat.v1.constant_initializer(
            np.linspace(1, -1, 15).reshape(5, 3)))
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    if loss_kind == 'mean':
      loss = tf.reduce_mean(xent)
    else:  # BERT's masked LM: per-token losses over the count of real tokens
      per_token = xent[:, None] * mask
      loss = tf.reduce_sum(per_token) / (tf.reduce_sum(mask) + 1e-5)
    if mode == ModeKeys.EVAL:
      return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
          'mean_logit': tf.compat.v1.metrics.mean(logits)})
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

  return model_fn


def trained(model_fn, input_fn, num_cpus):
  graph = EstimatorGraph(model_fn, input_fn, ModeKeys.TRAIN, num_cpus=num_cpus)
  try:
    assert graph.run() == STEPS
    with graph.graph.as_default():
      names = {v.op.name: v for v in tf.compat.v1.global_variables()}
    return graph.session.run(names)
  finally:
    graph.close()


CASES = list(itertools.product(FEATURES, LABELS, LOSSES, LAYOUTS))


@functools.lru_cache(maxsize=None)
def plain(features_kind, labels_kind, loss_kind, ask_tower):
  """The plain model_fn's variables (shared by the layouts that build the same model_fn)."""
  return trained(make_model_fn(loss_kind, ask_tower), make_input_fn(features_kind, labels_kind), 1)


@pytest.mark.parametrize('features_kind,labels_kind,loss_kind,layout', CASES,
                         ids=['-'.join(case) for case in CASES])
def test_every_input_structure_trains_as_plain(features_kind, labels_kind, loss_kind, layout):
  spec = LAYOUTS[layout]
  input_fn = make_input_fn(features_kind, labels_kind)
  model_fn = make_model_fn(loss_kind, spec['ask_tower'])
  expected = plain(features_kind, labels_kind, loss_kind, spec['ask_tower'])
  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(spec['devices']),
                               micro_batches=spec['micro_batches'])
  actual = trained(towered, input_fn, spec['devices'])
  testlib.assert_variables_close(actual, expected)


@pytest.mark.parametrize('loss_kind', LOSSES)
def test_features_only_under_staged_input(loss_kind):
  input_fn = make_input_fn('dict', 'absent')
  model_fn = make_model_fn(loss_kind, ask_tower=False)
  plan = make_plan(devices=testlib.cpu_devices(2), staging_depth=1)
  expected = trained(model_fn, input_fn, 1)
  actual = trained(replicate_model_fn(model_fn, plan=plan), staged_input_fn(input_fn, plan), 2)
  testlib.assert_variables_close(actual, expected)


@pytest.mark.parametrize('micro_batches', [1, 2])
def test_a_model_fn_without_labels_argument(micro_batches):
  inner = make_model_fn('token_ratio', ask_tower=False)

  def model_fn(features, mode):  # Estimator passes only the arguments it names
    return inner(features, None, mode)

  input_fn = make_input_fn('tensor', 'absent')
  expected = trained(model_fn, input_fn, 1)
  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(2),
                               micro_batches=micro_batches)
  testlib.assert_variables_close(trained(towered, input_fn, 2), expected)
