"""Heavy ops per device: is a towered model data-parallel, or serial on one device?

A towered TRAIN graph is data-parallel when every device holds about the
plain model_fn's whole count of heavy ops (matrix products, einsums,
convolutions and their gradients' ops), each run on its own rows. A model
whose work runs once on the whole batch on the first device shows up as one
device with the count and the others with a fraction of it.

`train_graph` builds a model_fn's TRAIN graph (not run) on a dataset of constants;
`per_device` counts heavy ops by device, those a training step runs (its train
op's and what it waits for, `run_by_a_step`: a gradient TensorFlow made on the
way that no step reads is no work); `least_share` is the least loaded device's
count over the heavy ops the plain graph's step needs (`needed_by_a_step`).
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
    spec = model_fn(f, l, tf.estimator.ModeKeys.TRAIN, params if params is not None else {},
                    None)
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TRAIN_OP, spec.train_op)
  return graph


def _device(op: tf.Operation) -> str:
  match = re.search(r'(CPU|GPU):(\d+)', op.device or '', re.IGNORECASE)
  return f'{match.group(1).upper()}:{match.group(2)}' if match else 'CPU:0'


def run_by_a_step(graph: tf.Graph) -> list:
  """The ops a training step runs: its train op (the TRAIN_OP collection) and what it waits
  for, through inputs and control inputs, as the library's own report counts them; every op
  of a graph without a train op."""
  train_ops = graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP)
  if not train_ops:
    return graph.get_operations()
  run = walk(train_ops, controls=True)
  return [op for op in graph.get_operations() if op in run]


def needed_by_a_step(graph: tf.Graph) -> list:
  """The ops a training step needs: what the stateful ops it runs (the variables' updates,
  reads and random draws; ref variables' too) read, directly or not. Not an op it runs
  only because a control input waits for it: the optimizer's gates
  (`gate_gradients=GATE_OP`) make a plain step compute its input's gradient, which
  nothing reads (the towers' backward passes have no gates)."""
  waited = run_by_a_step(graph)
  needed = walk([op for op in waited if _stateful(op)], controls=False)
  return [op for op in graph.get_operations() if op in needed]


def _stateful(op: tf.Operation) -> bool:
  """A stateful op, or one that writes or reads a ref variable (TF1 behaviour's updates)."""
  return op.op_def.is_stateful or any(arg.is_ref for arg in op.op_def.input_arg)


def walk(ops, controls: bool = True) -> set:
  """`ops` and the ops they read, transitively (and wait for, with `controls`)."""
  found, stack = set(), list(ops)
  while stack:
    op = stack.pop()
    if op not in found:
      found.add(op)
      stack.extend(t.op for t in op.inputs)
      if controls:
        stack.extend(op.control_inputs)
  return found


def per_device(graph: tf.Graph) -> dict:
  """Heavy ops a step runs by device ('CPU:0', ...); an op without a device counts on CPU:0."""
  counts = collections.Counter()
  for op in run_by_a_step(graph):
    if op.type in HEAVY:
      counts[_device(op)] += 1
  return dict(counts)


def total(graph: tf.Graph) -> int:
  """The heavy ops a step of `graph` needs (`needed_by_a_step`), on any device."""
  return sum(1 for op in needed_by_a_step(graph) if op.type in HEAVY)


def least_share(towered: tf.Graph, plain: tf.Graph, num_devices: int) -> float:
  """The least loaded of `num_devices` devices' heavy ops (run) over the plain graph's total
  (needed)."""
  counts = per_device(towered)
  return min(counts.get(f'CPU:{i}', 0) for i in range(num_devices)) / total(plain)
