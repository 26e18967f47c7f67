"""Bytes that cross devices in one training step, read from TensorFlow itself.

When a session runs a graph whose ops sit on several devices, TensorFlow cuts
it into one partition graph per device and joins them with `_Send` / `_Recv`
pairs: every tensor that crosses devices in a step goes through exactly one
pair. A step run with `run_options()` returns those partition graphs and the
step's stats (`RunMetadata.partition_graphs`, `.step_stats`); `transfers`
lists the pairs, each with the shape and dtype that the producing op output
in that step, so the bytes are the payload actually sent (no headers).

On virtual CPU devices nothing is copied (the receiver shares the buffer),
but the partition graphs are the ones a multi-GPU machine would run, so the
count is the traffic the placement would cause there.

`TransferHook` records one step of an Estimator's training loop.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import tensorflow as tf

_SEND_OPS = ('_Send', '_HostSend')


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One tensor sent from one device to another in a step.

  Attributes:
    tensor: the sent tensor, as 'op_name:output' of the partition graph
      (grappler may have renamed or fused ops of the Python graph).
    source: the sending device.
    destination: the receiving device.
    dtype: the tensor's dtype name.
    shape: its shape in that step, or None if the step did not record it.
    bytes: its payload (elements x element size), or None if unknown.
  """
  tensor: str
  source: str
  destination: str
  dtype: str
  shape: tuple | None
  bytes: int | None

  @property
  def op_name(self) -> str:
    return self.tensor.rsplit(':', 1)[0]


def run_options() -> tf.compat.v1.RunOptions:
  """Options of a step whose RunMetadata `transfers` can read."""
  return tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                                 output_partition_graphs=True)


def _outputs(step_stats) -> dict:
  """(device, node name, output slot) -> the output's TensorDescription."""
  found = {}
  for device in step_stats.dev_stats:
    for node in device.node_stats:
      for output in node.output:
        found[(device.device, node.node_name, output.slot)] = output.tensor_description
  return found


def _size(description) -> tuple[tuple | None, int | None]:
  shape = tuple(d.size for d in description.shape.dim)
  if any(d < 0 for d in shape):
    return None, None
  dtype = tf.as_dtype(description.dtype)
  elements = 1
  for d in shape:
    elements *= d
  if dtype in (tf.string, tf.variant, tf.resource):  # no fixed element size
    return shape, description.allocation_description.requested_bytes or None
  return shape, elements * dtype.size


def transfers(run_metadata: tf.compat.v1.RunMetadata) -> list[Transfer]:
  """The tensors sent between devices in the step `run_metadata` describes.

  Args:
    run_metadata: from a `session.run` with `run_options()`.

  Returns:
    One Transfer per `_Send` whose input was computed in the step (the sends
    themselves are not in the step stats; tensors fed or fetched by the
    client are not transfers between devices).

  Raises:
    ValueError: if the metadata holds no partition graphs (the step was not
      run with `output_partition_graphs=True`).
  """
  if not run_metadata.partition_graphs:
    raise ValueError('The RunMetadata holds no partition graphs: run the step with '
                     'options=traffic.run_options() (output_partition_graphs=True '
                     'and a full trace).')
  outputs = _outputs(run_metadata.step_stats)
  ran = {(d.device, n.node_name) for d in run_metadata.step_stats.dev_stats
         for n in d.node_stats}
  found = []
  for graph in run_metadata.partition_graphs:
    for node in graph.node:
      if node.op not in _SEND_OPS or node.attr['client_terminated'].b:
        continue
      source = node.attr['send_device'].s.decode()
      name, _, slot = node.input[0].partition(':')
      if (source, name) not in ran:
        continue  # the producer did not run (an untaken branch): nothing was sent
      description = outputs.get((source, name, int(slot or 0)))
      shape, size = _size(description) if description is not None else (None, None)
      found.append(Transfer(
          tensor=f'{name}:{int(slot or 0)}', source=source,
          destination=node.attr['recv_device'].s.decode(),
          dtype=tf.as_dtype(node.attr['T'].type).name, shape=shape, bytes=size))
  return found


def total_bytes(found: Sequence[Transfer]) -> int:
  """Bytes of all transfers (raises if one is unknown)."""
  unknown = [t.tensor for t in found if t.bytes is None]
  if unknown:
    raise ValueError(f'The size of {len(unknown)} transfer(s) was not recorded: {unknown[:5]}.')
  return sum(t.bytes for t in found)


def by_link(found: Sequence[Transfer]) -> dict[tuple[str, str], int]:
  """Bytes per (source, destination) pair of devices."""
  links = collections.Counter()
  for t in found:
    links[(t.source, t.destination)] += t.bytes or 0
  return dict(links)


class TransferHook(tf.compat.v1.train.SessionRunHook):
  """Records the transfers of one step of a training loop.

  Args:
    step: which `session.run` of the loop to record, counting from 1 (the
      default, 2, skips the first step, which may run one-off work).
  """

  def __init__(self, step: int = 2):
    self._step = step
    self._runs = 0
    self.transfers: list[Transfer] | None = None

  def before_run(self, run_context):
    self._runs += 1
    if self._runs == self._step:
      return tf.compat.v1.train.SessionRunArgs(None, options=run_options())
    return None

  def after_run(self, run_context, run_values):
    if self._runs == self._step:
      self.transfers = transfers(run_values.run_metadata)
