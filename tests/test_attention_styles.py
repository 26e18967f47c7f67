"""Two more real attention styles on towers: T5's relative position bias, ALBERT's sharing.

- T5: `relative_position = memory[None, :] - context[:, None]` from
  `tf.range(T)` (T = `tf.shape(x)[1]`), log-bucketed (`tf.math.log`,
  `tf.minimum`, `tf.where`, `tf.cast`), a `[buckets, heads]` embedding
  gathered, transposed to `[1, heads, T, T]` and added to the unscaled
  scores (`bqhd,bkhd->bhqk`); RMS layer norm; a gated-gelu FFN (as
  Mesh TensorFlow's and Hugging Face's TF T5).
- ALBERT: a factorised embedding (a `[V, E]` table gathered by the ids,
  then an `[E, H]` projection), position embeddings sliced to the sequence's
  length, an attention mask from the ids, one transformer layer's variables
  shared by 2 layers (`variable_scope(..., reuse=AUTO_REUSE)`), BERT's einsum
  attention; a masked-language-model loss from the features alone (the
  output embedding tied to the table), Adam.

Every op of both is per-example (the relative positions depend on the
sequence length only: no shard's rows), so on 3 towers each device runs the
whole model on its own rows, with no warning, and trains as the plain
model_fn. So do both on padded batches (the sequence length unknown when
the graph is built: T5's relative positions then come from `tf.shape(x)[1]`
at run time); ALBERT's masked-LM cross-entropy reshapes its
`[n, T, V]` logits to `[-1, V]`: flat rows (`rows/stacked`).
"""

import functools
import math

import numpy as np
import pytest
import tensorflow as tf

import heavy_ops
import testlib
import estimator_towers as et
from estimator_towers.rows import row_dependence as rd

BATCH, SEQ, WIDTH, CLASSES, VOCAB, EMBED = 12, 5, 8, 3, 11, 4
HEADS, SIZE = 2, 4
LAYOUTS = {'3 towers': (3, 1), '1x2 micro-batches': (1, 2), '2x2': (2, 2)}


def _variable(name, shape, seed):
  return tf.compat.v1.get_variable(
      name, shape, initializer=tf.compat.v1.initializers.glorot_uniform(seed=seed))


# --- T5 -------------------------------------------------------------------------

def relative_position_bucket(relative_position, num_buckets=8, max_distance=16):
  """T5's bidirectional bucket of each relative position (Mesh TensorFlow's)."""
  num_buckets //= 2
  bucket = tf.cast(tf.less(relative_position, 0), tf.int32) * num_buckets
  n = tf.abs(relative_position)
  max_exact = num_buckets // 2
  large = max_exact + tf.cast(
      tf.math.log(tf.cast(n, tf.float32) / max_exact + np.finfo(np.float32).eps)
      / math.log(max_distance / max_exact) * (num_buckets - max_exact), tf.int32)
  large = tf.minimum(large, num_buckets - 1)
  return bucket + tf.where(tf.less(n, max_exact), n, large)


def rms_norm(x, name):
  scale = tf.compat.v1.get_variable(name, [x.shape[-1]], initializer=tf.ones_initializer())
  return scale * x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + 1e-6)


def t5_position_bias(x, buckets=8):
  """[1, heads, T, T]: the bucketed relative positions' bias, from x's sequence length."""
  length = tf.shape(x)[1]
  context = tf.range(length)[:, None]
  memory = tf.range(length)[None, :]
  bucket = relative_position_bucket(memory - context, buckets)
  table = _variable('relative_attention_bias', [buckets, HEADS], 5)
  return tf.expand_dims(tf.transpose(tf.gather(table, bucket), [2, 0, 1]), 0)


def t5_model_fn(features, labels, mode, params, config=None):
  """A T5 encoder block (attention with the relative position bias, gated-gelu FFN), a
  classifier of the mean over the sequence; Momentum."""
  del params, config
  x = features['x']
  h = rms_norm(x, 'attention_norm')
  q, k, v = (tf.einsum('btd,dnh->btnh', h, _variable(n, [WIDTH, HEADS, SIZE], s))
             for n, s in (('q', 1), ('k', 2), ('v', 3)))
  scores = tf.einsum('bqhd,bkhd->bhqk', q, k) + t5_position_bias(x)   # T5: no scaling
  context = tf.einsum('bhqk,bkhd->bqhd', tf.nn.softmax(scores), v)
  x = x + tf.einsum('bqhd,hdo->bqo', context, _variable('o', [HEADS, SIZE, WIDTH], 4))
  h = rms_norm(x, 'ffn_norm')
  gate = tf.nn.gelu(tf.einsum('btd,df->btf', h, _variable('wi_0', [WIDTH, 16], 6)),
                    approximate=True)
  hidden = gate * tf.einsum('btd,df->btf', h, _variable('wi_1', [WIDTH, 16], 7))
  x = rms_norm(x + tf.einsum('btf,fd->btd', hidden, _variable('wo', [16, WIDTH], 8)),
               'final_norm')
  logits = tf.matmul(tf.reduce_mean(x, 1), _variable('classifier', [WIDTH, CLASSES], 9))
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


# --- ALBERT ---------------------------------------------------------------------

def layer_norm(x, name):
  with tf.compat.v1.variable_scope(name):
    gamma = tf.compat.v1.get_variable('gamma', [x.shape[-1]], initializer=tf.ones_initializer())
    beta = tf.compat.v1.get_variable('beta', [x.shape[-1]], initializer=tf.zeros_initializer())
  mean, variance = tf.nn.moments(x, [-1], keepdims=True)
  return gamma * (x - mean) * tf.math.rsqrt(variance + 1e-12) + beta


def albert_layer(x, adder):
  """BERT's einsum attention and gelu FFN; its variables are the shared scope's."""
  q, k, v = (tf.einsum('BFD,DNH->BFNH', x, _variable(n, [WIDTH, HEADS, SIZE], s))
             for n, s in (('query', 1), ('key', 2), ('value', 3)))
  scores = tf.einsum('BTNH,BFNH->BNFT', k, q) / np.sqrt(SIZE) + adder
  context = tf.einsum('BNFT,BTNH->BFNH', tf.nn.softmax(scores), v)
  x = layer_norm(x + tf.einsum('BFNH,NHD->BFD', context,
                               _variable('output', [HEADS, SIZE, WIDTH], 4)), 'attention_norm')
  hidden = tf.nn.gelu(tf.einsum('BFD,DI->BFI', x, _variable('intermediate', [WIDTH, 16], 5)))
  return layer_norm(x + tf.einsum('BFI,ID->BFD', hidden, _variable('ffn_output', [16, WIDTH], 6)),
                    'ffn_norm')


def albert_model_fn(features, labels, mode, params, config=None):
  """ALBERT: factorised embedding, 2 layers of one shared layer's variables, a masked-LM
  loss over the non-padding tokens (the output tied to the embedding table); Adam."""
  del labels, params, config
  ids = features['ids']
  length = tf.shape(ids)[1]
  table = _variable('word_embeddings', [VOCAB, EMBED], 10)
  positions = tf.slice(_variable('position_embeddings', [16, EMBED], 11), [0, 0], [length, -1])
  embedded = tf.gather(table, ids) + tf.expand_dims(positions, 0)
  x = tf.einsum('BFE,EH->BFH', layer_norm(embedded, 'embedding_norm'),
                _variable('embedding_projection', [EMBED, WIDTH], 12))
  mask = tf.cast(tf.not_equal(ids, 0), tf.float32)
  adder = (1.0 - mask[:, None, None, :]) * -10000.0   # [B, 1, 1, T]
  for _ in range(2):
    with tf.compat.v1.variable_scope('transformer', reuse=tf.compat.v1.AUTO_REUSE):
      x = albert_layer(x, adder)
  back = tf.einsum('BFH,HE->BFE', x, _variable('mlm_dense', [WIDTH, EMBED], 13))
  logits = tf.einsum('BFE,VE->BFV', layer_norm(back, 'mlm_norm'), table)
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(ids, logits)
  loss = tf.reduce_sum(xent * mask) / tf.reduce_sum(mask)
  optimizer = tf.compat.v1.train.AdamOptimizer(0.01)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _data(seed=0):
  rng = np.random.RandomState(seed)
  ids = rng.randint(1, VOCAB, size=(BATCH, SEQ)).astype(np.int32)
  ids[::3, -2:] = 0   # padding
  return ({'x': rng.randn(BATCH, SEQ, WIDTH).astype(np.float32), 'ids': ids},
          rng.randint(0, CLASSES, size=BATCH).astype(np.int32))


# name: (model_fn, its feature, labelled, padded: the sequence length unknown in the graph)
MODELS = {'t5': (t5_model_fn, 'x', True, False), 'albert': (albert_model_fn, 'ids', False, False),
          'albert_padded': (albert_model_fn, 'ids', False, True),
          't5_padded': (t5_model_fn, 'x', True, True)}


# --- The reader ------------------------------------------------------------------

def _read(build, shape):
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, shape, name='x')
    ids = tf.compat.v1.placeholder(tf.int32, shape[:-1], name='ids')
    out = build(x, ids)
    found = rd.classify([out], [x, ids])
    return found.kind(out), [m.why for m in found.mixing]


def test_a_reshape_that_keeps_the_last_axes_of_an_unknown_length_makes_flat_rows():
  """[n, T, V] to [-1, V], T unknown: the batch axis merged with T (a cross-entropy of
  [n, T, V] logits: rows again); [-1, 4] of them cannot be told."""
  flat, rows = rd.Kind(rd.FLAT), rd.Kind(rd.ROWS)
  assert _read(lambda x, _: tf.reshape(x, [-1, 11]), [None, None, 11]) == (flat, [])
  assert _read(lambda x, _: tf.reshape(x, [-1, 3, 11]), [None, None, 3, 11]) == (flat, [])
  assert _read(lambda x, ids: tf.nn.sparse_softmax_cross_entropy_with_logits(ids, x),
               [None, None, 11]) == (rows, [])
  assert _read(lambda x, _: tf.reshape(x, [-1, 4]), [None, None, 11]) == (
      rd.Kind(rd.MIXED), ['a reshape whose rows cannot be told from the graph'])


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


def _train_graph(model_fn, features, labels, padded):
  """`heavy_ops.train_graph`, with the sequence length unknown too where `padded`."""
  if not padded:
    return heavy_ops.train_graph(model_fn, features, labels)
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    unknown = {k: tf.compat.v1.placeholder_with_default(v, [None, None] + list(v.shape[2:]))
               for k, v in features.items()}
    model_fn(unknown, None if labels is None else tf.constant(labels),
             tf.estimator.ModeKeys.TRAIN, {}, None)
  return graph


@pytest.mark.parametrize('name', sorted(MODELS))
def test_every_tower_runs_the_whole_model(name, warnings):
  """3 towers: the least loaded device holds >= 0.9 of the plain graph's heavy ops."""
  model_fn, feature, labelled, padded = MODELS[name]
  features, y = _data()
  features, labels = {feature: features[feature]}, y if labelled else None
  plain = _train_graph(model_fn, features, labels, padded)
  towered = _train_graph(et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3),
                                               resume_input=not padded),  # padded: on tensors
                         features, labels, padded)
  share = heavy_ops.least_share(towered, plain, 3)
  assert share >= 0.9, (share, heavy_ops.per_device(towered), heavy_ops.total(plain))
  assert not warnings, warnings


def _input_fn(name):
  _, feature, labelled, padded = MODELS[name]
  features, y = _data()
  def fn():
    data = ({feature: features[feature]}, y) if labelled else {feature: features[feature]}
    data = tf.data.Dataset.from_tensor_slices(data).repeat()
    if padded:   # the sequence length unknown in the graph
      shape = [None] + list(features[feature].shape[2:])
      return data.padded_batch(BATCH, padded_shapes=({feature: shape}, []) if labelled
                               else {feature: shape})
    return data.batch(BATCH)
  return fn


@functools.lru_cache(maxsize=None)
def _plain(name):
  return tuple(testlib.plain_train_and_read(MODELS[name][0], _input_fn(name)))


@pytest.mark.parametrize('name,layout', [  # 2x2 has micro-batches
    (n, l) for n in ('albert', 't5') for l in ('3 towers', '2x2')] + [
        ('albert_padded', '3 towers'), ('t5_padded', '3 towers')])
def test_towers_train_equal_to_plain(name, layout, warnings):
  """Every variable and Momentum / Adam slot within 1e-5 of plain after steps 1 and 3."""
  num_devices, micro_batches = LAYOUTS[layout]
  towered = testlib.stepwise_estimator(
      et.replicate_model_fn(MODELS[name][0], devices=testlib.cpu_devices(num_devices),
                            micro_batches=micro_batches),
      num_cpus=num_devices)
  after_1, after_3 = testlib.train_and_read(towered, _input_fn(name))
  plain_1, plain_3 = _plain(name)
  testlib.assert_variables_close(after_1, plain_1)
  testlib.assert_variables_close(after_3, plain_3)
  assert not warnings, warnings
