"""Row dependence (`row_dependence.classify`) on the graphs of one tower.

Every pattern of issue 33, written for one device, is read on a graph whose
inputs are a shard's placeholders: the op that first mixes the batch's rows
is named, and the frontier is the per-example tensors it reads. The
per-example controls (and the models of the other tests) have no mixing op.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import cross_example_models as models
import testlib
from estimator_towers.rows import row_dependence as rd

ModeKeys = tf.estimator.ModeKeys
F = models.F
PATTERNS = models.PATTERNS
_dense = models.dense
_xent = models.logits_and_xent
simclr = models.simclr
per_example = models.per_example
attention = models.attention


def _classify(model, static=False, labels=True):
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [4 if static else None, F], name='x')
    y = tf.compat.v1.placeholder(tf.int32, [4 if static else None], name='y') if labels else None
    loss, frontier = model(x, y if labels else tf.zeros_like(x[:, 0], tf.int32))
    return rd.classify([loss], [x] + ([y] if labels else [])), loss, frontier


@pytest.mark.parametrize('static', [False, True])
@pytest.mark.parametrize('name', sorted(PATTERNS))
def test_each_pattern_is_mixing_at_its_op(name, static):
  model, op_type = PATTERNS[name]
  found, loss, frontier = _classify(model, static)
  assert found.mixing, name
  assert found.mixing[0].op.type in (op_type, 'PartitionedCall'), found.mixing[0].describe()
  assert found.kind(loss).tag == rd.MIXED
  assert {t.name for t in frontier} <= {t.name for t in found.frontier}, (
      [t.name for t in frontier], [t.name for t in found.frontier])


def test_simclr_encoder_on_stacked_views_stays_per_example():
  found, _, _ = _classify(simclr)
  graph = tf.compat.v1.get_default_graph()
  kinds = {name: k for name, k in found.kinds.items()}
  encoder = [k for name, k in kinds.items() if name.startswith('encoder/') and 'Relu' not in name]
  assert encoder and all(k == rd.Kind(rd.ROWS, 2) for k in encoder), encoder
  assert all(m.op.type == 'MatMul' for m in found.mixing), [m.describe() for m in found.mixing]
  assert len(found.mixing) == 4   # the four similarity matrices, nothing before them
  assert sorted(t.name for t in found.frontier) == ['split_1:0', 'split_1:1']
  del graph


def test_batch_size_values():
  found, _, _ = _classify(simclr)
  by_name = found.kinds
  assert by_name['Shape:0'].tag == rd.SHAPE
  assert by_name['strided_slice:0'].tag == rd.SIZE
  assert by_name['range:0'].tag == rd.SIZE
  assert by_name['one_hot:0'].tag == rd.SIZE


def test_per_example_control_has_no_mixing_and_a_statistic_loss():
  found, loss, _ = _classify(per_example)
  assert not found.mixing and not found.frontier
  assert found.kind(loss).tag == rd.STAT


def test_features_only_input():
  found, loss, _ = _classify(attention, labels=False)
  assert found.mixing and found.mixing[0].op.type == 'MatMul'
  found, loss, _ = _classify(per_example, labels=False)
  assert not found.mixing


def test_a_statistic_of_the_batch_in_the_rows_is_mixing():
  def normalised(x, y):
    _, xent = _xent(x, y)
    return tf.reduce_sum(xent / tf.reduce_sum(xent)), []
  found, _, _ = _classify(normalised)
  assert [m.op.type for m in found.mixing] == ['RealDiv']
  assert 'statistic of the batch' in found.mixing[0].why


def test_a_gram_matrix_over_the_batch_is_a_statistic():
  """Barlow Twins' x^T y sums over the examples: a statistic, not a mixing op."""
  def gram(x, y):
    h = _dense(x, 4, 'h')
    return tf.reduce_sum(tf.square(tf.matmul(h, h, transpose_a=True))), []
  found, loss, _ = _classify(gram)
  assert not found.mixing
  assert found.kind(loss).tag == rd.STAT


def test_unknown_ops_fed_by_the_batch_are_mixing():
  def py(x, y):
    doubled = tf.compat.v1.py_func(lambda v: v * 2, [x], tf.float32)
    return tf.reduce_mean(doubled), []
  found, _, _ = _classify(py)
  assert found.mixing[0].op.type == 'PyFunc'
  assert 'Python function' in found.mixing[0].why


# --- The models of the other tests: every op per-example --------------------

def _model_graph_mixing(model_fn, mode, features, labels, params=None):
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    feature_tensors = tf.nest.map_structure(
        lambda a: tf.compat.v1.placeholder(tf.as_dtype(a.dtype), [None] + list(a.shape[1:])),
        features)
    label_tensors = None if labels is None else tf.compat.v1.placeholder(
        tf.as_dtype(labels.dtype), [None] + list(labels.shape[1:]))
    spec = model_fn(feature_tensors, label_tensors, mode, params)
    inputs = tf.nest.flatten((feature_tensors, label_tensors))
    found = rd.classify([spec.loss], inputs)
    return [m.describe() for m in found.mixing]


@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL])
@pytest.mark.parametrize('name', sorted(testlib.MODELS))
def test_reference_models_have_no_mixing_op(name, mode):
  x, y = testlib.data(7)
  assert _model_graph_mixing(testlib.MODELS[name], mode, x, y) == []


def test_loss_algebra_models_have_no_mixing_op():
  import test_loss_algebra as tla  # pylint: disable=g-import-not-at-top
  features, targets = tla._data()  # pylint: disable=protected-access
  losses = dict(tla.LOSSES, undeclared=(tla._undeclared, tla._adam))  # pylint: disable=protected-access
  for name in sorted(losses):   # the undeclared count is a dot product over the batch: a sum
    model_fn = lambda f, l, m, p, name=name: tla._model_fn(losses[name][0], f, l, m)  # pylint: disable=protected-access
    found = _model_graph_mixing(model_fn, ModeKeys.TRAIN, features, targets)
    if name == 'max_over_the_batch':   # the worst example's loss: its head on the whole batch
      assert found == ["Max op 'Max' (a max over the batch, which no sum of the shards' "
                       "statistics gives)"], found
    else:   # a max of a stack of statistics ('max_of_ratios') is arithmetic on statistics
      assert found == [], name


def test_a_cond_reads_its_branches():
  """A tf.cond chosen by a hyper-parameter is per-example where its branches are; one
  chosen by a statistic of the batch mixes."""
  def fixed(x, y):
    h = _dense(x, 3, 'h')
    h = tf.cond(tf.constant(True), lambda: h * 2.0, lambda: tf.nn.relu(h))
    return tf.reduce_mean(h), []

  def by_batch(x, y):
    h = _dense(x, 3, 'h')
    h = tf.cond(tf.reduce_sum(x) > 0, lambda: h * 2.0, lambda: tf.nn.relu(h))
    return tf.reduce_mean(h), []

  def mixing_branch(x, y):
    h = _dense(x, 3, 'h')
    h = tf.cond(tf.constant(True), lambda: tf.reverse(h, [0]), lambda: h)
    return tf.reduce_mean(h), []

  found, _, _ = _classify(fixed)
  assert not found.mixing, [m.describe() for m in found.mixing]
  found, _, _ = _classify(by_batch)
  assert [m.why for m in found.mixing] == [
      'a tf.cond whose branch is chosen by a value of the batch']
  found, _, _ = _classify(mixing_branch)
  assert found.mixing[0].why.startswith(
      "a tf.cond whose branch has ReverseV2 op 'ReverseV2' (a reverse across the batch axis)")


def test_layer_norm_batch_norm_and_auc_are_per_example():
  """Keras layer norm (a fused batch norm over [1, n, d, 1]), Keras batch norm (its moments)
  and tf.compat.v1.metrics.auc (the batch on axis 1 of its threshold table): no mixing."""
  def model(x, y):
    h = tf.keras.layers.LayerNormalization()(_dense(x, 4, 'h'))
    h = tf.keras.layers.BatchNormalization()(h, training=True)
    logits = _dense(h, 3, 'logits')
    auc = tf.compat.v1.metrics.auc(tf.equal(y, 0), tf.nn.softmax(logits)[:, 0])
    updates = [op.inputs[1] for op in tf.compat.v1.get_default_graph().get_operations()
               if op.type.startswith('Assign')]
    return tf.add_n([tf.reduce_mean(logits), auc[1]] + [tf.reduce_sum(u) for u in updates]), []
  found, _, _ = _classify(model)
  assert not found.mixing, [m.describe() for m in found.mixing]


def test_sparse_inputs_and_embedding_lookups():
  """A SparseTensor feature (indices, values, dense_shape) looked up with
  embedding_lookup_sparse (tf.unique's distinct ids, summed back per example) is
  per-example; a value of the distinct ids themselves in the loss is not."""
  def build(distinct_in_loss):
    graph = tf.Graph()
    with graph.as_default():
      ids = tf.compat.v1.sparse_placeholder(tf.int64, [None, 4], name='ids')
      y = tf.compat.v1.placeholder(tf.int32, [None], name='y')
      table = tf.compat.v1.get_variable('table', [10, 3])
      embedded = tf.nn.embedding_lookup_sparse(table, ids, None, combiner='mean')
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, embedded))
      if distinct_in_loss:
        loss += tf.reduce_sum(tf.nn.embedding_lookup(table, tf.unique(ids.values)[0]))
      inputs = tf.nest.flatten((ids, y), expand_composites=True)
      return rd.classify([loss], inputs)
  assert not build(False).mixing, [m.describe() for m in build(False).mixing]
  assert build(True).mixing


def test_ragged_and_string_inputs():
  """A RaggedTensor's per-example sum (segment ids from its row splits) and a string length
  are per-example."""
  graph = tf.Graph()
  with graph.as_default():
    values = tf.compat.v1.placeholder(tf.float32, [None], name='RaggedValues')
    splits = tf.compat.v1.placeholder(tf.int64, [None], name='RaggedSplits')
    words = tf.compat.v1.placeholder(tf.string, [None], name='words')
    ragged = tf.RaggedTensor.from_row_splits(values, splits, validate=False)
    loss = tf.reduce_sum(tf.reduce_sum(ragged, axis=1) * tf.cast(tf.strings.length(words),
                                                                  tf.float32))
    found = rd.classify([loss], [values, splits, words])
  assert not found.mixing, [m.describe() for m in found.mixing]


# --- Flat layouts: reshapes of [n, T, d], offsets, gathers of each example's rows ----

T, P, H = 6, 2, 4


def _layouts(model, static=False, dynamic_seq=False):
  """`model(x [n, T, H], positions [n, P])` -> (loss, {name: tensor}) read on one shard."""
  graph = tf.Graph()
  with graph.as_default():
    n = 4 if static else None
    x = tf.compat.v1.placeholder(tf.float32, [n, None if dynamic_seq else T, H], name='x')
    positions = tf.compat.v1.placeholder(tf.int32, [n, P], name='positions')
    loss, named = model(x, positions)
    found = rd.classify([loss], [x, positions])
    return found, {name: found.kind(t) for name, t in named.items()}


def _sizes(x):
  """BERT's get_shape_list: static sizes as ints, the others from tf.shape."""
  shape, dynamic = x.shape.as_list(), tf.shape(x)
  return [dynamic[i] if d is None else d for i, d in enumerate(shape)]


def _gather_indexes(x, positions, stride=None):
  """bert/run_pretraining.py's gather_indexes (offsets of `stride`, T by default)."""
  batch, seq, width = _sizes(x)
  offsets = tf.reshape(tf.range(0, batch, dtype=tf.int32) * (stride or seq), [-1, 1])
  flat_positions = tf.reshape(positions + offsets, [-1])
  flat = tf.reshape(x, [batch * seq, width])
  return tf.gather(flat, flat_positions), flat


def _masked_lm(stride=None):
  def model(x, positions):
    picked, flat = _gather_indexes(_dense(x, H, 'h'), positions, stride)
    rows = tf.reshape(picked, [_sizes(x)[0], P, H])
    return tf.reduce_sum(tf.square(_dense(picked, 3, 'out'))) + tf.reduce_sum(rows), dict(
        picked=picked, rows=rows, flat=flat)
  return model


@pytest.mark.parametrize('layout', ['dynamic', 'static', 'dynamic_seq'])
def test_gather_indexes_picks_each_examples_own_rows(layout):
  """BERT's gather_indexes: positions plus range(n) * T index each example's own rows of
  the flat [n * T, d] tensor, so the picked rows are flat (P per example), rows again
  reshaped to [n, P, d]; with a static batch the offsets are a constant of the shard."""
  found, kinds = _layouts(_masked_lm(), static=layout == 'static',
                          dynamic_seq=layout == 'dynamic_seq')
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds['flat'].tag == rd.FLAT and kinds['picked'] == rd.Kind(rd.FLAT, per=P)
  assert kinds['rows'] == rd.Kind(rd.ROWS)
  if layout != 'dynamic_seq':
    assert kinds['flat'] == rd.Kind(rd.FLAT, per=T)


def test_offsets_of_another_stride_mix():
  """Offsets range(n) * 3 into a flat tensor of 6 rows per example pick other examples' rows."""
  found, _ = _layouts(_masked_lm(stride=3))
  assert [m.op.type for m in found.mixing] == ['GatherV2'], [m.describe() for m in found.mixing]
  assert 'another number of rows per example' in found.mixing[0].why


def test_offsets_not_on_the_batch_axis_mix():
  """positions [n, P] + range(n) * T (not reshaped to [n, 1]) broadcasts the offsets along
  the positions' last axis: example j's offset added to example i's position j."""
  def model(x, positions):
    batch = tf.shape(x)[0]
    flat = tf.reshape(_dense(x, H, 'h'), [batch * T, H])
    picked = tf.gather(flat, tf.reshape(positions + tf.range(batch) * T, [-1]))
    return tf.reduce_sum(picked), {}
  found, _ = _layouts(model)
  assert [m.op.type for m in found.mixing] == ['AddV2'], [m.describe() for m in found.mixing]


def test_offsets_read_elsewhere_are_batch_size_values():
  """range(n) * 2 as labels of an in-batch softmax (not a gather's offsets) is what it was: a
  batch-size value, its one-hot too."""
  def model(x, positions):
    labels = tf.one_hot(tf.range(tf.shape(x)[0]) * 2, 8)
    return tf.reduce_sum(x) + tf.reduce_sum(labels), dict(labels=labels)
  found, kinds = _layouts(model)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds['labels'] == rd.Kind(rd.SIZE)


@pytest.mark.parametrize('static', [False, True])
def test_gather_by_positions_without_offsets_mixes(static):
  """tf.gather(reshape(x, [-1, d]), reshape(positions, [-1])): positions index the whole
  flat batch (example 0's rows for every example), not each example's own."""
  def model(x, positions):
    picked = tf.gather(tf.reshape(_dense(x, H, 'h'), [-1, H]), tf.reshape(positions, [-1]))
    return tf.reduce_sum(picked), {}
  found, _ = _layouts(model, static=static)
  assert [m.op.type for m in found.mixing] == ['GatherV2'], [m.describe() for m in found.mixing]
  assert 'not each example\'s own' in found.mixing[0].why


def test_boolean_mask_gathers_its_own_rows():
  """tf.boolean_mask of rows (its mask a vector or [n, T]) gathers rows by tf.where of a
  mask of the same layout: flat, per-example."""
  def model(x, positions):
    h = _dense(x, H, 'h')
    by_token = tf.boolean_mask(h, tf.reduce_sum(h, -1) > 0)
    by_example = tf.boolean_mask(h[:, 0], positions[:, 0] > 0)
    return tf.reduce_sum(by_token) + tf.reduce_sum(by_example), dict(
        by_token=by_token, by_example=by_example)
  found, kinds = _layouts(model)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds['by_token'].tag == rd.FLAT and kinds['by_example'].tag == rd.FLAT


@pytest.mark.parametrize('static', [False, True])
def test_batch_size_times_seq_reshape_is_flat(static):
  """tf.reshape(x, [tf.shape(x)[0] * T, d]) merges the batch axis with T: flat rows of T per
  example, not rows; reshaped to [tf.shape(x)[0], T, d] they are rows again."""
  def model(x, positions):
    batch = tf.shape(x)[0]
    flat = tf.reshape(_dense(x, H, 'h'), [batch * T, H])
    rows = tf.reshape(flat, [batch, T, H])
    half = tf.reshape(flat, [batch * 2 * T, H // 2])
    return tf.reduce_sum(rows) + tf.reduce_sum(half), dict(flat=flat, rows=rows, half=half)
  found, kinds = _layouts(model, static=static)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds == dict(flat=rd.Kind(rd.FLAT, per=T), rows=rd.Kind(rd.ROWS),
                       half=rd.Kind(rd.FLAT, per=2 * T))


def test_ragged_flat_rows_reshaped_to_the_batch_size_mix():
  """tf.boolean_mask's rows (not the same number per example) reshaped to [n, -1, d]: rows
  of other examples would land in an example's row."""
  def model(x, positions):
    h = _dense(x, H, 'h')
    masked = tf.boolean_mask(h, tf.reduce_sum(h, -1) > 0)
    return tf.reduce_sum(tf.reshape(masked, [tf.shape(x)[0], -1, H]) * 2.0), {}
  found, _ = _layouts(model)
  assert [m.op.type for m in found.mixing] == ['Reshape'], [m.describe() for m in found.mixing]


def test_noise_shaped_by_flat_rows_is_flat():
  """tf.random.normal(tf.shape(flat)) are flat rows of the flat tensor's layout, not rows."""
  def model(x, positions):
    flat = tf.reshape(_dense(x, H, 'h'), [-1, H])
    noise = tf.random.normal(tf.shape(flat), seed=1)
    zeros = tf.zeros_like(flat) + tf.fill(tf.shape(flat), 1.0)
    return tf.reduce_sum((flat + noise) * zeros), dict(noise=noise)
  found, kinds = _layouts(model)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds['noise'] == rd.Kind(rd.FLAT, per=T)


def test_static_batch_constants_as_long_as_the_batch():
  """With a static batch, BERT's tf.ones([n, T, 1]) (every row the same) times the mask's
  rows is per-example; a constant whose rows differ (row i meets example i) mixes."""
  def ones(x, positions):
    mask = tf.cast(tf.reshape(positions[:, :1], [4, 1, 1]), tf.float32)
    return tf.reduce_sum(tf.ones([4, T, 1]) * mask * x), {}

  def ramp(x, positions):
    return tf.reduce_sum(tf.reshape(tf.range(4.0), [4, 1, 1]) * x), {}
  found, _ = _layouts(ones, static=True)
  assert not found.mixing, [m.describe() for m in found.mixing]
  found, _ = _layouts(ramp, static=True)
  assert [m.op.type for m in found.mixing] == ['Mul'], [m.describe() for m in found.mixing]


def test_gathers_within_each_example():
  """tf.gather(x, positions, axis=1, batch_dims=1) picks among each example's own values;
  tf.gather_nd by tf.where of a mask of the rows gives flat rows; by other coordinates
  (positions read as [example, token]) it mixes."""
  def model(x, positions):
    h = _dense(x, H, 'h')
    by_positions = tf.gather(h, positions, axis=1, batch_dims=1)
    masked = tf.gather_nd(h, tf.where(tf.reduce_sum(h, -1) > 0))
    return tf.reduce_sum(by_positions) + tf.reduce_sum(masked), dict(
        by_positions=by_positions, masked=masked)
  found, kinds = _layouts(model)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds['by_positions'] == rd.Kind(rd.ROWS)
  assert kinds['masked'].tag == rd.FLAT and kinds['masked'].per.startswith('where:')

  def coordinates(x, positions):
    picked = tf.gather_nd(_dense(x, H, 'h'), tf.stack([positions[:, 0], positions[:, 1]], 1))
    return tf.reduce_sum(picked), {}
  found, _ = _layouts(coordinates)
  assert [m.op.type for m in found.mixing] == ['GatherNd'], [m.describe() for m in found.mixing]


def test_flat_rows_in_blocks_keep_their_rows_per_example():
  """Two stacked views [2n, T, d] reshaped to [2n * T, d]: flat rows in 2 blocks of T per
  example; back to [tf.shape(views)[0], T, d]: rows in 2 blocks; to [tf.shape(x)[0], ...]
  (n, not 2n) the blocks would mix."""
  def model(x, positions):
    views = tf.concat(tf.split(_dense(x, H, 'h'), 2, -1), 0)
    flat = tf.reshape(views, [-1, H // 2])
    back = tf.reshape(flat, [tf.shape(views)[0], T, H // 2])
    return tf.reduce_sum(back), dict(flat=flat, back=back)
  found, kinds = _layouts(model)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds == dict(flat=rd.Kind(rd.FLAT, 2, per=T), back=rd.Kind(rd.ROWS, 2))

  def halved(x, positions):
    views = tf.concat(tf.split(_dense(x, H, 'h'), 2, -1), 0)
    return tf.reduce_sum(tf.reshape(views, [tf.shape(x)[0], -1])), {}
  found, _ = _layouts(halved)
  assert [m.op.type for m in found.mixing] == ['Reshape'], [m.describe() for m in found.mixing]


def test_where_positions_read_once():
  """tf.where's positions of a [n, T] mask are [k, 2]: tf.gather_nd of the same rows by them
  is flat (the mask's count per example); tf.gather by them (the token column taken as a row)
  mixes; a boolean_mask of a vector of rows gathers its own rows."""
  def model(x, positions):
    h = _dense(x, H, 'h')
    where = tf.where(tf.reduce_sum(h, -1) > 0)
    by_nd = tf.gather_nd(h, where)
    return tf.reduce_sum(by_nd), dict(where=where, by_nd=by_nd)
  found, kinds = _layouts(model)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert kinds['where'].tag == rd.POSITIONS and kinds['where'].index == 'rows'
  assert kinds['by_nd'] == rd.Kind(rd.FLAT, per=kinds['where'].per)

  def by_rows(x, positions):
    h = _dense(x, H, 'h')
    return tf.reduce_sum(tf.gather(h, tf.where(tf.reduce_sum(h, -1) > 0))), {}
  found, _ = _layouts(by_rows)
  assert [m.op.type for m in found.mixing] == ['GatherV2'], [m.describe() for m in found.mixing]


# --- A SparseTensor's entries (`sparse`): the ops feature columns build ------------------

def _sparse_read(build, dense_ids=False):
  """`build(ids: SparseTensor [n, 3], x [n, 2]) -> (loss, {name: tensor})`, read on a shard;
  `dense_ids`: the ids a dense [n, 3] tensor made sparse as feature columns do (tf.where)."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name='x')
    if dense_ids:
      dense = tf.compat.v1.placeholder(tf.int64, [None, 3], name='dense_ids')
      where = tf.where(tf.not_equal(dense, -1))
      ids = tf.SparseTensor(where, tf.gather_nd(dense, where),
                            tf.shape(dense, out_type=tf.int64))
      inputs = [dense, x]
    else:
      ids = tf.compat.v1.sparse_placeholder(tf.int64, [None, 3], name='ids')
      inputs = tf.nest.flatten(ids, expand_composites=True) + [x]
    loss, tensors = build(ids, x)
    return rd.classify([loss], inputs), tensors


def _table(rows=10, width=2):
  return tf.compat.v1.get_variable(f'table_{rows}', [rows, width])


@pytest.mark.parametrize('dense_ids', [False, True], ids=['sparse', 'dense_ids'])
def test_a_safe_embedding_lookup_is_per_example(dense_ids):
  """safe_embedding_lookup_sparse: a sparse reshape to [n, -1] (of tf.where's positions for
  dense ids), invalid ids pruned (sparse_retain), empty rows filled, a sparse segment mean by
  the entries' rows: rows."""
  def build(ids, x):
    e = tf.compat.v1.nn.safe_embedding_lookup_sparse(_table(), ids, combiner='mean')
    return tf.reduce_mean(e * x), {'e': e}
  found, t = _sparse_read(build, dense_ids)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['e']) == rd.Kind(rd.ROWS)


def test_a_sparse_reshape_of_rows_per_example_gives_flat_rows():
  """[n, 3] entries reshaped to [n * 3, 1] (a sequence column's): each example's 3 rows."""
  def build(ids, x):
    shape = ids.dense_shape
    tall = tf.sparse.reshape(ids, tf.stack([tf.reduce_prod(shape[:2]), 1]))
    e = tf.compat.v1.nn.safe_embedding_lookup_sparse(_table(), tall)
    back = tf.reshape(e, tf.concat([tf.cast(shape[:2], tf.int32), [2]], 0))
    return tf.reduce_mean(back), {'e': e, 'back': back}
  found, t = _sparse_read(build)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['e']).tag == rd.FLAT and found.kind(t['back']) == rd.Kind(rd.ROWS)


def test_a_segment_reduction_by_the_entries_rows():
  """By indices[:, 0]: rows where empty rows were filled; without, rows only up to the last
  example with an entry: padded to the batch (sequence_length) rows, a mean of it alone mixes."""
  def padded(ids, x):
    rows = ids.indices[:, 0]
    longest = tf.math.segment_max(ids.indices[:, 1] + 1, rows)
    pad = tf.zeros(tf.shape(ids, out_type=tf.int64)[:1] - tf.shape(longest, out_type=tf.int64)[:1],
                   tf.int64)
    length = tf.concat([longest, pad], 0)
    return tf.reduce_mean(tf.cast(length, tf.float32) * x[:, 0]), {'length': length}
  found, t = _sparse_read(padded)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['length']) == rd.Kind(rd.ROWS)

  def alone(ids, x):
    return tf.reduce_mean(tf.cast(tf.math.segment_sum(ids.values, ids.indices[:, 0]),
                                  tf.float32)), {}
  found, _ = _sparse_read(alone)
  assert [m.op.type for m in found.mixing] == ['Mean'], [m.describe() for m in found.mixing]

  def filled(ids, x):
    full, _ = tf.sparse.fill_empty_rows(ids, 0)
    total = tf.math.segment_sum(full.values, full.indices[:, 0])
    return tf.reduce_mean(tf.cast(total, tf.float32)), {'total': total}
  found, t = _sparse_read(filled)
  assert not found.mixing and found.kind(t['total']) == rd.Kind(rd.ROWS)


def test_the_example_column_is_a_position_in_the_shard():
  """indices[:, 0] gathers each entry's example's row; as a table's ids or in arithmetic it
  is the shard's layout, not a value of the example: mixing."""
  def own_rows(ids, x):
    picked = tf.gather(x, ids.indices[:, 0])
    return tf.reduce_sum(picked), {'picked': picked}
  found, t = _sparse_read(own_rows)
  assert not found.mixing and found.kind(t['picked']).tag == rd.FLAT

  def as_ids(ids, x):
    return tf.reduce_sum(tf.gather(_table(), ids.indices[:, 0])), {}
  found, _ = _sparse_read(as_ids)
  assert found.mixing, 'a table looked up by the shard\'s row positions'


def test_crosses_weights_and_sparse_reductions():
  """A cross of each example's entries with its own: entries; weights of another SparseTensor
  combined entry by entry: aligned; a sparse max over other axes: rows, over the batch: mixing."""
  def build(ids, x):
    crossed = tf.sparse.cross_hashed([ids, ids], 7)
    weights = tf.SparseTensor(ids.indices, tf.cast(ids.values, tf.float32) + 1.0,
                              ids.dense_shape)
    e = tf.nn.embedding_lookup_sparse(_table(), crossed, None, combiner='sum')
    w = tf.nn.embedding_lookup_sparse(_table(7, 2), ids, weights, combiner='mean')
    top = tf.sparse.reduce_max(weights, 1)
    return tf.reduce_mean(e) + tf.reduce_mean(w) + tf.reduce_mean(top), {'top': top}
  found, t = _sparse_read(build)
  kinds = [m.describe() for m in found.mixing]
  # without filled rows, a lookup's sums reach only to the last example with an entry: met by
  # nothing but their mean, they mix (and nothing else does)
  assert all('SegmentS' in k or 'Mean' in k for k in kinds), kinds
  assert found.kind(t['top']) == rd.Kind(rd.ROWS)

  def max_over_batch(ids, x):
    return tf.sparse.reduce_max(tf.SparseTensor(ids.indices, tf.cast(ids.values, tf.float32),
                                                ids.dense_shape)), {}
  found, _ = _sparse_read(max_over_batch)
  assert [m.op.type for m in found.mixing] == ['SparseReduceMax']
