"""gradients/fixed_order on small graphs: where the levels of the grid's tree above the
devices are added, and that the sum is the tree's, bit for bit.

The reference is numpy's float32 additions in the tree's order, written out by
hand for 8 shards: ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)).
"""

import numpy as np
import tensorflow as tf

import testlib
from estimator_towers.gradients import fixed_order

S, N = 8, 4
DEVICES = testlib.cpu_devices(N)           # /cpu:0 to /cpu:3, two shards each
OTHERS = testlib.cpu_devices(N + 1)[1:]    # /cpu:1 to /cpu:4: /cpu:0 not a tower


def _values():
  rng = np.random.RandomState(3)
  # magnitudes far apart, so that another order of the additions rounds differently
  return [(rng.randn(4099) * 10.0 ** rng.randint(-4, 5, 4099)).astype(np.float32)
          for _ in range(S)]


def _pair(a, b):
  return (a + b).astype(np.float32)


def _by_tree(v):
  return _pair(_pair(_pair(v[0], v[1]), _pair(v[2], v[3])),
               _pair(_pair(v[4], v[5]), _pair(v[6], v[7])))


def _total(devices=DEVICES):
  """The fixed-order total of 8 shards, two per device of `devices`, aggregated on
  /cpu:0, and its graph."""
  values = _values()
  graph = tf.Graph()
  with graph.as_default():
    parts = {}
    for k, value in enumerate(values):
      with tf.device(devices[k // (S // N)]):
        parts[k] = tf.identity(tf.constant(value), name=f'shard_{k}')
    order = fixed_order.FixedOrder(S, lambda k: devices[k // (S // N)])
    total = order.total(parts, '/cpu:0')
  with tf.compat.v1.Session(graph=graph, config=testlib.session_config(N + 1)) as session:
    return session.run(total), values, graph


def _adds_by_device(graph):
  adds = [op for op in graph.get_operations() if op.type == 'BiasAdd']
  return {tf.DeviceSpec.from_string(op.device).device_index: sum(
      1 for a in adds if a.device == op.device) for op in adds}


def test_the_sum_is_the_trees_bit_for_bit():
  total, values, _ = _total()
  assert np.array_equal(total, _by_tree(values))
  assert not np.array_equal(total, np.sum(np.stack(values), 0, dtype=np.float32))


def test_the_upper_levels_are_added_on_several_devices():
  """Aggregated on a tower's device, a node of the tree above the devices is added
  where its subtree holding that device is, or its left subtree: /cpu:2 adds its
  pair with /cpu:3, /cpu:0 its own with /cpu:1 and the two halves; each device's
  sum leaves it once."""
  _, _, graph = _total()
  # every device adds its own two shards; /cpu:0 the two levels above, /cpu:2 one
  assert _adds_by_device(graph) == {0: 3, 1: 1, 2: 2, 3: 1}


def test_aggregated_off_the_towers_the_sum_is_the_trees_too():
  """/cpu:0 aggregating for towers on /cpu:1 to /cpu:4 (as the host for GPUs): the
  reduce-scatter, each chunk's levels above the devices added on one tower."""
  total, values, graph = _total(OTHERS)
  assert np.array_equal(total, _by_tree(values))
  assert any('fixed_order_reduce' in op.name for op in graph.get_operations())
