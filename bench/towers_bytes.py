"""Bytes that cross devices per training step: each variable strategy against its lower bound.

For the models of bench/towers_bench.py (global batch 256) on N virtual CPU
devices, trains two steps with Estimator and reads the second step's
`_Send`/`_Recv` pairs from TensorFlow's partition graphs
(`estimator_towers.traffic`): the bytes a multi-device machine would move.

Lower bounds (M = bytes of the trainable variables, X = bytes of the input
rows whose tower is not on the device the input_fn runs on, /cpu:0):
- cpu, gpu (a variable on one device; the towers elsewhere read it): each
  tower pulls every variable and pushes every gradient once, except for the
  variables on its own device: 2 * sum_v |v| * (towers not on v's device) + X.
- replicated (reduce to the first device, update, copy back): 2 (N-1) M + X.
- MirroredStrategy (an all-reduce moves at least 2 (N-1) M in total, ring or
  reduce-and-broadcast): 2 (N-1) M. Its input reaches the replicas through
  tf.data's MultiDeviceIterator, which copies each replica's batch in the
  background, outside the step's partition graphs: not counted (X would be
  (N-1)/N of the global batch, as for the towers). Measured twice: with its default
  cross-device ops, whose all-reduce on CPUs runs as collective ops that
  are not `_Send`/`_Recv` pairs (its figure then adds 2 (N-1)/N of the
  reduced payload per device, what a ring all-reduce moves), and with
  `ReductionToOneDevice`, whose transfers are all `_Send`/`_Recv` pairs.

Everything above the bound is listed: scalars (each tower's loss weight
and loss, optimizer hyperparameters sent to a variable's device, ...) and
anything else by tensor.

- synced: the cpu strategy with `sync_batch_norm=True`: its bound is cpu's;
  on top, every batch-norm layer exchanges its statistics with collective
  all-reduces (forward: C + 1 and C floats for C channels; backward the same
  again), reported per layer and as the ring traffic they make.

  python bench/towers_bytes.py                # mlp and resnet, N = 2, 4, 8
  python bench/towers_bytes.py --models=resnet --strategies=cpu,synced  # sync_batch_norm
  python bench/towers_bytes.py --quick        # mlp, N = 2
"""

from __future__ import annotations

import collections
import datetime
import json

from absl import app
from absl import flags
from absl import logging as absl_logging
import tensorflow as tf

from estimator_towers.reporting import traffic
import towers_bench as bench

flags.DEFINE_list('strategies', ['cpu', 'gpu', 'replicated', 'mirrored', 'mirrored_one'],
                  'Variable strategies of the towers, synced (cpu with sync_batch_norm), '
                  'and mirrored (MirroredStrategy, default cross-device ops) / '
                  'mirrored_one (ReductionToOneDevice).')
flags.DEFINE_string('bytes_out', 'towers_bytes.json', 'JSON results file.')
FLAGS = flags.FLAGS

HOST = '/cpu:0'


def _index(device: str) -> tuple:
  spec = tf.DeviceSpec.from_string(device)
  return (spec.device_type or 'CPU').upper(), spec.device_index or 0


class Variables(tf.compat.v1.train.SessionRunHook):
  """The trainable variables (name, bytes, device) and the graph of the training run."""

  def begin(self):
    self.graph = tf.compat.v1.get_default_graph()
    self.found = []
    self.trainable_handles = set()
    for v in tf.compat.v1.trainable_variables():
      copies = getattr(v, 'values', None) or (v,)  # a MirroredVariable's per-device copies
      primary = copies[0]
      size = primary.shape.num_elements() * primary.dtype.base_dtype.size
      self.found.append((primary.name, size, primary.device))
      self.trainable_handles.update(c.handle.op.name for c in copies)


def kind(transfer: traffic.Transfer, variables: Variables) -> str:
  """What a transfer beyond the parameters, gradients and inputs is, or ''."""
  if transfer.shape == () or (transfer.bytes or 0) == 0:
    return 'scalars'
  try:
    op = variables.graph.get_operation_by_name(transfer.op_name)
  except KeyError:  # made by grappler: not in the Python graph
    return ''
  if op.type == 'ReadVariableOp' and op.inputs[0].op.name not in variables.trainable_handles:
    return 'non-trainable reads'  # batch norm's moving statistics (or their replicas' refresh)
  if op.type in ('FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3'):
    return 'batch statistics'  # tower 0's, to the moving averages' device
  return ''


class Collectives(tf.compat.v1.train.SessionRunHook):
  """Payload of the collective all-reduce ops of step 2, per device (from step stats)."""

  def __init__(self):
    self._runs = 0
    self.payload = collections.Counter()

  def before_run(self, run_context):
    self._runs += 1  # step 2 is traced at the TransferHook's request

  def after_run(self, run_context, run_values):
    if self._runs != 2 or not run_values.run_metadata.step_stats.dev_stats:
      return
    for device in run_values.run_metadata.step_stats.dev_stats:
      for node in device.node_stats:
        if 'Collective' in node.timeline_label.split('(')[0]:
          for output in node.output:
            shape = [d.size for d in output.tensor_description.shape.dim]
            elements = 1
            for d in shape:
              elements *= d
            dtype = tf.as_dtype(output.tensor_description.dtype)
            self.payload[device.device] += elements * dtype.size


def row_bytes() -> int:
  """Bytes of one input example: the CIFAR-shaped float32 image and its int32 label."""
  height, width, channels = bench.IMAGE_SHAPE
  return height * width * channels * 4 + 4


def shard_rows(batch: int, n: int) -> list[int]:
  q, r = divmod(batch, n)
  return [q + (1 if k < r else 0) for k in range(n)]


def lower_bound(strategy: str, n: int, variables: list) -> tuple[int, int]:
  """(parameter traffic, input traffic) of the scheme's lower bound."""
  devices = [f'/cpu:{k}' for k in range(n)]
  if strategy in ('cpu', 'gpu'):
    params = sum(2 * size * sum(_index(d) != _index(device) for d in devices)
                 for _, size, device in variables)
  else:  # replicated, and MirroredStrategy's all-reduce
    params = 2 * (n - 1) * sum(size for _, size, _ in variables)
  if strategy.startswith('mirrored'):
    return params, 0  # its input copies are not part of the step (see the docstring)
  rows = shard_rows(FLAGS.batch_size, n)
  inputs = sum(rows[k] for k in range(n) if _index(devices[k]) != _index(HOST)) * row_bytes()
  return params, inputs


def measure(model: str, strategy: str, n: int, strategies: dict) -> dict:
  if strategy.startswith('mirrored'):
    estimator, input_fn = bench.make_estimator(model, 'mirrored', n, strategies[strategy])
  elif strategy == 'synced':
    estimator, input_fn = bench.make_estimator(model, 'synced', n, {}, variable_strategy='cpu')
  else:
    estimator, input_fn = bench.make_estimator(model, 'towered', n, {}, variable_strategy=strategy)
  sent, variables, collectives = traffic.TransferHook(step=2), Variables(), Collectives()
  estimator.train(input_fn, steps=2, hooks=[sent, variables, collectives])
  found = sent.transfers
  measured = traffic.total_bytes(found)
  ring = 0
  if collectives.payload:  # what a ring all-reduce of that payload moves
    ring = int(sum(2 * (n - 1) / n * b for b in collectives.payload.values()))
  params, inputs = lower_bound('cpu' if strategy == 'synced' else strategy, n, variables.found)
  extras = collections.Counter()
  for t in found:
    extras[kind(t, variables)] += t.bytes or 0
  core = measured + ring - sum(b for k, b in extras.items() if k)
  return {
      'model': model, 'strategy': strategy, 'n': n, 'measured': measured + ring,
      'send_recv': measured, 'collective_ring': ring, 'bound': params + inputs,
      'bound_parameters': params, 'bound_inputs': inputs, 'transfers': len(found),
      'parameters_gradients_inputs': core,
      'extras': {k: b for k, b in extras.items() if k},
      **_sync_points(variables.graph, collectives, n),
  }


def _sync_points(graph: tf.Graph, collectives: Collectives, n: int) -> dict:
  """sync_batch_norm's exchanges: per batch-norm layer (4 all-reduces each)."""
  reduces = [op for op in graph.get_operations() if op.type == 'CollectiveReduce']
  layers = len(reduces) // (4 * n)  # two forward and two backward per tower
  if not layers or not collectives.payload:
    return {}
  per_device = max(collectives.payload.values())
  return {'sync_layers': layers, 'sync_payload_per_device': per_device,
          'sync_payload_per_layer': per_device // layers}


def _excess_note(row: dict) -> str:
  """The excess over the bound, by kind; 'other' is parameter, gradient or
  input traffic beyond the bound (none when the scheme is at its bound)."""
  parts = [f'{k} {b:,}' for k, b in sorted(row['extras'].items()) if b]
  other = row['parameters_gradients_inputs'] - row['bound']
  if other:
    parts.append(f'OTHER {other:+,}')
  excess = row['measured'] - row['bound']
  return f'{excess:+,}' + (f' ({"; ".join(parts)})' if parts else '')


def main(argv):
  del argv
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  absl_logging.set_verbosity(absl_logging.ERROR)
  models, counts = FLAGS.models, [int(n) for n in FLAGS.num_devices]
  if FLAGS.quick:
    models, counts = ['mlp'], [2]
  # MirroredStrategies first: created after a session has run, they see one CPU.
  strategies = {}
  if 'mirrored' in FLAGS.strategies:
    strategies['mirrored'] = {n: tf.distribute.MirroredStrategy(
        [f'/cpu:{i}' for i in range(n)]) for n in counts}
  if 'mirrored_one' in FLAGS.strategies:
    strategies['mirrored_one'] = {n: tf.distribute.MirroredStrategy(
        [f'/cpu:{i}' for i in range(n)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device=HOST))
        for n in counts}
  header = (f'{datetime.date.today()}  {bench.machine()}  TensorFlow {tf.__version__}; '
            f'global batch {FLAGS.batch_size}; bytes per step (step 2), from partition graphs')
  print(f'# {header}')
  rows = []
  for model in models:
    for n in counts:
      for strategy in FLAGS.strategies:
        row = measure(model, strategy, n, strategies)
        rows.append(row)
        print(f'{model:6s} N={n} {strategy:12s} measured {row["measured"]:>12,}  bound '
              f'{row["bound"]:>12,}  excess {_excess_note(row)}'
              + (f'  [all-reduce via collectives: {row["collective_ring"]:,} B of the '
                 f'measured, as a ring moves it]' if row['collective_ring'] else '')
              + (f'  [sync_batch_norm: {row["sync_layers"]} layers, '
                 f'{row["sync_payload_per_layer"]:,} B reduced per layer and device]'
                 if 'sync_layers' in row else ''),
              flush=True)
  print('\n| model | N | strategy | bytes/step | lower bound | excess |')
  print('|---|---|---|---|---|---|')
  for row in rows:
    print(f'| {row["model"]} | {row["n"]} | {row["strategy"]} | {row["measured"]:,} '
          f'| {row["bound"]:,} | {_excess_note(row)} |')
  with open(FLAGS.bytes_out, 'w', encoding='utf-8') as f:
    json.dump({'header': header, 'rows': rows}, f, indent=1)
  print(f'wrote {FLAGS.bytes_out}')


if __name__ == '__main__':
  app.run(main)
