"""The rule of placement/shared_reads on small graphs: which reads of a variable
a device may receive as one, and which it must not."""

import tensorflow as tf

from estimator_towers.placement import shared_reads


def _graph():
  """A resource variable on /cpu:0 and a helper to read it for a consumer on a device."""
  graph = tf.Graph()
  with graph.as_default(), tf.device('/cpu:0'):
    variable = tf.Variable(1.0, use_resource=True, name='v')

  def read_for(device, controls=()):
    with tf.control_dependencies(list(controls)):  # the read's device left open, as a tower's
      value = tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=tf.float32)
    with tf.device(device):
      return value * 2.0

  return graph, variable, read_for


def _source(consumer):
  return consumer.op.inputs[0].op


def test_unordered_reads_on_one_device_become_one():
  graph, _, read_for = _graph()
  with graph.as_default():
    first, second = read_for('/cpu:1'), read_for('/cpu:1')
  assert _source(first) is not _source(second)
  assert shared_reads.share_reads(graph.get_operations()) == 1
  assert _source(second) is _source(first)


def test_a_read_after_a_write_of_its_variable_stays_its_own():
  """A read that waits for a write of its variable sees the new value: it is not
  served by a read that may run before the write."""
  graph, variable, read_for = _graph()
  with graph.as_default():
    first = read_for('/cpu:1')
    with tf.device('/cpu:0'):
      write = variable.assign_add(1.0)
      other = tf.no_op()
    after_write = read_for('/cpu:1', [write])
    after_other = read_for('/cpu:1', [other])
  own = _source(after_write)
  assert shared_reads.share_reads(graph.get_operations()) == 1
  assert _source(after_write) is own
  assert _source(after_other) is _source(first)
  with tf.compat.v1.Session(graph=graph) as session:
    session.run(variable.initializer)
    assert session.run(after_write) == 4.0  # (`first` may run before or after the write)


def test_reads_on_the_variable_s_device_or_on_two_devices_are_left():
  graph, _, read_for = _graph()
  with graph.as_default():
    home = [read_for('/cpu:0'), read_for('/cpu:0')]
    spread = [read_for('/cpu:1'), read_for('/cpu:2')]
  assert shared_reads.share_reads(graph.get_operations()) == 0
  assert _source(home[0]) is not _source(home[1])
  assert _source(spread[0]) is not _source(spread[1])
