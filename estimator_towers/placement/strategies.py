"""Variable placement strategies: where variables live and where gradients meet.

Each strategy is a small class behind one interface; `STRATEGIES` maps the
`variable_strategy` name (a flag value) to its class. Tower compute always stays
on the tower's own device; a strategy only decides where each new variable is
created, on which device a variable's per-tower gradients are summed, and
whether the other towers read copies of the variables on their own devices.
"""

from __future__ import annotations

import math
from typing import Sequence
import weakref

import tensorflow as tf


from estimator_towers.base import control_flow
from estimator_towers.base import interception
from estimator_towers.cluster import cross_worker
from estimator_towers.placement import devices as devices_lib


class Placement:
  """Interface of a variable placement strategy.

  Args:
    tower_devices: canonical device strings, one per tower.
  """

  name = ''

  def __init__(self, tower_devices: Sequence[str]):
    self.tower_devices = tuple(tower_devices)

  def variable_device(self, shape: tf.TensorShape | None, dtype: tf.DType | None,
                      name: str) -> str:
    """The device a new variable is created on."""
    raise NotImplementedError

  def aggregation_device(self, variable: tf.Variable) -> str:
    """The device on which `variable`'s gradients are combined.

    The variable's own device, unless the variable lives on another task than
    the towers (a parameter server under TF_CONFIG): then the towers' gradients
    are summed on the towers' host CPU and only the sum crosses the network.
    """
    home = tf.DeviceSpec.from_string(variable.device)
    towers = tf.DeviceSpec.from_string(self.tower_devices[0])
    if home.job is not None and (home.job, home.task) != (towers.job, towers.task):
      return devices_lib.host_device(self.tower_devices[0])
    return variable.device

  def replica_device(self, tower: int) -> str | None:  # pylint: disable=unused-argument
    """The device of tower `tower`'s copies of the variables, or None.

    None (the default) means that the tower uses the shared variables
    themselves; a device means that it reads its own copies there, which are
    refreshed from the shared variables after every update.
    """
    return None

  def describe(self) -> str:
    """One line for the placement log."""
    raise NotImplementedError


class CpuPlacement(Placement):
  """Variables on one parameter device: the host CPU of the first tower's
  worker when there are several towers, the single device otherwise."""

  name = 'cpu'

  def __init__(self, tower_devices: Sequence[str]):
    super().__init__(tower_devices)
    first = self.tower_devices[0]
    self.parameter_device = (first if len(self.tower_devices) == 1
                             else devices_lib.host_device(first))

  def variable_device(self, shape, dtype, name):
    return self.parameter_device

  def describe(self):
    return f'variables on {self.parameter_device}'


def variable_bytes(shape: tf.TensorShape | None, dtype: tf.DType | None) -> int:
  """Bytes a new variable is counted for when balancing devices.

  Unknown dimensions (and an unknown rank) count as 1, and every variable counts
  for at least one element; an unknown dtype counts as float32, and a dtype with no
  fixed element size (string, resource, variant) as 1 byte per element.
  """
  shape = tf.TensorShape(shape)
  dims = shape.as_list() if shape.rank is not None else []
  elements = max(math.prod(d for d in dims if d is not None), 1)
  item = tf.as_dtype(dtype).base_dtype.size if dtype is not None else tf.float32.size
  return elements * max(item, 1)


class GpuPlacement(Placement):
  """Variables spread over the tower devices, greedily balanced by byte size.

  The rule of TensorFlow's `GreedyLoadBalancingStrategy` with a byte-size load
  function, and of tf_cnn_benchmarks' `ParamServerDeviceSetter`: each new
  variable goes, in creation order, to the tower device holding the fewest
  bytes so far (the lowest-indexed one on a tie). Each variable's gradients are
  combined on its own device, so the reduction work is spread as well.
  """

  name = 'gpu'

  def __init__(self, tower_devices: Sequence[str]):
    super().__init__(tower_devices)
    self.loads = [0] * len(self.tower_devices)  # bytes placed on each device

  def variable_device(self, shape, dtype, name):
    k = min(range(len(self.loads)), key=self.loads.__getitem__)
    self.loads[k] += variable_bytes(shape, dtype)
    return self.tower_devices[k]

  def describe(self):
    return (f'variables spread over {", ".join(self.tower_devices)}, each on the '
            f'device with the fewest bytes so far')


class ReplicatedPlacement(Placement):
  """Every tower reads its own copy of the variables, on its own device.

  The variables themselves (the ones the checkpoint holds, and the optimizer's
  slots) live on the first tower's device, and tower 0 uses them directly;
  tower k > 0 gets copies on its device. All towers' gradients are combined on
  the first device, the optimizer updates the variables there once, and then
  the new values are copied to every tower's device (reduce, update,
  broadcast; no all-reduce).
  """

  name = 'replicated'

  def variable_device(self, shape, dtype, name):
    return self.tower_devices[0]

  def replica_device(self, tower):
    return self.tower_devices[tower]

  def describe(self):
    return (f'variables on {self.tower_devices[0]}, copied to each other tower\'s '
            f'device and refreshed after every update')


def tower_device(device: str, pinned: set | None = None):
  """The device function of a tower: its ops on `device`, except resource users.

  An op that takes a variable's handle (a read, a sparse lookup, a read inside
  a `tf.cond` branch) goes where the variable is, so that the session can
  place the graph without soft placement: a resource and its users must share
  a device. A control-flow op that passes a handle into its branches (a
  `tf.cond` reading a variable) is left unpinned for the same reason, while
  the ops inside its branches are placed by this rule. An op a device scope
  inside the tower placed keeps that device (its name is added to `pinned`).
  """
  def device_fn(op: tf.Operation) -> str:
    chosen = device
    if op.type in LOOP_OPS + FUNCTION_CALLS:
      _loop_devices.setdefault(op.graph, {})[op.name] = device
    for tensor in op.inputs:
      if tensor.dtype == tf.resource:
        chosen = device if op.type in LOOP_OPS + FUNCTION_CALLS else '' if op.type in CALL_OPS else (
            interception.resource_device(tensor) or device)
        break
    if op.device:  # set by a device scope inside the tower: it takes precedence
      if pinned is not None:
        pinned.add(op.name)
      return (tf.DeviceSpec.from_string(chosen)
              .make_merged_spec(tf.DeviceSpec.from_string(op.device)).to_string())
    return chosen
  return device_fn


# Loops stay on their tower's device with a variable's handle among their inputs (the
# steps, and their gradients' colocated with them, are the tower's work); but what the
# gradient builds colocated with such a loop that reads a handle (the zeros of a variable's
# shape, `VariableShape`) must be where the variable is: `place_gradient_loops`.
LOOP_OPS = ('While', 'StatelessWhile')
# Calls of a `tf.function` stay on the tower's device too: their body is the tower's work.
FUNCTION_CALLS = ('PartitionedCall', 'StatefulPartitionedCall')
# graph -> {name of a tower's loop that takes a variable's handle: the tower's device}
_loop_devices: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def place_gradient_loops(ops: Sequence[tf.Operation]) -> None:
  """The ops among `ops` (a gradient's) colocated with a tower's loop that read a variable's
  handle: out of the loop's colocation group, where the variable is."""
  towers = _loop_devices.get(ops[0].graph, {}) if ops else {}
  for op in ops:
    _placed_groups_only(op)
    if op.type in LOOP_OPS and any(group.decode()[len('loc:@'):] in towers
                                   for group in op.colocation_groups()):
      control_flow.keep_loop(op)
    if not any(t.dtype == tf.resource for t in op.inputs) or op.type in CALL_OPS:
      continue
    if any(group.decode()[len('loc:@'):] in towers for group in op.colocation_groups()):
      resource = [t for t in op.inputs if t.dtype == tf.resource][0]
      control_flow.place_alone(op, interception.resource_device(resource) or '')


def _placed_groups_only(op: tf.Operation) -> None:
  """`op` (a v1 loop's gradient accumulator, colocated with the forward op and with the value
  it keeps) out of the groups of ops placed by a resource they read (a variable's read, a
  TensorArray's, inside the loop: where the session puts the resource), while the forward op
  is on the tower's device."""
  groups = op.colocation_groups()
  if len(groups) < 2:
    return
  placed = []
  for group in groups:
    try:
      other = op.graph.get_operation_by_name(group.decode()[len('loc:@'):])
    except KeyError:
      return
    if not control_flow.in_control_flow(other):
      return
    if other.device and not any(t.dtype == tf.resource for t in other.inputs):
      placed.append(group)   # not where a resource it reads puts it
  if placed and len(placed) < len(groups):
    control_flow.colocate_only(op, placed)


# Ops that call a function (the lowered form of tf.cond and tf.while_loop).
CALL_OPS = ('If', 'StatelessIf', 'While', 'StatelessWhile', 'Case', 'StatelessCase',
             'PartitionedCall', 'StatefulPartitionedCall')


class CollectivePlacement(ReplicatedPlacement):
  """A copy of the variables per device, gradients all-reduced by collective ops, on 1 to W machines.

  On one machine: placed as 'replicated' (the variables on tower 0's device,
  a copy on every other tower's), but each variable's per-device gradients
  are summed by one collective all-reduce over the tower devices
  (`combine`: TensorFlow runs it on NCCL between GPUs, as a ring on CPUs),
  tower 0's result updating the variable. Across the workers of a TF_CONFIG
  cluster (chief and workers, no ps), each worker's sum is all-reduced again
  with the same collective ops (`cross_worker`), and every worker applies the
  same update to its own variables, which start from the chief's values.
  """

  name = 'collective'

  def describe(self):
    return (super().describe() + '; gradients all-reduced between the devices and '
            'across the workers of a TF_CONFIG cluster, if any, by collective ops')

  @property
  def communication_hint(self) -> str:
    gpus = all(tf.DeviceSpec.from_string(d).device_type == 'GPU' for d in self.tower_devices)
    return 'nccl' if gpus else 'ring'

  def combine(self, parts: Sequence) -> tf.Tensor | None:
    """One variable's gradient from its parts, one per tower device in order; None: cannot.

    An all-reduce over the tower devices; tower 0's result is returned and
    waits for the other devices' (so that all of them run).
    """
    if len(parts) != len(self.tower_devices) or len(parts) < 2 or any(p is None for p in parts):
      return None
    graph = tf.compat.v1.get_default_graph()
    key = cross_worker.instance_key(graph)
    group = cross_worker.local_group_key()
    outputs = []
    with tf.name_scope('all_reduce_between_devices'):
      for device, part in zip(self.tower_devices, parts):
        with tf.device(device):
          outputs.append(interception.all_reduce(
              tf.convert_to_tensor(part), len(parts), group, key, 'Add', 'Id',
              communication_hint=self.communication_hint))
      with tf.device(self.tower_devices[0]), tf.control_dependencies(outputs[1:]):
        return tf.identity(outputs[0])


STRATEGIES: dict[str, type[Placement]] = {
    CpuPlacement.name: CpuPlacement,
    GpuPlacement.name: GpuPlacement,
    ReplicatedPlacement.name: ReplicatedPlacement,
    CollectivePlacement.name: CollectivePlacement,
}


def validate_strategy(name: object) -> str:
  """Checks a `variable_strategy` name.

  Raises:
    ValueError: if `name` is neither 'auto' nor one of `STRATEGIES`.
  """
  if name not in STRATEGIES and name != 'auto':
    raise ValueError(
        f'variable_strategy must be one of {["auto"] + sorted(STRATEGIES)} (\'auto\': the '
        f'strategy recommended for the devices), got {name!r}.')
  return name


def make_placement(name: str, tower_devices: Sequence[str]) -> Placement:
  """The placement of strategy `name` (not 'auto': `recommended.choose` resolves it)."""
  return STRATEGIES[validate_strategy(name)](tower_devices)
