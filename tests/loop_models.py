"""Recurrent model_fns as users write them: loops, function calls, time-major tensors.

Each model_fn reads features {'x': [n, T, D] floats, 'length': [n] ints (each
example's own length, 1..T)} and labels [n] ints (the seq2seq model: labels
[n, T_OUT] ints, its target sequence), and trains with Momentum from seeded
initializers (`MODELS[name](features, labels, mode, params)`). What each holds:

- `dynamic_rnn`: `tf.compat.v1.nn.dynamic_rnn(LSTMCell)` (a While loop, or v1 frames;
  its time-major transposes, its TensorArrays).
- `bidirectional`: `bidirectional_dynamic_rnn` of an LSTM and a GRU cell with
  `sequence_length` (`ReverseSequence`, a loop bounded by the batch's longest example, each
  example's steps past its length copied through).
- `static_rnn`: `tf.unstack` on the time axis, `static_rnn(BasicRNNCell)`, `tf.stack`.
- `scan`: `tf.scan` of a recurrence over a time-major input.
- `map_fn`: `tf.map_fn` over the batch's examples (a loop over examples, one per step).
- `while_loop`: a user's `tf.while_loop` over time, `x[:, i]` read each step.
- `keras_lstm`, `keras_gru`, `keras_simple_rnn`, `keras_bidirectional`: Keras' recurrent
  layers (under TF2 behaviour the LSTM and GRU call a function picked by backend).
- `function_call`: a recurrence step as a `tf.function` called at each step (a
  `StatefulPartitionedCall` per step).
- `seq2seq`: a GRU encoder, a decoding loop with Luong attention over the encoder's outputs
  and teacher forcing (`tf.while_loop`, TensorArrays), a cross-entropy per step.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

BATCH, T, D, H, CLASSES, T_OUT, VOCAB = 12, 4, 3, 4, 3, 3, 5


def data(seed: int = 0):
  """(features, labels) as numpy, and the seq2seq model's labels."""
  rng = np.random.RandomState(seed)
  features = {'x': rng.randn(BATCH, T, D).astype(np.float32),
              'length': rng.randint(1, T + 1, size=BATCH).astype(np.int32)}
  features['length'][0] = T - 1   # the longest example is shorter than T
  labels = rng.randint(0, CLASSES, size=BATCH).astype(np.int32)
  targets = rng.randint(0, VOCAB, size=(BATCH, T_OUT)).astype(np.int32)
  return features, labels, targets


def _init(seed):
  return tf.compat.v1.glorot_uniform_initializer(seed=seed)


def _keras_init(seed):
  return tf.keras.initializers.GlorotUniform(seed=seed)


def _head(h, labels, mode):
  logits = tf.compat.v1.layers.dense(h, CLASSES, kernel_initializer=_init(99), name='logits')
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return _spec(mode, loss)


def _spec(mode, loss):
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def dynamic_rnn(features, labels, mode, params=None):
  with tf.compat.v1.variable_scope('rnn_model', initializer=_init(1)):
    outputs, state = tf.compat.v1.nn.dynamic_rnn(
        tf.compat.v1.nn.rnn_cell.LSTMCell(H), features['x'], dtype=tf.float32)
    h = tf.concat([outputs[:, -1], state.c], 1)
  return _head(h, labels, mode)


def bidirectional(features, labels, mode, params=None):
  with tf.compat.v1.variable_scope('rnn_model', initializer=_init(2)):
    (fw, bw), (fw_state, bw_state) = tf.compat.v1.nn.bidirectional_dynamic_rnn(
        tf.compat.v1.nn.rnn_cell.LSTMCell(H), tf.compat.v1.nn.rnn_cell.GRUCell(H),
        features['x'], sequence_length=features['length'], dtype=tf.float32)
    h = tf.concat([tf.reduce_sum(fw + bw, 1), fw_state.h, bw_state], 1)
  return _head(h, labels, mode)


def static_rnn(features, labels, mode, params=None):
  with tf.compat.v1.variable_scope('rnn_model', initializer=_init(3)):
    steps = tf.unstack(features['x'], T, axis=1)
    outputs, state = tf.compat.v1.nn.static_rnn(
        tf.compat.v1.nn.rnn_cell.BasicRNNCell(H), steps, dtype=tf.float32)
    h = tf.reduce_mean(tf.stack(outputs, 1), 1) + state
  return _head(h, labels, mode)


def scan(features, labels, mode, params=None):
  with tf.compat.v1.variable_scope('rnn_model', initializer=_init(4)):
    w = tf.compat.v1.get_variable('w', [D, H])
    u = tf.compat.v1.get_variable('u', [H, H])
    time_major = tf.transpose(features['x'], [1, 0, 2])
    start = tf.zeros([tf.shape(features['x'])[0], H])
    states = tf.scan(lambda h, x_t: tf.tanh(tf.matmul(x_t, w) + tf.matmul(h, u)),
                     time_major, initializer=start)
    h = tf.reduce_max(states, 0)
  return _head(h, labels, mode)


def map_fn(features, labels, mode, params=None):
  with tf.compat.v1.variable_scope('rnn_model', initializer=_init(5)):
    w = tf.compat.v1.get_variable('w', [D, H])
    def each(example):   # [T, D] -> [H]: one example's values alone
      hidden = tf.tanh(tf.matmul(example, w))
      return tf.reduce_max(hidden, 0) + tf.reduce_mean(hidden, 0)
    h = tf.map_fn(each, features['x'])
  return _head(h, labels, mode)


def while_loop(features, labels, mode, params=None):
  with tf.compat.v1.variable_scope('rnn_model', initializer=_init(6)):
    x = features['x']
    w = tf.compat.v1.get_variable('w', [D, H])
    u = tf.compat.v1.get_variable('u', [H, H])
    def body(i, h, total):
      h = tf.tanh(tf.matmul(x[:, i], w) + tf.matmul(h, u))
      return i + 1, h, total + h
    start = tf.zeros([tf.shape(x)[0], H])
    _, h, total = tf.while_loop(lambda i, h, total: i < tf.shape(x)[1], body,
                                [tf.constant(0), start, start])
  return _head(tf.concat([h, total], 1), labels, mode)


def _keras(layer, features, labels, mode):
  h = layer(features['x'])
  return _head(h, labels, mode)


def keras_lstm(features, labels, mode, params=None):
  return _keras(tf.keras.layers.LSTM(H, kernel_initializer=_keras_init(7),
                                     recurrent_initializer=_keras_init(8)),
                features, labels, mode)


def keras_gru(features, labels, mode, params=None):
  return _keras(tf.keras.layers.GRU(H, kernel_initializer=_keras_init(9),
                                    recurrent_initializer=_keras_init(10)),
                features, labels, mode)


def keras_simple_rnn(features, labels, mode, params=None):
  return _keras(tf.keras.layers.SimpleRNN(H, kernel_initializer=_keras_init(11),
                                          recurrent_initializer=_keras_init(12)),
                features, labels, mode)


def keras_bidirectional(features, labels, mode, params=None):
  return _keras(tf.keras.layers.Bidirectional(tf.keras.layers.LSTM(
      H, kernel_initializer=_keras_init(13), recurrent_initializer=_keras_init(14))),
                features, labels, mode)


def seq2seq(features, labels, mode, params=None):
  """A GRU encoder; a decoder loop with Luong attention, fed the target's previous token."""
  targets = labels
  with tf.compat.v1.variable_scope('seq2seq', initializer=_init(15)):
    memory, state = tf.compat.v1.nn.dynamic_rnn(
        tf.compat.v1.nn.rnn_cell.GRUCell(H), features['x'], dtype=tf.float32, scope='encoder')
    embeddings = tf.compat.v1.get_variable('embeddings', [VOCAB, H])
    cell = tf.compat.v1.nn.rnn_cell.GRUCell(H, name='decoder')
    attention_w = tf.compat.v1.get_variable('attention', [H, H])
    output_w = tf.compat.v1.get_variable('output', [2 * H, VOCAB])
    batch = tf.shape(targets)[0]
    previous = tf.concat([tf.zeros([batch, 1], tf.int32), targets[:, :-1]], 1)   # teacher forcing
    inputs = tf.compat.v1.TensorArray(tf.float32, T_OUT).unstack(
        tf.transpose(tf.nn.embedding_lookup(embeddings, previous), [1, 0, 2]))
    keys = tf.einsum('btd,de->bte', memory, attention_w)

    def step(t, h, logits_ta):
      h, _ = cell(inputs.read(t), h)
      scores = tf.squeeze(tf.matmul(keys, tf.expand_dims(h, 2)), 2)   # [n, T]
      alignment = tf.nn.softmax(scores)
      context = tf.reduce_sum(tf.expand_dims(alignment, 2) * memory, 1)
      logits = tf.matmul(tf.concat([h, context], 1), output_w)
      return t + 1, h, logits_ta.write(t, logits)

    _, _, logits_ta = tf.while_loop(
        lambda t, *_: t < T_OUT, step,
        [tf.constant(0), state, tf.compat.v1.TensorArray(tf.float32, T_OUT)])
    logits = tf.transpose(logits_ta.stack(), [1, 0, 2])   # [n, T_OUT, VOCAB]
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(targets, logits)
  return _spec(mode, loss)


MODELS = {f.__name__: f for f in (
    dynamic_rnn, bidirectional, static_rnn, scan, map_fn, while_loop, keras_lstm, keras_gru,
    keras_simple_rnn, keras_bidirectional, seq2seq)}


def function_call(features, labels, mode, params=None):
  """A recurrence step as a `tf.function` called in graph mode (a PartitionedCall), in a
  `tf.while_loop` over time."""
  with tf.compat.v1.variable_scope('rnn_model', initializer=_init(16)):
    x = features['x']
    w = tf.compat.v1.get_variable('w', [D, H])
    u = tf.compat.v1.get_variable('u', [H, H])

    @tf.function
    def step(x_t, h):
      return tf.tanh(tf.matmul(x_t, w) + tf.matmul(h, u))

    h = tf.zeros([tf.shape(x)[0], H])
    for t in range(T):
      h = step(x[:, t], h)
  return _head(h, labels, mode)


MODELS['function_call'] = function_call
