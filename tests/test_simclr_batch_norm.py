"""SimCLR with batch norm under sync_batch_norm: exact, and data-parallel.

A SimCLR model stacks an example's two views on the batch axis
(`concat(split(x, 2, -1), 0)`: rows in 2 blocks), encodes them with a batch
norm and scores them with NT-Xent over the whole batch. With
`sync_batch_norm=True` every tower normalises with the whole batch's
statistics, so 3 towers train as the plain model_fn on the whole batch: every
variable, the batch norm's moving mean and variance and the Momentum slots
within 1e-5 after 2 steps, fused and not fused, with no warning, and each
device holds at least 0.9 x the plain graph's heavy ops (the encoder runs on
every tower; only the NT-Xent head reads the gathered rows).

The token encoder's batch norm is over every token: the [2n, T, d] features
reshaped to [2n * T, 1, 1, d] for the fused kernel (flat rows: a stacked
layout's two blocks of entries) and back. The dense (per-token) NT-Xent's head
reads those flat rows themselves, gathered block by block. A conv SimCLR and
a batch-norm convnet with a per-example loss are controls.

Micro-batches with sync batch norm are refused by design (docs/micro_batches.md).
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import heavy_ops
import testlib
import estimator_towers as et
from estimator_towers.rows import row_dependence as rd

ModeKeys = tf.estimator.ModeKeys
BATCH, TOKENS, HIDDEN = 12, 4, 8
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


def _dense(x, units, name, seed=1):
  return tf.compat.v1.layers.dense(
      x, units, name=name, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))


def _batch_norm(h, fused):
  return tf.compat.v1.layers.batch_normalization(h, training=True, fused=fused, momentum=0.8)


def token_encoder(views, fused):
  """A dense layer per token, a batch norm over every token (as [2n * T, 1, 1, d]), a mean."""
  e = _dense(views, HIDDEN, 'encoder')
  h = _batch_norm(tf.reshape(e, [-1, 1, 1, HIDDEN]), fused)
  return tf.reduce_mean(tf.nn.relu(tf.reshape(h, tf.shape(e))), 1)


def conv_encoder(views, fused):
  h = tf.compat.v1.layers.conv2d(
      views, HIDDEN, 3, padding='same', name='conv',
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  return tf.reduce_mean(tf.nn.relu(_batch_norm(h, fused)), [1, 2])


def nt_xent(hidden):
  """SimCLR's loss (tests/cross_example_models.py `simclr`) of 2 views stacked on axis 0."""
  h1, h2 = tf.split(hidden, 2, 0)
  batch = tf.shape(h1)[0]
  labels = tf.one_hot(tf.range(batch), batch * 2)
  masks = tf.one_hot(tf.range(batch), batch)
  aa = tf.matmul(h1, h1, transpose_b=True) / 0.5 - masks * 1e9
  bb = tf.matmul(h2, h2, transpose_b=True) / 0.5 - masks * 1e9
  ab = tf.matmul(h1, h2, transpose_b=True) / 0.5
  ba = tf.matmul(h2, h1, transpose_b=True) / 0.5
  loss_a = tf.compat.v1.losses.softmax_cross_entropy(labels, tf.concat([ab, aa], 1))
  loss_b = tf.compat.v1.losses.softmax_cross_entropy(labels, tf.concat([ba, bb], 1))
  return loss_a + loss_b


def _train_spec(mode, loss):
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def simclr_model_fn(features, labels, mode, params, config=None, encoder=None, fused=True):
  views = tf.concat(tf.split(features['x'], 2, -1), 0)
  hidden = tf.math.l2_normalize(_dense(encoder(views, fused), 4, 'head'), -1)
  return _train_spec(mode, nt_xent(hidden))


def nt_xent_2n(hidden):
  """NT-Xent on the whole 2N x 2N similarity matrix (each row's positive: its other view)."""
  rows = tf.shape(hidden)[0]
  half = rows // 2
  labels = tf.concat([tf.range(half) + half, tf.range(half)], 0)
  logits = tf.matmul(hidden, hidden, transpose_b=True) / 0.5 - tf.eye(rows) * 1e9
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


def dense_simclr_model_fn(features, labels, mode, params, config=None, fused=True):
  """NT-Xent per token (dense contrastive learning): the head reads flat rows in 2 blocks."""
  views = tf.concat(tf.split(features['x'], 2, -1), 0)
  e = _dense(views, HIDDEN, 'encoder')
  h = tf.nn.relu(_batch_norm(tf.reshape(e, [-1, 1, 1, HIDDEN]), fused))
  tokens = tf.math.l2_normalize(_dense(tf.reshape(h, [-1, HIDDEN]), 4, 'head'), -1)
  return _train_spec(mode, nt_xent_2n(tokens) if fused else nt_xent(tokens))


def convnet_model_fn(features, labels, mode, params, config=None):
  """Conv2D, a fused batch norm, a dense layer: a per-example loss (the control)."""
  h = conv_encoder(features['x'], fused=True)
  logits = _dense(h, 3, 'logits', seed=3)
  return _train_spec(mode, tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)))


def _data(shape):
  """The shards' examples scaled differently: shard statistics far from the batch's."""
  rng = np.random.RandomState(0)
  x = rng.randn(BATCH, *shape).astype(np.float32)
  scale = np.linspace(0.2, 3.0, BATCH, dtype=np.float32).reshape([BATCH] + [1] * len(shape))
  return {'x': x * scale + 1.0}, (np.arange(BATCH) % 3).astype(np.int32)


TOKENS_DATA = (TOKENS, 6)
IMAGES_DATA = (4, 4, 6)


def _input_fn(features, labels):
  def fn():   # the batch size unknown, as most input_fns give it
    return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(BATCH)
  return fn


def _check(model_fn, shape, warnings, num_devices=3, min_share=0.9):
  """2 steps towered (sync batch norm) == 2 steps plain; no warning; the least share.

  `min_share=None`: a head that runs once on the whole batch (exact, not split per
  tower), whose one warning (`work_share`'s) is expected.
  """
  features, labels = _data(shape)
  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                                  sync_batch_norm=True)
  if min_share is not None:
    share = heavy_ops.least_share(heavy_ops.train_graph(towered, features, labels),
                                  heavy_ops.train_graph(model_fn, features, labels), num_devices)
    assert share >= min_share, f'the least loaded device holds {share:.2f} of plain\'s heavy ops'
  plain = testlib.make_estimator(model_fn)
  plain.train(_input_fn(features, labels), steps=2)
  est = testlib.make_estimator(towered, num_cpus=num_devices)
  est.train(_input_fn(features, labels), steps=2)
  expected = testlib.variables(plain)
  assert 'batch_normalization/moving_variance' in expected
  assert any(name.endswith('/Momentum') for name in expected)
  testlib.assert_variables_close(testlib.variables(est), expected)
  if min_share is None:   # a head run once on the whole batch: work_share's warning only
    warnings = [w for w in warnings if 'cross_example=\'refuse\'' not in w]
  assert not warnings, warnings


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'not_fused'])
def test_simclr_token_encoder_equals_plain_on_every_tower(fused, warnings):
  _check(functools.partial(simclr_model_fn, encoder=token_encoder, fused=fused), TOKENS_DATA,
         warnings)


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'not_fused'])
def test_dense_simclr_head_of_flat_rows_equals_plain(fused, warnings):
  """The head reads flat rows (fused: the 2N x 2N matrix of the token rows in 2 blocks; not
  fused: each view's tokens); not row-wise: it runs once, on the whole batch."""
  _check(functools.partial(dense_simclr_model_fn, fused=fused), TOKENS_DATA, warnings,
         min_share=None)


def test_simclr_conv_encoder_equals_plain_on_every_tower(warnings):
  """The control: a fused batch norm of [2n, H, W, C] rows (exact before flat rows kept blocks)."""
  _check(functools.partial(simclr_model_fn, encoder=conv_encoder, fused=True), IMAGES_DATA,
         warnings)


def test_batch_norm_convnet_equals_plain_on_every_tower(warnings):
  """The control: no mixing op but the batch norm; a per-example loss."""
  _check(convnet_model_fn, IMAGES_DATA, warnings)


def test_the_reader_keeps_the_views_blocks_through_flat_rows():
  """[2n, T, d] -> [2n * T, 1, 1, d] -> batch norm -> back: flat rows in 2 blocks, then rows."""
  with tf.Graph().as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, TOKENS, 6])
    views = tf.concat(tf.split(x, 2, -1), 0)
    flat = tf.reshape(views, [-1, 1, 1, 3])
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(flat, tf.ones([3]), tf.zeros([3]))
    back = tf.reshape(y, tf.shape(views))
    first, second = tf.split(tf.reshape(y, [-1, 3]), 2, 0)
    found = rd.classify([tf.reduce_sum(back), first, second], [x])
  assert found.mixing == []
  def layout(t):   # (kind, blocks): the count of entries per example is another matter
    return found.kind(t).tag, found.kind(t).blocks
  assert layout(flat) == layout(y) == (rd.FLAT, 2)
  assert layout(back) == (rd.ROWS, 2)
  assert layout(first) == layout(second) == (rd.FLAT, 1)
  assert found.kind(flat).per == found.kind(y).per == TOKENS   # T rows per example per block


@pytest.mark.parametrize('devices', [1, 2], ids=['micro_batches', 'devices_x_micro_batches'])
def test_sync_batch_norm_with_micro_batches_is_refused(devices):
  """docs/micro_batches.md: global statistics would need every micro-batch's forward pass first."""
  with pytest.raises(ValueError, match=r'sync_batch_norm=True and micro_batches=2 cannot be combined'):
    et.replicate_model_fn(functools.partial(simclr_model_fn, encoder=token_encoder),
                          devices=testlib.cpu_devices(devices), sync_batch_norm=True,
                          micro_batches=2)


def attention_before_batch_norm_model_fn(features, labels, mode, params, config=None,
                                         fused=True):
  """SimCLR whose encoder attends over the stacked views before its batch norm.

  The whole batch's head starts before the attention, so it would hold the
  synchronised batch norm. (Without the stacked views `batch_mixing` cuts the
  towers after the attention instead, and that is exact.)
  """
  views = tf.concat(tf.split(features['x'][:, 0, :], 2, -1), 0)
  e = _dense(views, HIDDEN, 'encoder')
  e = e + tf.matmul(tf.nn.softmax(tf.matmul(e, e, transpose_b=True)), e)
  h = _batch_norm(tf.reshape(e, [-1, 1, 1, HIDDEN]), fused)
  hidden = tf.math.l2_normalize(_dense(tf.nn.relu(tf.reshape(h, [-1, HIDDEN])), 4, 'head'), -1)
  return _train_spec(mode, nt_xent(hidden))


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'not_fused'])
def test_a_synchronised_batch_norm_after_mixing_ops_is_warned_not_copied(fused, warnings):
  """Not a crash (a copied fused gradient) nor silently wrong (a copied join): one warning."""
  features, labels = _data(TOKENS_DATA)
  model_fn = functools.partial(attention_before_batch_norm_model_fn, fused=fused)
  heavy_ops.train_graph(et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3),
                                              sync_batch_norm=True), features, labels)
  assert len(warnings) == 1, warnings
  assert 'holds a batch norm synchronised across the towers' in warnings[0]
  with pytest.raises(ValueError, match='holds a batch norm synchronised across the towers'):
    heavy_ops.train_graph(et.replicate_model_fn(
        model_fn, devices=testlib.cpu_devices(3), sync_batch_norm=True,
        loss_reduction='exact'), features, labels)
