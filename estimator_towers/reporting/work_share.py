"""Work share: how a TRAIN graph's heavy work is spread over the tower devices.

The rule. Data-parallel means every device runs the model on its own rows:
each holds about the single-device model_fn's count of heavy ops (matrix
products, einsums, convolutions, and the ops of their gradients). Where a
computation across examples cannot be split per tower, its head runs once,
on the whole batch, on the first device (`whole_batch_head`): exact, but
that device then holds more than the others, which wait for it. Never serial
in silence: every TRAIN graph of several devices logs its heavy ops per
device (INFO), and a head built once gets one WARNING naming its first
mixing op, the share of the step's heavy ops that the first device holds
beyond the others', and the fix (`cross_example='refuse'` makes it an error
instead, at the head: `request_seeds`). A head that holds no heavy op (a max
or a logsumexp over the batch's per-example losses: B numbers) gets no
warning: nothing heavy waits for it.

The share is counted on the towered graph itself, on the ops a training
step runs (the train op and the loss, and what they wait for: a gradient
TensorFlow made on the way that no step reads is no work): (the head
device's heavy ops - the most any other device holds) / all heavy ops. An
op without a device counts on the first tower's device.
"""

from __future__ import annotations

import collections
import weakref
from typing import Sequence

import tensorflow as tf

from estimator_towers.base import ancestry
from estimator_towers.base import control_flow
from estimator_towers.base import logs
from estimator_towers.base import spelling
from estimator_towers.heads import whole_batch_head
from estimator_towers.placement import devices as devices_lib
from estimator_towers.rows.op_tables import HEAVY



def heavy_ops(graph: tf.Graph, tower_devices: Sequence[str], fetches: Sequence = ()) -> dict:
  """Heavy ops per tower device (canonical names, in the towers' order) that a run of
  `fetches` (ops or tensors; by default the step `report` was given for the graph, or the
  graph's TRAIN_OP collection) runs; every op of the graph if there are none."""
  canonical = [devices_lib.canonical(d) for d in tower_devices]
  counts = collections.Counter()
  for op in _run(graph, fetches):
    if op.type in HEAVY or op.type in _LOOPS:
      counts[_tower_of(op.device, canonical)] += heavy_count(op)
  return {d: counts.get(d, 0) for d in canonical}


_LOOPS = ('While', 'StatelessWhile')


# Per TRAIN graph, what its step fetches (`report`): the default of `heavy_ops`.
_steps: 'weakref.WeakKeyDictionary[tf.Graph, list]' = weakref.WeakKeyDictionary()


def _ops(fetches: Sequence) -> list:
  """The ops of `fetches` (ops or tensors; None left out)."""
  return [getattr(f, 'op', f) for f in fetches if f is not None]


def _run(graph: tf.Graph, fetches: Sequence) -> list:
  """The graph's ops a run of `fetches` (or of its step's, or its TRAIN_OP collection's)
  runs, in creation order."""
  fetches = (_ops(fetches) or _steps.get(graph)
             or graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP))
  if not fetches:
    return graph.get_operations()
  run = ancestry.ancestors_of_all(fetches)
  return [op for op in graph.get_operations() if op in run]


def heavy_count(op: tf.Operation) -> int:
  """`op`'s heavy ops: 1 for a heavy op; for a While loop, 1 and its body's heavy ops (the
  steps of a recurrent network, on the loop's device), loops inside it included."""
  if op.type in HEAVY:
    return 1
  return _loop_heavy(op.graph, op.node_def) if op.type in _LOOPS else 0


def _loop_heavy(graph: tf.Graph, node, depth: int = 0) -> int:
  """A While loop's (a NodeDef's) heavy ops: 1 and its body's, read off the body's
  FunctionDef (a tower copy's loop calls a copy of tower 0's body, with no Python graph)."""
  body = control_flow.function_def(graph, node.attr['body'].func.name) if depth < 8 else None
  return 1 + sum(1 if inner.op in HEAVY else _loop_heavy(graph, inner, depth + 1)
                 if inner.op in _LOOPS else 0 for inner in getattr(body, 'node_def', ()))


def _tower_of(device: str, towers: list) -> str:
  """The tower device `device` names (its own name when no tower's; the first tower if none)."""
  if not device:
    return towers[0]
  spec = tf.DeviceSpec.from_string(device)
  for tower in towers:
    other = tf.DeviceSpec.from_string(tower)
    if (spec.device_type or '').upper() == (other.device_type or '').upper() and (
        (spec.device_index or 0) == (other.device_index or 0)) and (
            spec.task is None or other.task is None or spec.task == other.task) and (
                spec.job is None or other.job is None or spec.job == other.job):
      return tower
  return spec.to_string()


def report(graph: tf.Graph, tower_devices: Sequence[str], fetches: Sequence) -> None:
  """Logs the heavy ops per device of a TRAIN graph's step (`fetches`: its train op and
  loss), and warns of a head built once."""
  _steps[graph] = _ops(fetches)
  counts = heavy_ops(graph, tower_devices)
  total = sum(counts.values())
  once = whole_batch_head.built_once(graph) if _in_heads(graph) else []
  if len(counts) > 1 and total:
    logs.info_once_per_graph(
        'estimator_towers: train graph\'s heavy ops (matrix products, einsums, convolutions '
        'and their gradients) per device: '
        + ', '.join(f'{d} {n} ({n / total:.0%})' for d, n in counts.items()) + '.', graph)
  if once:
    _warn(once, counts, total)


def _in_heads(graph: tf.Graph) -> int:
  """The heavy ops of the heads built on the whole batch (their name scope's)."""
  return sum(heavy_count(op) for op in graph.get_operations()
             if op.name.startswith(_HEAD_SCOPE))


_HEAD_SCOPE = 'whole_batch_head'


def share(counts: dict, device: str) -> float:
  """The share of all heavy ops that `device` holds beyond the most any other device holds."""
  total = sum(counts.values())
  others = max((n for d, n in counts.items() if d != device), default=0)
  return max(counts.get(device, 0) - others, 0) / total if total else 0.0


def _warn(once: list, counts: dict, total: int) -> None:
  first = once[0]
  device = devices_lib.canonical(first.device) if first.device.startswith('/') else (
      next(iter(counts)))
  figure = ''
  if len(counts) > 1 and total:
    others = ', '.join(f'{d} {n}' for d, n in counts.items() if d != device)
    figure = (f': {device} holds {counts.get(device, 0)} of the step\'s {total} heavy ops '
              f'(matrix products, einsums, convolutions and their gradients), the others '
              f'{others}, so {share(counts, device):.0%} of the step\'s heavy work runs on '
              f'one device while the others wait')
  unknown = 'does not know' in first.mixing.why or 'cannot see inside' in first.mixing.why
  fix = ('If that op keeps each example\'s rows apart, the library does not know it yet: '
         'docs/cross_example.md lists what the row reader reads, and how to report an op'
         if unknown else 'Computations across examples that are made of rows (an in-batch '
         'softmax, a top-k) are split per tower: docs/cross_example.md')
  logs.warning_once(
      f'estimator_towers: {first.mixing.describe()} mixes the batch\'s rows as far as the '
      f'library can tell, so everything from it to the loss runs once, on the whole batch, '
      f'on {device}{figure}. Exact, but not data-parallel. {fix}. Pass '
      f'{spelling.setting("cross_example", "refuse")} to make this an error.',
      key=f'work_share:{first.mixing.op.name}')
