"""Transformers on towers: attention read by its einsums runs on every tower.

An `Einsum` is read by its equation (`rows/einsum.py`): Keras'
`MultiHeadAttention` (`EinsumDense`'s `abc,cde->abde`, the attention's
`aecd,abcd->acbe` and `acbe,aecd->abcd`) and BERT-style attention written
with `tf.einsum` (`BFNH,NHD->BFD`, `BTNH,BFNH->BNFT`, `BNFT,BTNH->BFNH`) are
per-example, so a towered encoder is data-parallel: every device runs the
whole model on its own rows (about the plain graph's heavy ops each), with
no warning, and trains as the plain model_fn on the whole batch. An in-batch
similarity written as an einsum (`ab,cb->ac`, CLIP's `bd,nd->bn` and its
transpose) mixes the batch, and its head is split per tower as a matrix
product's (`heads/row_wise_head`): each tower its own rows.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import heavy_ops
import testlib
import estimator_towers as et
from estimator_towers.rows import row_dependence as rd

BATCH, SEQ, WIDTH, CLASSES = 12, 5, 8, 3
LAYOUTS = {'3 towers': (3, 1), '1x2 micro-batches': (1, 2), '2x2': (2, 2)}


# --- The reader: an einsum by its equation, batched linear algebra ------------

def _operand(x, square, unknown, spec):
  """A tensor of `spec`: (what, shape); what: rows, square (rows [n, n]), unknown (rows of
  unknown rank), weights, flat, cols, stacked, size, distinct, stat or norm."""
  what, shape = spec
  if what == 'rows':
    return tf.reshape(x, [-1] + shape)
  if what == 'square':
    return square
  if what == 'unknown':
    return unknown
  if what == 'weights':
    return tf.ones(shape)
  if what == 'flat':
    return tf.reshape(x, [-1] + shape)   # [n * 5, 4]: flat rows
  if what == 'cols':
    return tf.transpose(tf.reshape(x, [-1, 20]))
  if what == 'stacked':
    return tf.concat([tf.reshape(x, [-1] + shape)] * 2, 0)
  if what == 'size':   # [20] copies of the batch size
    return tf.cast(tf.fill([20], tf.shape(x)[0]), tf.float32)
  if what == 'distinct':   # the batch's distinct values
    return tf.unique(tf.reshape(x, [-1]))[0]
  if what == 'stat':
    return tf.reduce_mean(tf.reshape(x, [-1, 20]), 0)
  assert what == 'norm'
  return tf.nn.moments(tf.reshape(x, [-1, 20]), [0])[0]


def _read(build, *specs):
  """The kind of `build(*operands)` and the mixing ops' whys, on a graph of one tower."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 5, 4], name='x')
    square = tf.compat.v1.placeholder(tf.float32, [None, None], name='square')
    unknown = tf.compat.v1.placeholder(tf.float32, None, name='unknown')
    out = build(*[_operand(x, square, unknown, s) for s in specs])
    found = rd.classify(tf.nest.flatten(out), [x, square, unknown])
    kinds = [found.kind(t) for t in tf.nest.flatten(out)]
    return kinds if len(kinds) > 1 else kinds[0], [m.why for m in found.mixing]


ROWS3, ROWS4 = ('rows', [5, 4]), ('rows', [5, 2, 2])
HEADS = ('rows', [2, 5, 2])   # [n, heads, queries, keys]
KEYS = ('rows', [2, 2, 5])    # [n, keys, heads, size]

PER_EXAMPLE = {
    'abc,cde->abde': (ROWS3, ('weights', [4, 2, 3])),      # Keras EinsumDense (q, k, v)
    'abcd,cde->abe': (ROWS4, ('weights', [2, 2, 3])),      # Keras EinsumDense (output)
    'BFNH,NHD->BFD': (ROWS4, ('weights', [2, 2, 3])),      # BERT's attention output
    'abc,cd->abd': (ROWS3, ('weights', [4, 3])),
    'aecd,abcd->acbe': (ROWS4, ROWS4),                     # Keras MHA's scores
    'acbe,aecd->abcd': (HEADS, KEYS),                      # Keras MHA's context
    'BTNH,BFNH->BNFT': (ROWS4, ROWS4),                     # BERT's scores
    'BNFT,BTNH->BFNH': (HEADS, KEYS),                      # BERT's context
    '...ij,jk->...ik': (ROWS3, ('weights', [4, 3])),       # a leading ellipsis of known rank
    'bij->bji': (ROWS3,),
}


@pytest.mark.parametrize('equation', sorted(PER_EXAMPLE))
def test_einsum_with_the_batch_letter_first_is_per_example(equation):
  kind, mixing = _read(functools.partial(tf.einsum, equation), *PER_EXAMPLE[equation])
  assert (kind, mixing) == (rd.Kind(rd.ROWS), [])


def test_einsum_keeps_flat_rows_and_stacked_rows():
  assert _read(functools.partial(tf.einsum, 'ab,bc->ac'), ('flat', [4]),
               ('weights', [4, 3])) == (rd.Kind(rd.FLAT, per=5), [])   # [n * 5, 4]
  assert _read(functools.partial(tf.einsum, 'abc,cd->abd'), ('stacked', [5, 4]),
               ('weights', [4, 3])) == (rd.Kind(rd.ROWS, 2), [])


def test_einsum_that_sums_over_the_examples_is_a_statistic():
  assert _read(functools.partial(tf.einsum, 'bi,bj->ij'), ('rows', [20]),
               ('rows', [20])) == (rd.Kind(rd.STAT), [])


def test_einsum_with_the_batch_letter_second_gives_columns():
  assert _read(functools.partial(tf.einsum, 'bij->jbi'), ROWS3) == (rd.Kind(rd.COLS), [])
  assert _read(functools.partial(tf.einsum, 'ib,ij->bj'), ('cols', None),
               ('weights', [20, 3])) == (rd.Kind(rd.ROWS), [])


def test_columns_an_einsum_made_lead_the_frontier_back_to_its_rows():
  """`bd->db` then a similarity matrix: the mixing MatMul's frontier is the rows before it."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4], name='x')
    q, d = tf.tanh(x, name='q'), tf.sigmoid(x, name='d')
    found = rd.classify([tf.reduce_sum(tf.matmul(q, tf.einsum('bd->db', d)))], [x])
  assert [m.op.type for m in found.mixing] == ['MatMul']
  assert sorted(t.name for t in found.frontier) == ['d:0', 'q:0']


MIXING = {
    'an einsum that pairs different examples (equation ab,cb->ac)': (
        'ab,cb->ac', ('rows', [20]), ('rows', [20])),
    'an einsum that moves the batch axis (equation bij->ijb)': ('bij->ijb', ROWS3),
    'an einsum that pairs the batch axis with an axis of other values (equation ab,ab->ab)': (
        'ab,ab->ab', ('rows', [20]), ('weights', [12, 20])),
    'an einsum along a diagonal across the batch\'s examples (equation aa->a)': (
        'aa->a', ('square', None)),
    'an einsum of rows with values of another row layout (equation abc,ac->ab)': (
        'abc,ac->ab', ROWS3, ('flat', [4])),
    'an einsum of rows of different stacked layouts (equation abc,abc->ab)': (
        'abc,abc->ab', ROWS3, ('stacked', [5, 4])),
    'an einsum of the batch\'s rows with a statistic of the batch (equation ab,b->a)': (
        'ab,b->a', ('rows', [20]), ('stat', None)),
    'an einsum of the batch\'s rows with a value of the batch size (equation ab,b->a)': (
        'ab,b->a', ('rows', [20]), ('size', None)),
    'an einsum of values that are not one row per example (distinct values)': (
        'ab,c->abc', ('rows', [20]), ('distinct', None)),
}


@pytest.mark.parametrize('why', sorted(MIXING))
def test_einsum_that_mixes_says_why(why):
  equation, *specs = MIXING[why]
  kind, mixing = _read(functools.partial(tf.einsum, equation), *specs)
  assert (kind, mixing) == (rd.Kind(rd.MIXED), [why])


def test_einsum_of_rows_and_a_batch_norms_statistic_keeps_the_rows():
  assert _read(functools.partial(tf.einsum, 'ab,b->ab'), ('rows', [20]),
               ('norm', None)) == (rd.Kind(rd.ROWS), [])
  assert _read(functools.partial(tf.einsum, 'i,i->'), ('stat', None),
               ('norm', None)) == (rd.Kind(rd.STAT), [])


def test_einsum_with_an_ellipsis_over_an_unknown_rank_mixes():
  def build(unknown):
    return tf.raw_ops.Einsum(inputs=[unknown, tf.ones([4, 3])], equation='...i,ij->...j')
  assert _read(build, ('unknown', None)) == (rd.Kind(rd.MIXED), [
      'an einsum whose equation the library cannot place on the batch axis (equation '
      '...i,ij->...j: an ellipsis over an operand of unknown rank)'])


def test_batched_linear_algebra_is_per_matrix():
  """[n, m, m] rows: one matrix per example; [n, n]: the batch axis is a matrix axis."""
  rows = rd.Kind(rd.ROWS)
  assert _read(tf.linalg.inv, ROWS4) == (rows, [])
  assert _read(tf.linalg.slogdet, ROWS4) == ([rows, rows], [])
  assert _read(tf.linalg.qr, ROWS4) == ([rows, rows], [])
  assert _read(lambda a: tf.linalg.triangular_solve(a, tf.ones([2, 3])),
               ROWS4) == (rows, [])
  assert _read(tf.linalg.solve, ROWS4, ROWS4) == (rows, [])
  assert _read(tf.linalg.cholesky, ('square', None)) == (rd.Kind(rd.MIXED), [
      'a matrix op (Cholesky) whose matrix axes include the batch axis (rank 2, not a '
      '[n, m, m] batch of matrices)'])
  assert _read(tf.linalg.solve, ROWS4, ('stacked', [5, 2, 2])) == (rd.Kind(rd.MIXED), [
      'a batched matrix op (MatrixSolve) of rows of different stacked layouts'])
  assert _read(tf.linalg.inv, ('cols', None)) == (rd.Kind(rd.MIXED), [
      'a batched matrix op (MatrixInverse) of values that are not one row per example '
      '(columns)'])
  assert _read(lambda a: tf.linalg.solve(a, tf.ones([7, 5, 2, 1])), ROWS4) == (
      rd.Kind(rd.MIXED), ['a batched matrix op (MatrixSolve) of the batch\'s rows with other '
                          'values stacked on a batch axis'])


def test_diagonals_and_bands_of_rows_are_per_matrix():
  """tf.linalg.logdet (a Cholesky's diagonal), tf.linalg.diag of [n, m] rows, a band of
  [n, m, m] rows; the diagonal of a [n, n] matrix mixes."""
  rows = rd.Kind(rd.ROWS)
  assert _read(lambda a: tf.linalg.logdet(tf.matmul(a, a, transpose_b=True) + tf.eye(5)),
               ROWS3) == (rows, [])
  assert _read(tf.linalg.diag, ('rows', [20])) == (rows, [])
  assert _read(lambda a: tf.linalg.band_part(a, 1, 0), ROWS4) == (rows, [])
  assert _read(lambda a: tf.linalg.set_diag(a, a[:, :, :, 0]), ROWS4) == (rows, [])
  assert _read(lambda a: tf.linalg.set_diag(a, tf.ones([7, 5, 2])), ROWS4) == (
      rd.Kind(rd.MIXED), ['a MatrixSetDiagV3 of the batch\'s rows with other values or by a '
                          'value of the batch'])
  assert _read(tf.linalg.diag_part, ('square', None)) == (rd.Kind(rd.MIXED), [
      'a MatrixDiagPartV3 whose matrix axes include the batch axis (rank 2)'])


def test_a_batched_matrix_product_of_rows_and_broadcast_weights_is_per_example():
  """tf.matmul([n, 5, 4] rows, [4, 3] weights), as hand-written transformers project (a
  BatchMatMulV2 that broadcasts the weights over the batch); rows of rank 2 times such rows
  still mix."""
  rows = rd.Kind(rd.ROWS)
  assert _read(lambda a: tf.matmul(a, tf.ones([4, 3])), ROWS3) == (rows, [])
  assert _read(lambda a: tf.matmul(tf.ones([3, 5]), a), ROWS3) == (rows, [])
  assert _read(lambda a: tf.matmul(tf.ones([2, 3, 5]), a), ROWS3)[0] == rd.Kind(rd.MIXED)


# --- Towered encoders: data-parallel, and equal to plain ----------------------

def _glorot(seed):
  return tf.keras.initializers.GlorotUniform(seed=seed)


def _optimize(loss):
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return optimizer.minimize(loss, tf.compat.v1.train.get_global_step())


def keras_encoder_model_fn(features, labels, mode, params, config=None):
  """A Keras MultiHeadAttention encoder block: attention, layer norm, a Dense FFN, mean pool."""
  del config
  x = features['x']
  attention = tf.keras.layers.MultiHeadAttention(   # params: dropout (heavy ops only)
      num_heads=2, key_dim=4, kernel_initializer=_glorot(1),
      dropout=(params or {}).get('dropout', 0.0))
  norm = tf.keras.layers.LayerNormalization()
  ffn = tf.keras.layers.Dense(16, activation='relu', kernel_initializer=_glorot(2))
  out = tf.keras.layers.Dense(WIDTH, kernel_initializer=_glorot(3))
  head = tf.keras.layers.Dense(CLASSES, kernel_initializer=_glorot(4))
  h = norm(x + attention(x, x, training=mode == tf.estimator.ModeKeys.TRAIN))
  h = h + out(ffn(h))
  logits = head(tf.reduce_mean(h, axis=1))
  loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_optimize(loss))


def _variable(name, shape, seed):
  return tf.compat.v1.get_variable(
      name, shape, initializer=tf.compat.v1.initializers.glorot_uniform(seed=seed))


def einsum_attention_model_fn(features, labels, mode, params, config=None):
  """BERT-style self-attention written with tf.einsum; a loss from the features alone."""
  del labels, config
  x = features['x']
  heads, size = 2, 4
  q, k, v = (tf.einsum('BFD,DNH->BFNH', x, _variable(n, [WIDTH, heads, size], s))
             for n, s in (('query', 1), ('key', 2), ('value', 3)))
  scores = tf.einsum('BTNH,BFNH->BNFT', k, q) / np.sqrt(size)
  context = tf.einsum('BNFT,BTNH->BFNH', tf.nn.softmax(scores), v)
  h = tf.nn.tanh(tf.einsum('BFNH,NHD->BFD', context, _variable('output', [heads, size, WIDTH], 4)))
  loss = tf.reduce_mean(tf.square(h - x))   # reconstruct the input: no labels
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_optimize(loss))


def _encoders(features):
  x = tf.reduce_mean(features['x'], axis=1)
  q = tf.tanh(tf.einsum('bd,de->be', x, _variable('query', [WIDTH, 4], 1)))
  d = tf.tanh(tf.einsum('bd,de->be', x, _variable('doc', [WIDTH, 4], 2)))
  return q, d


def in_batch_einsum_model_fn(features, labels, mode, params, config=None):
  """An in-batch softmax written with tf.einsum: `ab,cb->ac` pairs the examples (mixing); its
  head is made of rows (each tower its own rows of q against the gathered d), the encoders'
  einsums run on the towers. params['similarity']: 'ab,cb->ac' (default), 'matmul' (q d^T,
  to compare with), 'columns' (q times `be->eb`'s columns of d) or 'ab,bc->ac' (q times
  tf.transpose(d))."""
  del labels, config
  q, d = _encoders(features)
  similarity = (params or {}).get('similarity', 'ab,cb->ac')
  if similarity == 'matmul':
    logits = tf.matmul(q, d, transpose_b=True) / 0.1
  elif similarity == 'columns':   # d's columns made by an einsum, a matrix product of them
    logits = tf.matmul(q, tf.einsum('be->eb', d)) / 0.1
  elif similarity == 'ab,bc->ac':
    logits = tf.einsum(similarity, q, tf.transpose(d)) / 0.1
  else:
    logits = tf.einsum(similarity, q, d) / 0.1
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      tf.range(tf.shape(q)[0]), logits))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_optimize(loss))


def einsum_clip_model_fn(features, labels, mode, params, config=None):
  """CLIP with einsum similarities and a trained temperature: the row term of `bd,nd->bn`
  (q against the gathered d), the column term of its tf.transpose or, with
  params['swapped'], of `bd,nd->nb` (d's rows against the gathered q)."""
  del labels, config
  q, d = _encoders(features)
  scale = tf.exp(tf.compat.v1.get_variable('log_scale', [], initializer=tf.zeros_initializer()))
  logits = scale * tf.einsum('bd,nd->bn', q, d) / 0.1
  transposed = (scale * tf.einsum('bd,nd->nb', q, d) / 0.1 if (params or {}).get('swapped')
                else tf.transpose(logits))
  labels = tf.range(tf.shape(q)[0])
  rows = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  columns = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, transposed)
  loss = (tf.reduce_mean(rows) + tf.reduce_mean(columns)) / 2
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_optimize(loss))


def late_interaction_model_fn(features, labels, mode, params, config=None):
  """ColBERT-style in-batch softmax: each query token's best match among a document's tokens
  (`bqd,ntd->bqnt`, a max over t, a sum over q): tower k's queries against the gathered
  documents' tokens."""
  del labels, config
  q, d = (tf.math.l2_normalize(tf.einsum('btd,de->bte', features['x'], _variable(n, [WIDTH, 4], s)),
                               -1) for n, s in (('query', 1), ('doc', 2)))
  scores = tf.reduce_sum(tf.reduce_max(tf.einsum('bqd,ntd->bqnt', q, d), 3), 1)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      tf.range(tf.shape(q)[0]), scores / 0.1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_optimize(loss))


def token_softmax_model_fn(features, labels, mode, params, config=None):
  """A softmax per query token over the batch's documents (`bqd,nd->bqn`, a log-softmax of
  rank 3), the mean over the tokens of the matching document's log-probability."""
  del labels, config
  x = features['x']
  q = tf.tanh(tf.einsum('btd,de->bte', x, _variable('query', [WIDTH, 4], 1)))
  d = tf.tanh(tf.einsum('bd,de->be', tf.reduce_mean(x, 1), _variable('doc', [WIDTH, 4], 2)))
  log_probs = tf.reduce_mean(tf.nn.log_softmax(tf.einsum('bqd,nd->bqn', q, d) / 0.1), 1)
  batch = tf.shape(q)[0]
  loss = -tf.reduce_mean(tf.reduce_sum(log_probs * tf.one_hot(tf.range(batch), batch), 1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_optimize(loss))


def einsum_clip_swapped_model_fn(features, labels, mode, params, config=None):
  return einsum_clip_model_fn(features, labels, mode, {'swapped': True}, config)


def einsum_columns_model_fn(features, labels, mode, params, config=None):
  """The in-batch softmax against `be->eb`'s columns (the frontier: the rows before it)."""
  return in_batch_einsum_model_fn(features, labels, mode, {'similarity': 'columns'}, config)


def einsum_transposed_model_fn(features, labels, mode, params, config=None):
  """The in-batch softmax `ab,bc->ac` of q and tf.transpose(d): d's letter is its second."""
  return in_batch_einsum_model_fn(features, labels, mode, {'similarity': 'ab,bc->ac'}, config)


def _data(seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(BATCH, SEQ, WIDTH).astype(np.float32),
          rng.randint(0, CLASSES, size=BATCH).astype(np.int32))


MODELS = {'keras_mha': (keras_encoder_model_fn, True),
          'einsum_attention': (einsum_attention_model_fn, False),
          'in_batch_einsum': (in_batch_einsum_model_fn, False),
          'einsum_columns': (einsum_columns_model_fn, False),
          'einsum_transposed': (einsum_transposed_model_fn, False),
          'einsum_clip': (einsum_clip_model_fn, False),
          'einsum_clip_swapped': (einsum_clip_swapped_model_fn, False),
          'late_interaction': (late_interaction_model_fn, False),
          'token_softmax': (token_softmax_model_fn, False)}
PARALLEL = ('keras_mha', 'einsum_attention')
ROW_WISE = ('in_batch_einsum', 'einsum_transposed', 'einsum_clip', 'einsum_clip_swapped',
            'late_interaction', 'token_softmax')


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


@pytest.mark.parametrize('name,params', [(name, {}) for name in PARALLEL] + [
    ('keras_mha', {'dropout': 0.1})], ids=list(PARALLEL) + ['keras_mha_dropout'])
def test_every_tower_runs_the_whole_model(name, params, warnings):
  """3 towers: each device holds about the plain graph's heavy ops (before: 0.33), no warning;
  with the attention's dropout too (random per example: rows of the shard's shape)."""
  model_fn, labelled = MODELS[name]
  x, y = _data()
  labels = y if labelled else None
  plain = heavy_ops.train_graph(model_fn, {'x': x}, labels, params)
  towered = heavy_ops.train_graph(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)), {'x': x}, labels, params)
  share = heavy_ops.least_share(towered, plain, 3)
  assert share >= 0.9, (share, heavy_ops.per_device(towered), heavy_ops.total(plain))
  assert not warnings, warnings


def _input_fn(labelled):
  x, y = _data()
  def fn():
    data = ({'x': x}, y) if labelled else {'x': x}
    return tf.data.Dataset.from_tensor_slices(data).repeat().batch(BATCH)
  return fn


@functools.lru_cache(maxsize=None)
def _plain(name):
  model_fn, labelled = MODELS[name]
  return tuple(testlib.plain_train_and_read(model_fn, _input_fn(labelled)))


EXTRA = ('einsum_transposed', 'late_interaction', 'token_softmax')   # 2x2 only (devices and micro-batches)


@pytest.mark.parametrize('name,layout', [
    (n, l) for n in sorted(MODELS) for l in sorted(LAYOUTS) if n not in EXTRA or l == '2x2'])
def test_towers_train_equal_to_plain(name, layout, warnings):
  """Every variable and Momentum slot within 1e-5 of plain after steps 1 and 3."""
  model_fn, labelled = MODELS[name]
  num_devices, micro_batches = LAYOUTS[layout]
  towered = testlib.stepwise_estimator(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                            micro_batches=micro_batches),
      num_cpus=num_devices)
  after_1, after_3 = testlib.train_and_read(towered, _input_fn(labelled))
  plain_1, plain_3 = _plain(name)
  testlib.assert_variables_close(after_1, plain_1)
  testlib.assert_variables_close(after_3, plain_3)
  assert not warnings, warnings


def _share(model_fn, params=None):
  x, _ = _data()
  plain = heavy_ops.train_graph(model_fn, {'x': x}, None, params)
  towered = heavy_ops.train_graph(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)), {'x': x}, None, params)
  return heavy_ops.least_share(towered, plain, 3), heavy_ops.per_device(towered)


@functools.lru_cache(maxsize=None)
def _matmul_share():
  """The MatMul version's share (each einsum's measure), built once for them all."""
  return _share(in_batch_einsum_model_fn, {'similarity': 'matmul'})


@pytest.mark.parametrize('name', ROW_WISE)
def test_an_einsum_similarity_is_split_per_tower(name, warnings):
  """An in-batch softmax or CLIP whose similarity is an einsum: each of 3 towers computes its
  own rows against the gathered columns, as much heavy work per device as the MatMul
  version's (1.11 of the plain graph's: before, 0.78 and the one-device warning)."""
  matmul, _ = _matmul_share()
  share, per_device = _share(MODELS[name][0])
  assert share >= 0.9 and share >= matmul, (share, matmul, per_device)
  assert not warnings, warnings
