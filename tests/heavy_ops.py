"""Heavy ops per device: is a towered model data-parallel, or serial on one device?

A towered TRAIN graph is data-parallel when every device holds about the
plain model_fn's whole count of heavy ops (matrix products, einsums,
convolutions and their gradients' ops), each run on its own rows. A model
whose work runs once on the whole batch on the first device shows up as one
device with the count and the others with a fraction of it.

`train_graph` builds a model_fn's TRAIN graph (not run) on a dataset of constants;
`per_device` counts heavy ops by device; `least_share` is the least loaded
device's count over the plain graph's total.
"""

from __future__ import annotations

import collections
import re

import tensorflow as tf

HEAVY = frozenset((
    'MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3', 'Einsum', 'Conv2D',
    'Conv2DBackpropInput', 'Conv2DBackpropFilter', 'Conv3D', 'Conv3DBackpropInputV2',
    'Conv3DBackpropFilterV2', 'DepthwiseConv2dNative', 'DepthwiseConv2dNativeBackpropInput',
    'DepthwiseConv2dNativeBackpropFilter', 'SparseTensorDenseMatMul'))


def train_graph(model_fn, features, labels, params=None) -> tf.Graph:
  """`model_fn`'s TRAIN graph on constant `features` / `labels` (numpy nests; labels may be None).

  They are read as Estimator reads an input_fn's dataset (one batch of them, through an
  initializable iterator on the host), so the batch size is unknown, as most input_fns give
  it, and a towered model_fn positions that input as it does in training (no warning).
  """
  graph = tf.Graph()
  with graph.as_default():
    tf.compat.v1.train.create_global_step()
    with tf.device('/cpu:0'):  # where Estimator calls input_fns
      dataset = tf.data.Dataset.from_tensor_slices(
          features if labels is None else (features, labels))
      element = tf.compat.v1.data.make_initializable_iterator(
          dataset.batch(len(tf.nest.flatten(features)[0]))).get_next()
    f, l = (element, None) if labels is None else element
    model_fn(f, l, tf.estimator.ModeKeys.TRAIN, params if params is not None else {}, None)
  return graph


def _device(op: tf.Operation) -> str:
  match = re.search(r'(CPU|GPU):(\d+)', op.device or '', re.IGNORECASE)
  return f'{match.group(1).upper()}:{match.group(2)}' if match else 'CPU:0'


def per_device(graph: tf.Graph) -> dict:
  """Heavy ops by device ('CPU:0', ...); an op without a device counts on CPU:0."""
  counts = collections.Counter()
  for op in graph.get_operations():
    if op.type in HEAVY:
      counts[_device(op)] += 1
  return dict(counts)


def total(graph: tf.Graph) -> int:
  return sum(per_device(graph).values())


def least_share(towered: tf.Graph, plain: tf.Graph, num_devices: int) -> float:
  """The least loaded of `num_devices` devices' heavy ops over the plain graph's total."""
  counts = per_device(towered)
  return min(counts.get(f'CPU:{i}', 0) for i in range(num_devices)) / total(plain)
