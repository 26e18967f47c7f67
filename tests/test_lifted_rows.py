"""The row reader's readings of padding removal (`row_dependence.classify`), op by op.

The r1 Transformer's pad-removing FFN: `tf.where` of a flat mask gives
positions in the flat rows, `gather_nd` by them keeps each token with its
example, `expand_dims(x, 0)` lifts the entries onto axis 1 ([1, n, H]), a
Dense on rank 3 (tensordot) keeps them, `squeeze(axis=0)` gives flat rows
back, `scatter_nd` to the same positions into [B * T, H] is flat rows of T
per example, and the reshape to [B, T, H] rows. The controls must still
mix: positions that are not the same rows', a scatter into another size, a
reduction over the lifted batch axis (a statistic), a transpose of it.
"""

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.rows import row_dependence as rd

T, H = 6, 4


def _read(build):
  """(classify's result, the tensors `build` named) on a graph of [n, T, H] rows and [n, T] ids."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, T, H], name='x')
    ids = tf.compat.v1.placeholder(tf.int32, [None, T], name='ids')
    named = build(x, ids)
    loss = tf.reduce_sum(named['out'])
    return rd.classify([loss], [x, ids]), named


def _padding(ids):
  return tf.cast(tf.equal(ids, 0), tf.float32)


def _nonpad(x, ids):
  """r1's remove_padding: (nonpad_ids, the flat non-pad rows [n, H])."""
  pad_mask = tf.reshape(_padding(ids), [-1])
  nonpad_ids = tf.cast(tf.where(pad_mask < 1e-9), tf.int32)
  rows = tf.gather_nd(tf.reshape(x, [-1, H]), indices=nonpad_ids)
  rows.set_shape([None, H])
  return nonpad_ids, rows


def _dense(x, units, name):
  return tf.compat.v1.layers.Dense(units, name=name)(x)


def _ffn(x, ids):
  batch_size, length = tf.shape(x)[0], tf.shape(x)[1]
  nonpad_ids, rows = _nonpad(x, ids)
  lifted = tf.expand_dims(rows, axis=0)
  hidden = tf.nn.relu(_dense(lifted, 8, 'filter'))
  out = tf.squeeze(_dense(hidden, H, 'output'), axis=0)
  scattered = tf.scatter_nd(nonpad_ids, out, shape=[batch_size * length, H])
  return {'where': nonpad_ids, 'gathered': rows, 'lifted': lifted, 'hidden': hidden,
          'squeezed': out, 'scattered': scattered,
          'out': tf.reshape(scattered, [batch_size, length, H])}


def test_the_pad_removing_ffn_is_per_example_op_by_op():
  found, t = _read(_ffn)
  assert not found.mixing, [m.describe() for m in found.mixing]
  kind = lambda name: found.kind(t[name])
  assert kind('where').tag == rd.POSITIONS and kind('where').index == T   # in T per example
  assert kind('gathered').tag == rd.FLAT and kind('gathered').per == kind('where').per
  assert kind('lifted') == kind('hidden') == rd.Kind(rd.LIFTED, of=rd.FLAT,
                                                      per=kind('where').per)
  assert kind('squeezed') == rd.Kind(rd.FLAT, per=kind('where').per)
  assert kind('scattered') == rd.Kind(rd.FLAT, per=T)
  assert kind('out') == rd.Kind(rd.ROWS)


def test_rows_lifted_and_squeezed_stay_rows():
  def build(x, ids):
    lifted = tf.expand_dims(tf.reshape(x, [-1, T * H]), 0)   # [1, n, T * H]
    dense = _dense(lifted, 3, 'dense')
    return {'lifted': lifted, 'out': tf.squeeze(dense, axis=[0])}
  found, t = _read(build)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['lifted']) == rd.Kind(rd.LIFTED, of=rd.ROWS)
  assert found.kind(t['out']) == rd.Kind(rd.ROWS)


def test_a_reduction_over_the_lifted_batch_axis_is_a_statistic():
  def build(x, ids):
    lifted = tf.expand_dims(tf.reshape(x, [-1, T * H]), 0)
    over_batch = tf.reduce_mean(lifted, axis=1)   # [1, T * H]: a mean over the examples
    return {'over_batch': over_batch, 'out': tf.reshape(x, [-1, T * H]) * over_batch}
  found, t = _read(build)
  assert found.kind(t['over_batch']).tag == rd.STAT
  assert found.mixing and found.mixing[0].op.type == 'Mul', [m.describe() for m in found.mixing]
  assert [f.name for f in found.frontier] == ['Reshape_1:0']


def test_a_reduction_over_the_lifted_features_keeps_the_entries():
  def build(x, ids):
    lifted = tf.expand_dims(tf.reshape(x, [-1, T * H]), 0)
    return {'out': tf.squeeze(tf.reduce_sum(lifted, axis=-1, keepdims=True), 0)}
  found, t = _read(build)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['out']) == rd.Kind(rd.ROWS)


@pytest.mark.parametrize('how', ['transpose', 'softmax', 'constant', 'slice', 'squeeze_1'])
def test_ops_across_the_lifted_batch_axis_mix(how):
  def build(x, ids):
    _, rows = _nonpad(x, ids)
    lifted = tf.expand_dims(rows, 0)   # [1, n, H]
    if how == 'transpose':
      out = tf.transpose(lifted, [0, 2, 1])
    elif how == 'softmax':   # over [1, n]: across the entries
      out = tf.nn.softmax(tf.expand_dims(tf.identity(rows[:, 0], 'first'), 0))
    elif how == 'constant':   # a constant along axis 1: each entry by its position
      out = lifted + tf.constant(np.ones([1, 5, H], np.float32))
    elif how == 'slice':
      out = lifted[:, 1:]
    else:
      out = tf.squeeze(lifted[:, :1], axis=[1])
    return {'out': out}
  found, _ = _read(build)
  assert found.mixing, how
  frontier = ['first:0' if how == 'softmax' else 'GatherNd:0']
  assert [f.name for f in found.frontier] == frontier, [f.name for f in found.frontier]


def test_gather_nd_at_positions_of_other_rows_mixes():
  def build(x, ids):
    pad_mask = tf.reshape(_padding(ids), [-1])   # T entries per example
    nonpad_ids = tf.cast(tf.where(pad_mask < 1e-9), tf.int32)
    halves = tf.reshape(x, [-1, H * 2])          # T / 2 entries per example
    return {'out': tf.gather_nd(halves, nonpad_ids)}
  found, _ = _read(build)
  assert [m.op.type for m in found.mixing] == ['GatherNd'], [m.describe() for m in found.mixing]


def test_gather_nd_by_the_batchs_values_mixes():
  def build(x, ids):   # the ids used as positions in the flat rows: other examples' tokens
    return {'out': tf.gather_nd(tf.reshape(x, [-1, H]), tf.reshape(ids, [-1, 1]))}
  found, _ = _read(build)
  assert [m.op.type for m in found.mixing] == ['GatherNd'], [m.describe() for m in found.mixing]


def test_gather_nd_by_where_of_rows_is_per_example():
  def build(x, ids):   # tf.where of [n, T]: (example, token) pairs
    positions = tf.where(tf.not_equal(ids, 0))
    return {'positions': positions, 'out': tf.gather_nd(x, positions)}
  found, t = _read(build)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['positions']).index == 'rows'
  assert found.kind(t['out']).tag == rd.FLAT


@pytest.mark.parametrize('how', ['other_indices', 'other_size', 'other_updates'])
def test_scatter_nd_not_back_to_the_same_positions_mixes(how):
  def build(x, ids):
    batch_size = tf.shape(x)[0]
    nonpad_ids, rows = _nonpad(x, ids)
    indices, size, updates = nonpad_ids, batch_size * T, rows
    if how == 'other_indices':   # the ids as positions
      indices = tf.reshape(ids, [-1, 1])[:tf.shape(rows)[0]]
    elif how == 'other_size':    # B * (T - 1) rows: the flattening of another length
      size = batch_size * (T - 1)
    else:                        # updates of another mask's entries
      other = tf.cast(tf.where(tf.reshape(_padding(ids), [-1]) > 0), tf.int32)
      updates = tf.gather_nd(tf.reshape(x, [-1, H]), other)
    return {'out': tf.scatter_nd(indices, updates, shape=[size, H])}
  found, _ = _read(build)
  assert found.mixing, how
  assert 'ScatterNd' in [m.op.type for m in found.mixing] or how == 'other_indices', (
      [m.describe() for m in found.mixing])


@pytest.mark.parametrize('how', ['sum', 'column', 'plus_one'])
def test_positions_used_as_values_mix(how):
  def build(x, ids):   # a position is the shard's layout: on a shard, not the whole batch's
    positions = tf.where(tf.not_equal(ids, 0))
    if how == 'sum':
      out = tf.reduce_sum(positions)
    elif how == 'column':   # each token's example index in the shard
      out = tf.gather_nd(x, tf.expand_dims(positions[:, 0], 1))
    elif how == 'plus_one':
      out = tf.gather_nd(x, positions + 1)
    else:   # positions as ids of a table
      out = tf.gather(tf.ones([100, H]), positions[:, 1])
    return {'out': tf.cast(out, tf.float32)}
  found, _ = _read(build)
  assert found.mixing, how
  # the example column is each entry's row in the shard (`sparse`'s ids): any op on it but a
  # segment reduction or a gather of rows mixes there
  assert found.mixing[0].op.type in ('Sum', 'ExpandDims', 'AddV2'), found.mixing[0].describe()


def test_a_later_column_of_positions_in_rows_is_each_entrys_value():
  """positions[:, 1] of a [n, T] mask: each token's position in its example, the same on a
  shard and on the whole batch (a SparseTensor's indices' other columns): flat, per example."""
  def build(x, ids):
    positions = tf.where(tf.not_equal(ids, 0))
    return {'out': tf.gather(tf.ones([100, H]), positions[:, 1])}
  found, t = _read(build)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['out']).tag == rd.FLAT


def test_a_pad_of_later_axes_by_a_shape_keeps_the_rows():
  def build(x, ids):   # r1's _pad_tensors_to_same_length
    longest = tf.maximum(tf.shape(x)[1], 8)
    return {'out': tf.pad(x, [[0, 0], [0, longest - tf.shape(x)[1]], [0, 0]])}
  found, t = _read(build)
  assert not found.mixing, [m.describe() for m in found.mixing]
  assert found.kind(t['out']) == rd.Kind(rd.ROWS)


def test_a_pad_of_the_batch_axis_by_a_shape_mixes():
  def build(x, ids):
    return {'out': tf.pad(x, [[0, 8 - tf.shape(x)[1]], [0, 0], [0, 0]])}
  found, _ = _read(build)
  assert [m.op.type for m in found.mixing] == ['Pad'], [m.describe() for m in found.mixing]


def test_a_gather_by_the_batchs_values_mixes_and_boolean_mask_does_not():
  def build(x, ids):
    picked = tf.gather(tf.reshape(x, [-1, H]), tf.reshape(ids, [-1]))   # ids as positions
    masked = tf.boolean_mask(x, tf.not_equal(ids, 0))
    return {'masked': masked, 'out': tf.reduce_sum(masked) + tf.reduce_sum(picked)}
  found, t = _read(build)
  assert [m.op.type for m in found.mixing] == ['GatherV2'], [m.describe() for m in found.mixing]
  assert found.kind(t['masked']).tag == rd.FLAT
