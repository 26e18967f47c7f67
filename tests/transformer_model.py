"""A padded Transformer encoder whose FFN removes padding, as the official r1 Transformer's.

Token ids [B, T] with trailing zeros as padding (each example its own
length); embeddings times sqrt(H) plus sinusoid position encodings of
`tf.shape(x)[1]`; one self-attention layer written with `tf.matmul`
(BatchMatMulV2, per example) under the r1 attention bias
`expand_dims(expand_dims(padding, 1), 1) * -1e9`; the r1 FFN with
`allow_pad=True` verbatim (gather_nd of the non-pad tokens, expand_dims to
[1, n, H], two `tf.compat.v1.layers.Dense` on rank 3 (tensordot), squeeze,
scatter_nd back); r1's layer norm; logits by the shared embeddings; r1's
`padded_cross_entropy_loss` (the logits padded to the labels' length by a
`tf.pad` computed from `tf.shape(...)[1]`, label smoothing), weighted by
the non-pad mask: sum(xent * w) / sum(w).

Features are {'inputs': ids, 'targets': ids} (labels None), or
{'inputs': ids} with the targets as labels (`labels_variant`).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

VOCAB, T, HIDDEN, FILTER, HEADS = 16, 6, 8, 16, 2
SMOOTHING = 0.1


def data(num_examples: int = 12, seed: int = 0) -> dict:
  """{'inputs', 'targets'}: int32 [n, T], each row a random length 1..T then zeros."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(1, T + 1, size=num_examples)
  lengths[:3] = (T, 1, 3)   # a full row and a one-token row in every run
  inputs = rng.randint(1, VOCAB, size=[num_examples, T]).astype(np.int32)
  targets = rng.randint(1, VOCAB, size=[num_examples, T]).astype(np.int32)
  pad = np.arange(T)[None, :] >= lengths[:, None]
  inputs[pad] = 0
  targets[pad] = 0
  return {'inputs': inputs, 'targets': targets}


def input_fn(features: dict, batch_size: int = 12, labels_variant: bool = False):
  """Batches of the features (repeated), labels None or the targets."""
  def fn():
    if labels_variant:
      ds = tf.data.Dataset.from_tensor_slices(({'inputs': features['inputs']},
                                               features['targets']))
    else:
      ds = tf.data.Dataset.from_tensor_slices(features)
    return ds.repeat().batch(batch_size)
  return fn


def _dense(units, name, seed, activation=None, use_bias=True):
  return tf.compat.v1.layers.Dense(
      units, activation=activation, use_bias=use_bias, name=name,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))


def position_encoding(length, hidden_size, min_timescale=1.0, max_timescale=1.0e4):
  """r1 model_utils.get_position_encoding: [length, hidden_size]."""
  position = tf.cast(tf.range(length), tf.float32)
  num_timescales = hidden_size // 2
  log_timescale_increment = (math.log(float(max_timescale) / float(min_timescale)) /
                             (tf.cast(num_timescales, tf.float32) - 1))
  inv_timescales = min_timescale * tf.exp(
      tf.cast(tf.range(num_timescales), tf.float32) * -log_timescale_increment)
  scaled_time = tf.expand_dims(position, 1) * tf.expand_dims(inv_timescales, 0)
  return tf.concat([tf.sin(scaled_time), tf.cos(scaled_time)], axis=1)


def layer_norm(x, name, epsilon=1e-6):
  """r1 LayerNormalization."""
  with tf.compat.v1.variable_scope(name):
    scale = tf.compat.v1.get_variable('layer_norm_scale', [HIDDEN],
                                      initializer=tf.ones_initializer())
    bias = tf.compat.v1.get_variable('layer_norm_bias', [HIDDEN],
                                     initializer=tf.zeros_initializer())
    mean = tf.reduce_mean(x, axis=[-1], keepdims=True)
    variance = tf.reduce_mean(tf.square(x - mean), axis=[-1], keepdims=True)
    norm_x = (x - mean) * tf.math.rsqrt(variance + epsilon)
    return norm_x * scale + bias


def attention(x, bias):
  """r1 attention_layer.Attention (self-attention), its products by tf.matmul."""
  with tf.compat.v1.variable_scope('self_attention'):
    q = _dense(HIDDEN, 'q', 11, use_bias=False)(x)
    k = _dense(HIDDEN, 'k', 12, use_bias=False)(x)
    v = _dense(HIDDEN, 'v', 13, use_bias=False)(x)

    def split_heads(t):
      batch_size, length = tf.shape(t)[0], tf.shape(t)[1]
      t = tf.reshape(t, [batch_size, length, HEADS, HIDDEN // HEADS])
      return tf.transpose(t, [0, 2, 1, 3])

    q, k, v = split_heads(q), split_heads(k), split_heads(v)
    q *= (HIDDEN // HEADS) ** -0.5
    logits = tf.matmul(q, k, transpose_b=True) + bias
    weights = tf.nn.softmax(logits, name='attention_weights')
    out = tf.matmul(weights, v)
    batch_size, length = tf.shape(out)[0], tf.shape(out)[2]
    out = tf.reshape(tf.transpose(out, [0, 2, 1, 3]), [batch_size, length, HIDDEN])
    return _dense(HIDDEN, 'output_transform', 14, use_bias=False)(out)


def feed_forward(x, padding, center=False):
  """r1 ffn_layer.FeedFowardNetwork with allow_pad=True, verbatim.

  `center`: the non-pad tokens less their mean over the batch before the
  layers (a mixing op inside the FFN: its head reads the scatter's positions).
  """
  with tf.compat.v1.variable_scope('ffn'):
    batch_size, length = tf.shape(x)[0], tf.shape(x)[1]
    with tf.name_scope('remove_padding'):
      pad_mask = tf.reshape(padding, [-1])
      nonpad_ids = tf.cast(tf.where(pad_mask < 1e-9), tf.int32)
      x = tf.reshape(x, [-1, HIDDEN])
      x = tf.gather_nd(x, indices=nonpad_ids)
      x.set_shape([None, HIDDEN])
      if center:
        x -= tf.reduce_mean(x, axis=0, keepdims=True)
      x = tf.expand_dims(x, axis=0)
    output = _dense(FILTER, 'filter_layer', 21, activation=tf.nn.relu)(x)
    output = _dense(HIDDEN, 'output_layer', 22)(output)
    with tf.name_scope('re_add_padding'):
      output = tf.squeeze(output, axis=0)
      output = tf.scatter_nd(indices=nonpad_ids, updates=output,
                             shape=[batch_size * length, HIDDEN])
      output = tf.reshape(output, [batch_size, length, HIDDEN])
    return output


def _pad_tensors_to_same_length(x, y):
  """r1 metrics._pad_tensors_to_same_length: pad x and y on axis 1 to the same length."""
  with tf.name_scope('pad_to_same_length'):
    x_length, y_length = tf.shape(x)[1], tf.shape(y)[1]
    max_length = tf.maximum(x_length, y_length)
    x = tf.pad(x, [[0, 0], [0, max_length - x_length], [0, 0]])
    y = tf.pad(y, [[0, 0], [0, max_length - y_length]])
    return x, y


def padded_cross_entropy_loss(logits, labels, smoothing, vocab_size):
  """r1 metrics.padded_cross_entropy_loss: (xent per token, non-pad weights)."""
  with tf.name_scope('loss'):
    logits, labels = _pad_tensors_to_same_length(logits, labels)
    with tf.name_scope('smoothing_cross_entropy'):
      confidence = 1.0 - smoothing
      low_confidence = (1.0 - confidence) / float(vocab_size - 1)
      soft_targets = tf.one_hot(tf.cast(labels, tf.int32), depth=vocab_size,
                                on_value=confidence, off_value=low_confidence)
      xentropy = tf.nn.softmax_cross_entropy_with_logits(logits=logits, labels=soft_targets)
      normalizing_constant = -(
          confidence * math.log(confidence) + float(vocab_size - 1) * low_confidence *
          math.log(low_confidence + 1e-20))
      xentropy -= normalizing_constant
    weights = tf.cast(tf.not_equal(labels, 0), tf.float32)
    return xentropy * weights, weights


def encoder_logits(inputs, center=False):
  """Logits [B, T, VOCAB] of the padded encoder."""
  embeddings = tf.compat.v1.get_variable(
      'embeddings', [VOCAB, HIDDEN],
      initializer=tf.compat.v1.random_normal_initializer(0.0, HIDDEN ** -0.5, seed=1))
  padding = tf.cast(tf.equal(inputs, 0), tf.float32)
  x = tf.gather(embeddings, inputs) * HIDDEN ** 0.5
  x *= tf.expand_dims(1.0 - padding, -1)
  x += position_encoding(tf.shape(x)[1], HIDDEN)
  bias = tf.expand_dims(tf.expand_dims(padding * -1e9, axis=1), axis=1)
  x = layer_norm(x + attention(x, bias), 'attention_norm')
  x = layer_norm(x + feed_forward(x, padding, center), 'ffn_norm')
  batch_size, length = tf.shape(x)[0], tf.shape(x)[1]
  logits = tf.matmul(tf.reshape(x, [-1, HIDDEN]), embeddings, transpose_b=True)
  return tf.reshape(logits, [batch_size, length, VOCAB])


def model_fn(features, labels, mode, params, config=None):  # pylint: disable=unused-argument
  """The padded encoder trained by params['optimizer'] ('momentum' or 'adam')."""
  targets = features['targets'] if labels is None else labels
  logits = encoder_logits(features['inputs'], (params or {}).get('center', False))
  xentropy, weights = padded_cross_entropy_loss(logits, targets, SMOOTHING, VOCAB)
  loss = tf.reduce_sum(xentropy) / tf.reduce_sum(weights)   # xentropy is xent * weights
  if mode != tf.estimator.ModeKeys.TRAIN:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  if (params or {}).get('optimizer', 'momentum') == 'adam':
    optimizer = tf.compat.v1.train.AdamOptimizer(0.01)
  else:
    optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
