"""The row reader's readings of loops and time-major values (`row_dependence.classify`).

A While loop keeps each example's rows where its body does (a fixed point over the
loop-carried values), its TensorLists of the kind of their elements; a time-major
transpose keeps rows on axis 1 (columns), a step of it is rows; `tf.map_fn` over the
examples writes each example's values at its own index; `dynamic_rnn` with
`sequence_length` runs up to the batch's longest length and copies each example's state
through past its own. The controls mix: a body that mixes, one example's values combined
with the batch's, rows changed a batch-size number of times, a loop bounded by the longest
length that changes an example's values past its own, a reverse of sequences along the
batch axis. Each positive reading mixed before loops were read (the first transpose or
While op).
"""

import numpy as np
import pytest
import tensorflow as tf

from estimator_towers.rows import row_dependence as rd

T, D, H = 4, 3, 2
ROWS, COLS = rd.Kind(rd.ROWS), rd.Kind(rd.COLS)


def _read(build):
  """(classify's result, the tensors `build` named) on [n, T, D] rows and [n] lengths."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [None, T, D], name='x')
    lengths = tf.compat.v1.placeholder(tf.int32, [None], name='lengths')
    named = build(x, lengths)
    loss = tf.add_n([tf.reduce_sum(o) for o in tf.nest.flatten(named['out'])])
    return rd.classify([loss], [x, lengths]), named


def _whys(found):
  return [m.describe() for m in found.mixing]


def _weights(shape, seed=1):
  return tf.constant(np.random.RandomState(seed).randn(*shape).astype(np.float32))


def test_a_time_major_transpose_keeps_rows_on_axis_1():
  def build(x, lengths):
    time_major = tf.transpose(x, [1, 0, 2])
    step = time_major[-1]
    over_time = tf.reduce_sum(time_major, 0)
    backwards = tf.reverse(time_major, [0])
    back = tf.transpose(backwards, [1, 0, 2])
    return {'time_major': time_major, 'step': step, 'over_time': over_time,
            'backwards': backwards, 'back': back, 'out': step + over_time + back[:, 0]}
  found, t = _read(build)
  assert not found.mixing, _whys(found)
  assert [found.kind(t[n]) for n in ('time_major', 'step', 'over_time', 'backwards', 'back')] == [
      COLS, ROWS, ROWS, COLS, ROWS]


@pytest.mark.parametrize('how', ['batch_axis', 'slice_batch', 'reverse_batch'])
def test_ops_across_the_batch_axis_of_time_major_values_mix(how):
  def build(x, lengths):
    time_major = tf.transpose(x, [1, 0, 2])
    if how == 'batch_axis':
      out = tf.transpose(time_major, [2, 0, 1])   # the batch on axis 2
    elif how == 'slice_batch':
      out = time_major[:, 1:]
    else:
      out = tf.reverse(time_major, [1])
    return {'out': out}
  found, _ = _read(build)
  assert found.mixing, how


def test_a_zero_state_of_the_batch_size_is_rows():
  """`cell.zero_state(tf.shape(x)[0])`: zeros of concat([expand_dims(n, 0), [H]]), also
  of a time-major input's batch size (`tf.shape(time_major)[1]`)."""
  def build(x, lengths):
    state = tf.compat.v1.nn.rnn_cell.BasicRNNCell(H).zero_state(tf.shape(x)[0], tf.float32)
    size = tf.shape(tf.transpose(x, [1, 0, 2]))[1]
    other = tf.zeros(tf.concat([tf.expand_dims(size, 0), [H]], 0))
    return {'state': state, 'other': other, 'out': x[:, 0, :H] + state + other}
  found, t = _read(build)
  assert not found.mixing, _whys(found)
  assert found.kind(t['state']) == found.kind(t['other']) == ROWS


def _scan(x, lengths):
  w, u = _weights([D, H]), _weights([H, H], 2)
  states = tf.scan(lambda h, x_t: tf.tanh(tf.matmul(x_t, w) + tf.matmul(h, u)),
                   tf.transpose(x, [1, 0, 2]), initializer=tf.zeros([tf.shape(x)[0], H]))
  return {'states': states, 'out': states[-1]}


def _map_fn(x, lengths):
  w = _weights([D, H])
  out = tf.map_fn(lambda e: tf.reduce_max(tf.matmul(e, w), 0), x)
  return {'out': out}


def _while_loop(x, lengths):
  w = _weights([D, H])
  def body(i, h, total):
    h = tf.tanh(tf.matmul(x[:, i], w) + h)
    return i + 1, h, total + tf.reduce_sum(h)
  _, h, total = tf.while_loop(lambda i, *_: i < T, body,
                              [0, tf.zeros([tf.shape(x)[0], H]), 0.0])
  return {'h': h, 'total': total, 'out': [h, total]}


def _dynamic_rnn(x, lengths):
  outputs, state = tf.compat.v1.nn.dynamic_rnn(
      tf.compat.v1.nn.rnn_cell.GRUCell(H), x, sequence_length=lengths, dtype=tf.float32)
  return {'outputs': outputs, 'state': state, 'out': outputs[:, -1] + state}


def _bidirectional(x, lengths):
  (fw, bw), _ = tf.compat.v1.nn.bidirectional_dynamic_rnn(
      tf.compat.v1.nn.rnn_cell.GRUCell(H), tf.compat.v1.nn.rnn_cell.GRUCell(H), x,
      sequence_length=lengths, dtype=tf.float32)
  return {'out': fw + bw}


def _keras_lstm(x, lengths):
  return {'out': tf.keras.layers.LSTM(H, return_sequences=True, go_backwards=True)(x)}


@pytest.mark.parametrize('build', [_scan, _map_fn, _while_loop, _dynamic_rnn, _bidirectional,
                                   _keras_lstm], ids=lambda b: b.__name__[1:])
def test_a_loop_whose_body_keeps_rows_keeps_them(build):
  found, t = _read(build)
  assert not found.mixing, _whys(found)
  assert found.kind(tf.nest.flatten(t['out'])[0]) == ROWS
  if build is _scan:
    assert found.kind(t['states']) == COLS
  if build is _while_loop:
    assert found.kind(t['h']) == ROWS and found.kind(t['total']).tag == rd.STAT


def test_a_loop_whose_body_mixes_mixes():
  def build(x, lengths):
    def body(i, h):
      return i + 1, h + tf.reduce_max(h, 0)   # a max over the batch, each step
    _, h = tf.while_loop(lambda i, h: i < T, body, [0, x[:, 0]])
    return {'out': h}
  found, _ = _read(build)
  if tf.compat.v1.control_flow_v2_enabled():
    assert [m.op.type for m in found.mixing] in (['While'], ['StatelessWhile']), _whys(found)
    assert 'a while loop whose body has Max op' in found.mixing[0].why
    assert [f.name for f in found.frontier] == ['strided_slice:0']
  else:   # control flow v1: the body's ops are the graph's
    assert [m.op.type for m in found.mixing] == ['Max'], _whys(found)


def test_one_examples_values_combined_with_the_batchs_mix():
  def build(x, lengths):
    return {'out': tf.map_fn(lambda e: e + tf.reduce_mean(x, 0), x)}   # x captured whole
  found, _ = _read(build)
  assert found.mixing and 'one example\'s values' in found.mixing[0].why, _whys(found)


def test_rows_changed_a_batch_size_number_of_times_mix():
  def build(x, lengths):
    _, h = tf.while_loop(lambda i, h: i < tf.shape(x)[0], lambda i, h: (i + 1, h * 0.5),
                         [0, x[:, 0]])
    return {'out': h}
  found, _ = _read(build)
  assert found.mixing and 'number of steps depends on the batch size' in found.mixing[0].why


def test_a_count_of_steps_of_the_batch_size_is_a_batch_size():
  def build(x, lengths):
    _, count = tf.while_loop(lambda i, c: i < tf.shape(x)[0], lambda i, c: (i + 1, c + 1.0),
                             [0, 0.0])
    return {'count': count, 'out': x / count}
  found, t = _read(build)
  assert found.kind(t['count']) == rd.Kind(rd.SIZE)
  assert found.mixing and found.mixing[0].op.type == 'RealDiv', _whys(found)


def test_a_loop_to_the_longest_length_that_changes_rows_past_an_examples_own_mixes():
  def build(x, lengths):
    w = _weights([D, D])
    _, h = tf.while_loop(lambda i, h: i < tf.reduce_max(lengths),
                         lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))), [0, x[:, 0]])
    return {'out': h}
  found, _ = _read(build)
  assert found.mixing, _whys(found)


def test_a_reverse_of_sequences_along_the_batch_axis_mixes():
  def build(x, lengths):
    own = tf.reverse_sequence(x, lengths, seq_axis=1, batch_axis=0)
    across = tf.reverse_sequence(tf.transpose(x, [1, 0, 2]), lengths, seq_axis=1, batch_axis=0)
    return {'own': own, 'out': [own, across]}
  found, t = _read(build)
  assert found.kind(t['own']) == ROWS
  assert [m.op.type for m in found.mixing] == ['ReverseSequence'], _whys(found)
