"""Models of issue 33 written for one device, whose losses mix the batch's rows.

Each takes a shard's features x ([n, F]) and labels y and returns (loss, the
per-example tensors the first mixing ops read). Shared by
tests/test_row_dependence.py and tests/test_cross_example.py.
"""

import tensorflow as tf

F = 6


def dense(x, units, name):
  return tf.compat.v1.layers.dense(
      x, units, name=name, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))


def encoders(x):
  q = tf.math.l2_normalize(dense(x[:, :3], 4, 'query'), axis=-1)
  d = tf.math.l2_normalize(dense(x[:, 3:], 4, 'doc'), axis=-1)
  return q, d


def in_batch_softmax(x, y):
  q, d = encoders(x)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  labels = tf.range(tf.shape(q)[0])
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)), [q, d]


def clip(x, y):
  q, d = encoders(x)
  scale = tf.compat.v1.get_variable('log_scale', [], initializer=tf.compat.v1.zeros_initializer())
  logits = tf.exp(scale) * tf.matmul(q, tf.transpose(d))
  labels = tf.range(tf.shape(q)[0])
  rows = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  columns = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.transpose(logits))
  return (tf.reduce_mean(rows) + tf.reduce_mean(columns)) / 2, [q, d]


def simclr(x, y):
  """NT-Xent on two views stacked on the batch axis, as google-research/simclr."""
  views = tf.concat(tf.split(x, 2, -1), 0)
  hidden = tf.math.l2_normalize(dense(tf.nn.relu(dense(views, 5, 'encoder')), 4, 'head'), -1)
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
  return loss_a + loss_b, [h1, h2]


def logits_and_xent(x, y):
  logits = dense(x, 3, 'logits')
  return logits, tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)


def top_k(x, y):
  _, xent = logits_and_xent(x, y)
  k = tf.minimum(3, tf.shape(xent)[0])   # a batch of 2 has 2
  return tf.reduce_mean(xent) + tf.reduce_mean(tf.math.top_k(xent, k).values), [xent]


def opaque(x, y):
  embeddings = dense(x, 4, 'embeddings')

  @tf.function
  def batch_loss(e):
    return tf.reduce_mean(tf.reduce_logsumexp(tf.matmul(e, e, transpose_b=True), 1))

  return batch_loss(embeddings), [embeddings]


def mixup(x, y):
  mixed = 0.7 * x + 0.3 * tf.reverse(x, [0])
  onehot = tf.one_hot(y, 3)
  labels = 0.7 * onehot + 0.3 * tf.reverse(onehot, [0])
  logits = dense(mixed, 3, 'logits')
  return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels, logits)), [x]


def attention(x, y):
  h = dense(x, 4, 'hidden')
  mixed = h + tf.matmul(tf.nn.softmax(tf.matmul(h, h, transpose_b=True)), h)
  logits = dense(mixed, 3, 'logits')
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)), [h]


def two_levels(x, y):
  """An in-batch softmax of q, d = f(h), plus a similarity of h itself: the head reads both."""
  h = tf.nn.tanh(dense(x, 5, 'shared'))
  q = tf.math.l2_normalize(dense(h, 4, 'query'), axis=-1)
  d = tf.math.l2_normalize(dense(h, 4, 'doc'), axis=-1)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  labels = tf.range(tf.shape(q)[0])
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  return loss + 0.1 * tf.reduce_mean(tf.matmul(h, h, transpose_b=True)), [q, d, h]


def dropout_before_the_cut(x, y):
  """An in-batch softmax of encoders that drop inputs: a random op before the frontier."""
  return in_batch_softmax(tf.nn.dropout(x, rate=0.2, seed=1), y)


def per_example(x, y):
  _, xent = logits_and_xent(x, y)
  return tf.reduce_mean(xent), []


PATTERNS = {  # name: (model, type of the first mixing op)
    'in_batch_softmax': (in_batch_softmax, 'MatMul'),
    'clip': (clip, 'MatMul'),
    'simclr': (simclr, 'MatMul'),
    'top_k': (top_k, 'TopKV2'),
    'opaque': (opaque, 'StatefulPartitionedCall'),
    'mixup': (mixup, 'ReverseV2'),
    'attention': (attention, 'MatMul'),
    'two_levels': (two_levels, 'MatMul'),
}


def in_batch_regularised(x, y):
  """An in-batch softmax plus a penalty on the whole B x B matrix: a head not made of rows."""
  q, d = encoders(x)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  labels = tf.range(tf.shape(q)[0])
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  return tf.reduce_mean(xent) + 0.01 * tf.reduce_mean(tf.square(logits)), [q, d]


def clip_weighted(x, y):
  """CLIP's two terms weighted by a trained scalar that only the mean over the rows reads."""
  q, d = encoders(x)
  scale = tf.compat.v1.get_variable('log_scale', [], initializer=tf.compat.v1.zeros_initializer())
  logits = tf.exp(scale) * tf.matmul(q, d, transpose_b=True)
  labels = tf.range(tf.shape(q)[0])
  w = tf.sigmoid(tf.compat.v1.get_variable(
      'term_weight', [], initializer=tf.compat.v1.constant_initializer(0.5)))
  rows = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  columns = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.transpose(logits))
  return w * tf.reduce_mean(rows) + (1 - w) * tf.reduce_mean(columns) + 0.1 * w * w, [q, d]


def in_batch_log_loss(x, y):
  """The log of an in-batch softmax's mean: a tail not linear in the per-row values."""
  loss, frontier = in_batch_softmax(x, y)
  return tf.math.log(loss), frontier


def mixup_features(features, y):
  """Mixup of a dict of features (two inputs mixed alike) and of the labels."""
  a, b = features['a'], features['b']
  mixed = tf.concat([0.7 * a + 0.3 * tf.reverse(a, [0]), 0.7 * b + 0.3 * tf.reverse(b, [0])], 1)
  onehot = tf.one_hot(y, 3)
  labels = 0.7 * onehot + 0.3 * tf.reverse(onehot, [0])
  logits = dense(tf.nn.relu(dense(mixed, 5, 'hidden')), 3, 'logits')
  return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels, logits)), [a, b]


def batch_centred(x, y):
  """Inputs centred on the batch's mean, read by the first layer itself (the cut tensor)."""
  logits = dense(x - tf.reduce_mean(x, 0), 3, 'logits')
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)), [x]
