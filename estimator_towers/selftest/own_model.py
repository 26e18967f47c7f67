"""The own-model check: the user's model_fn on N towers and micro-batches gives one device's update.

The rule: the user's model_fn, decorated for the first device alone
(`replicate_model_fn(model_fn, devices=[first])`: with keyed random draws
its dropout draws what any topology draws, so it is the reference), and the
candidates (N towers; 1 device x k micro-batches; N towers x k
micro-batches) train `steps` steps of the user's input_fn from one
initialisation (`one_start`). Every variable and slot of each candidate must
be within the tolerance of the reference, relative to max(1, |reference|):
`TOLERANCE`, or more for a model whose float32 rounding alone moves the
reference further (`rounding_floor`: the reference rerun from its start
nudged by one unit in the last place; the tolerance is a multiple of that).
A candidate that is not names the first variable above it, in the order the
graph creates them, and the op to look at: the first op of the forward pass
that reads that variable, with its device; from there, follow the path to
the loss for what depends on the tower (its device, its index, the shard's
size) or draws at random outside the model_fn. The library's warnings during
the runs are listed too. Each run's heavy ops per device
(`reporting.work_share`) say how evenly the towers share the work. Op
determinism is turned on when a device is a GPU (CPU kernels need none).
`check_model` is the library function the command line wraps.
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.placement import devices as devices_lib
from estimator_towers.reporting import work_share
from estimator_towers.selftest import exactness
from estimator_towers.selftest import one_start
from estimator_towers.selftest import report
from estimator_towers.selftest import rounding_floor
from estimator_towers.selftest import user_code

TOLERANCE = exactness.TOLERANCE
SKIPPED_PREFIXES = (exactness.POSITION_PREFIX,)  # the input's position: not a variable
_BOOKKEEPING = ('gradients', 'save', 'Initializer', 'Assign', 'Apply', 'report_uninitialized',
                'IsInitialized')


def candidates(devices: Sequence[str], micro_batches: int) -> list[tuple[str, tuple, int]]:
  """(label, devices, micro-batches) of each run compared with the first device alone."""
  n, first = len(devices), (devices[0],)
  runs = [(f'{n} towers', tuple(devices), 1)] if n > 1 else []
  if micro_batches > 1:
    runs.append((f'1 device x {micro_batches} micro-batches', first, micro_batches))
    if n > 1:
      runs.append((f'{n} towers x {micro_batches} micro-batches', tuple(devices), micro_batches))
  return runs


def differences(candidate: one_start.Trained, reference: one_start.Trained) -> dict:
  """Variable -> largest |candidate - reference| / max(1, |reference|), in creation order."""
  order = {name: i for i, name in enumerate(reference.order)}
  names = sorted((set(reference.values) | set(candidate.values)),
                 key=lambda name: (order.get(name, len(order)), name))
  found = {}
  for name in names:
    if name.startswith(SKIPPED_PREFIXES):
      continue
    if name not in reference.values or name not in candidate.values:
      found[name] = float('inf')  # in one run only
      continue
    ref = np.asarray(reference.values[name])
    if ref.dtype.kind not in 'fiu':
      continue
    ref = ref.astype(np.float64)
    rel = np.abs(np.asarray(candidate.values[name], np.float64) - ref) / np.maximum(1.0, np.abs(ref))
    found[name] = float(np.max(np.where(np.isnan(rel), np.inf, rel))) if rel.size else 0.0
  return found


def op_to_look_at(graph: tf.Graph, variable: str) -> str | None:
  """The first forward op (in creation order) that reads `variable`: 'name (type on device)'."""
  if graph is None:
    return None
  try:
    start = graph.get_operation_by_name(variable)
  except (KeyError, ValueError):
    return None
  position = {op: i for i, op in enumerate(graph.get_operations())}
  readers, frontier, seen = [], [start], {start}
  while frontier:
    op = frontier.pop()
    for consumer in (c for out in op.outputs for c in out.consumers()):
      if consumer in seen or any(word in consumer.name for word in _BOOKKEEPING):
        continue
      seen.add(consumer)
      if consumer.type in ('ReadVariableOp', 'Identity', 'Enter', 'Switch'):
        frontier.append(consumer)
      else:
        readers.append(consumer)
  if not readers:
    return None
  op = min(readers, key=position.get)
  return f'{op.name} ({op.type} on {op.device or "no device"})'


_TOWER = re.compile(r'^tower_(\d+)/(.*)$')


def tower_only_op(graph: tf.Graph) -> str | None:
  """The first op a tower builds that tower 0 does not: 'name (type on device), ...'.

  Towers build the same model_fn on their shards, so tower i's ops are tower
  0's under `tower_i/`; an op in tower i only is a model_fn that branched on
  its tower (its index, its device, its shard) while building.
  """
  if graph is None:
    return None
  ops = graph.get_operations()
  names = {op.name for op in ops}
  for op in ops:
    match = _TOWER.match(op.name)
    if match and 'gradients' not in op.name and match.group(2) not in names:
      return f'{op.name} ({op.type} on {op.device or "no device"}), built in one tower only'
  return None


def heavy_ops(trained: one_start.Trained, devices: Sequence[str]) -> tuple[dict, float]:
  """The run's heavy ops per device and the first device's share beyond the others'."""
  counts = work_share.heavy_ops(trained.graph, devices)
  return counts, work_share.share(counts, devices_lib.canonical(devices[0]))


class _Warnings(logging.Handler):
  """The library's warnings while the runs build their graphs."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages = []

  def emit(self, record):
    message = record.getMessage()
    if 'estimator_towers' in message and message not in self.messages:
      self.messages.append(message)


@contextlib.contextmanager
def _library_warnings():
  handler = _Warnings()
  loggers = [logging.getLogger('absl'), tf.get_logger()]
  for logger in loggers:
    logger.addHandler(handler)
  try:
    yield handler.messages
  finally:
    for logger in loggers:
      logger.removeHandler(handler)


def _compare(label: str, devices: tuple, micro_batches: int, trained: one_start.Trained,
             reference: one_start.Trained, tolerance: float) -> dict:
  """One candidate's JSON row: its status, the worst and the first variable, the op, the work."""
  found = differences(trained, reference)
  worst = max(found, key=found.get) if found else ''
  above = [name for name, value in found.items() if value > tolerance]
  counts, share = heavy_ops(trained, devices)
  total = sum(counts.values())
  return {'label': label, 'devices': list(devices), 'micro_batches': micro_batches,
          'steps': trained.steps, 'tolerance': tolerance,
          'status': report.FAIL if above else report.PASS,
          'max_difference': found.get(worst, 0.0), 'variable': worst,
          'first_variable': above[0] if above else None,
          'op': (tower_only_op(trained.graph) or op_to_look_at(trained.graph, above[0])
                 if above else None),
          'first_difference': found[above[0]] if above else None,
          'differences': [{'variable': n, 'difference': d} for n, d in found.items()],
          'heavy_ops': counts,
          'heavy_ops_total': total, 'first_device_extra_share': share}


def _lines(run: dict) -> list[str]:
  work = ', '.join(f'{d} {n} ({n / run["heavy_ops_total"]:.0%})'
                   for d, n in run['heavy_ops'].items()) if run['heavy_ops_total'] else 'none'
  lines = [f'{run["status"]}  {run["label"]:34s} max difference {run["max_difference"]:.2e} '
           f'at {run["variable"]}',
           f'      heavy ops per device: {work}']
  if run['first_variable']:
    lines.append(f'      first variable above {run["tolerance"]:.3g}: {run["first_variable"]} '
                 f'({run["first_difference"]:.2e}); op to look at: '
                 f'{run["op"] or "none found (the variable is not read in the forward pass)"}')
  return lines


def check_model(model_fn: Callable, input_fn: Callable, devices: Sequence[str],
                params: dict | None = None, steps: int = 3, micro_batches: int = 2,
                name: str = 'your model_fn', **settings) -> report.Result:
  """The own-model check: PASS when every candidate gives the reference's variables.

  `settings`: `make_config` settings of every run (`sync_batch_norm`, `variable_strategy`).
  """
  devices, params = tuple(devices_lib.canonical(d) for d in devices), dict(params or {})
  gpus = any(tf.DeviceSpec.from_string(d).device_type == 'GPU' for d in devices)
  if gpus:
    tf.config.experimental.enable_op_determinism()
  runs = candidates(devices, micro_batches)
  head = (f'{name}, {steps} steps from one initialisation, against {devices[0]} alone '
          f'(replicate_model_fn); pass: every variable and slot within max({TOLERANCE:g}, '
          f'{rounding_floor.FACTOR:g} x the rounding floor) of it, relative to max(1, |value|)')
  determinism = ('op determinism on (GPUs)' if gpus else
                 'op determinism not needed (CPU devices only)')
  data = {'tolerance': TOLERANCE, 'steps': steps, 'reference': devices[0], 'params': params,
          'settings': settings,
          'op_determinism': gpus, 'runs': [], 'warnings': []}
  if not runs:
    return report.Result('own model', report.INFO, [
        head, f'skipped: one device and --micro_batches={micro_batches}: nothing to compare. '
        f'Give 2 or more devices, or --micro_batches=2.'], data)
  lines, status = [head, determinism], report.PASS
  with _library_warnings() as warned, tempfile.TemporaryDirectory(prefix='et_own_model_') as root:
    start = one_start.initial_checkpoint(model_fn, input_fn, devices[0], params, root, settings)
    reference = one_start.train(model_fn, input_fn, devices[:1], 1, params, start, steps, root,
                                settings)
    floor = rounding_floor.measure(model_fn, input_fn, devices[0], params, start, steps,
                                   reference, differences, root, settings)
    lines.append(rounding_floor.floor_line(floor))
    data.update(rounding_floor.fields(floor))
    for label, run_devices, k in runs:
      try:
        run = _compare(label, run_devices, k, one_start.train(
            model_fn, input_fn, run_devices, k, params, start, steps, root, settings), reference,
            floor.tolerance)
        lines.extend(_lines(run))
      except Exception as e:  # pylint: disable=broad-except  (one run's crash: its FAIL)
        error = f'{type(e).__name__}: {e}'.strip()
        run = {'label': label, 'devices': list(run_devices), 'micro_batches': k,
               'status': report.FAIL, 'error': error}
        lines.append(f'{report.FAIL}  {label:34s} crashed: {error.splitlines()[0][:400]}')
      status = report.FAIL if run['status'] == report.FAIL else status
      data['runs'].append(run)
  data['warnings'] = list(warned)
  lines.extend(f'WARNING  {message[:400]}' for message in warned)
  failed = [r for r in data['runs'] if r.get('first_variable')]
  if failed:
    data.update(first_variable=failed[0]['first_variable'], op=failed[0]['op'])
  return report.Result('own model', status, lines, data)


def check_paths(model_fn: str, input_fn: str, params: str | None, devices: Sequence[str],
                steps: int, micro_batches: int, **settings) -> report.Result:
  """`check_model` of the functions `model_fn` and `input_fn` name (`module.path:function`)."""
  return check_model(user_code.load('model_fn', model_fn), user_code.load('input_fn', input_fn),
                     devices, user_code.params(params), steps, micro_batches, name=model_fn,
                     **{k: v for k, v in settings.items() if v is not None})
