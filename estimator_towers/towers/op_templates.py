"""Op templates: ops of a graph imported again, with their inputs, devices and seeds remapped.

A template is a list of ops (in creation order) read once into NodeDefs; an
instance imports them into the same graph in one `import_graph_def`, under a
name scope of its own. The rule for each op of an instance:
  - its type and attributes are the template op's;
  - an input from another op of the template is that op's instance; one from
    outside is `theirs(tensor)`, or, where that is None, the tensor itself if
    the template's owner shares it (`made` does not hold it), and the
    instance is not made at all if it does not;
  - a control input from outside follows the same rule, except that one with
    no counterpart is dropped (an update only the owner runs);
  - its device is the instance's device if the template op was on the owner's
    device (`home`), the device of the variable it reads (the instance's own
    copy where `theirs` maps the handle), or nowhere if the template op was;
    an op colocated with others is colocated with their instances (or with
    the shared op itself) and takes its device from them;
  - a random op seeded by the graph-level seed draws the next op seed, as
    building it would; an explicit op seed stays.
  - a functional loop calls copies of the template's functions, named for the
    instance, their ops on the instance's device where they were on the
    owner's (`loop_copies`).
A template cannot be made (the reason is returned instead) of an op in a v1
`tf.cond` or `tf.while_loop` or that calls a function other than a loop
`loop_copies` can copy (TensorFlow's gradient of a `tf.cond` rewrites the
function in place), a Placeholder, a stateful op
with a shared name, an op that creates a resource (a copy would be a new,
uninitialised table or queue), or an op a device scope of the model_fn placed (`pinned`)
or that is on some other device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf

from estimator_towers.base import control_flow
from estimator_towers.base import interception
from estimator_towers.placement import strategies as placement_lib
from estimator_towers.towers import loop_copies

Counterpart = Callable[[tf.Tensor], 'tf.Tensor | None']


@dataclasses.dataclass
class Template:
  """Ops to import again, read once.

  Attributes:
    ops: the ops, in creation order.
    node_defs: their NodeDefs, inputs named by the template ops' tensors.
    external: per input name of `node_defs` from outside the ops, the tensor.
    controls: per op's position, its control inputs from outside.
    devices: per op, 'home' (the instance's device), 'resource' (its
      variable's, which may be the instance's own copy), 'colocated' (set by
      its colocation) or the device it keeps.
    colocated: per op's position, the ops it is colocated with.
    seeded: positions of the ops whose seeds are drawn anew per instance.
    made: the ops the owner made for itself (they have counterparts; any
      other op from outside is shared).
    home: the owner's device.
    functions: the FunctionDefs the ops' functional loops call, by name
      (`loop_copies.called_by`), copied per instance.
  """
  ops: list
  node_defs: list
  external: dict
  controls: dict
  devices: list
  colocated: dict
  seeded: set
  made: set
  home: str = ''
  functions: dict = dataclasses.field(default_factory=dict)


def make(ops: list, made: set, home: str, pinned: set, seed_range: range
         ) -> Template | str:
  """The template of `ops`, or why it cannot be made.

  Args:
    ops: the ops, in creation order.
    made: the ops their owner made for itself (see `Template.made`).
    home: the owner's device.
    pinned: names of ops a device scope of the model_fn placed.
    seed_range: the op seeds the graph-level seed gave out while `ops` were made.
  """
  members = set(ops)
  node_defs, external, controls, devices, colocated, seeded = [], {}, {}, [], {}, set()
  for op in ops:
    reason = _unsafe(op)
    if reason:
      return reason
    node_def = tf.compat.v1.NodeDef()
    node_def.CopyFrom(op.node_def)
    node_def.ClearField('device')
    del node_def.input[:]
    for tensor in op.inputs:
      name = f'{tensor.op.name}:{tensor.value_index}'
      if tensor.op not in members:
        external[name] = tensor
      node_def.input.append(name)
    for control in op.control_inputs:
      if control in members:
        node_def.input.append(f'^{control.name}')
      else:
        controls.setdefault(len(node_defs), []).append(control)
    targets = _colocation_targets(op)
    if targets:
      colocated[len(node_defs)] = targets
      devices.append('colocated')
    else:
      device = None if op.name in pinned else _device_rule(op, home)
      if device is None:
        return (f'{op.name} was put on {op.device!r} by the model_fn (a device '
                f'scope), not by the tower')
      devices.append(device)
    if _graph_seeded(op, op.graph, seed_range):
      seeded.add(len(node_defs))
    node_defs.append(node_def)
  loops = [op for op in ops if op.type in loop_copies.LOOPS]
  functions = loop_copies.called_by(ops[0].graph, loops) if loops else {}
  if isinstance(functions, str):
    return functions
  return Template(ops, node_defs, external, controls, devices, colocated, seeded, made,
                  home, functions)


def _device_rule(op: tf.Operation, home: str) -> str | None:
  """'home', 'resource', the device op keeps in every instance, or None (placed otherwise)."""
  if not op.device:
    return ''
  home_spec = tf.DeviceSpec.from_string(home)
  if op.type in loop_copies.LOOPS and tf.DeviceSpec.from_string(op.device) == home_spec:
    return 'home'   # a tower's loop runs on its device, whatever variables it reads
  for tensor in op.inputs:
    if tensor.dtype == tf.resource:  # with the variable: the instance's, if it has its own
      return '' if op.type in placement_lib.CALL_OPS else 'resource'
  if tf.DeviceSpec.from_string(op.device) == home_spec:
    return 'home'
  return None


def instance(template: Template, prefix: str, device: str, theirs: Counterpart
             ) -> tuple[Counterpart | None, str | None]:
  """`template` imported under `prefix` for `device`: (counterpart, None) or (None, why not).

  The template ops' names are unique, so templates of one owner can share a
  prefix. `counterpart(tensor)` is the instance's tensor for a tensor of the
  template's ops (None for any other); a template of no ops has an empty instance.
  """
  if not template.ops:
    return (lambda tensor: None), None
  graph = template.ops[0].graph
  device = tf.DeviceSpec.from_string(device).to_string()
  renamed = {op.name: f'{prefix}/{op.name}' for op in template.ops}
  input_map = {}
  for name, tensor in template.external.items():
    found = theirs(tensor)
    if found is None and tensor.op in template.made:
      return None, f'{tensor.name} of the first tower has no counterpart in the others'
    input_map[name] = tensor if found is None else found
  graph_def = tf.compat.v1.GraphDef()
  graph_def.versions.CopyFrom(graph.graph_def_versions)
  colocated = {}  # an instance op's name -> its colocation group's
  for i, (op, node_def) in enumerate(zip(template.ops, template.node_defs)):
    copied = graph_def.node.add()
    copied.CopyFrom(node_def)
    copied.name = renamed[op.name]
    for j, name in enumerate(copied.input):
      if name.startswith('^'):
        copied.input[j] = '^' + renamed[name[1:]]
      elif name not in input_map:
        source, index = name.rsplit(':', 1)
        copied.input[j] = f'{renamed[source]}:{index}'
    if i in template.colocated:
      names = []
      for target in template.colocated[i]:
        mapped = renamed.get(target.name) or _op_name(theirs, target)
        if mapped is None and target in template.made:
          return None, (f'{op.name} is colocated with {target.name}, which has no '
                        f'counterpart in the other towers')
        names.append(f'loc:@{mapped or target.name}'.encode())
      copied.attr['_class'].list.s[:] = names
      colocated[copied.name] = [n[len(b'loc:@'):].decode() for n in names
                                if n != f'loc:@{copied.name}'.encode()]
    elif template.devices[i] == 'home':
      copied.device = device
    elif template.devices[i] == 'resource':  # where its variable is
      copied.device = _resource_device(op, input_map) or op.device
    else:
      copied.device = template.devices[i]
    if i in template.seeded:
      copied.attr['seed'].i, copied.attr['seed2'].i = tf.compat.v1.random.get_seed(None)
  why = _loops_copied(template, graph_def, prefix, device)
  if why:
    return None, why
  with graph.as_default(), graph.device(None):
    copies = interception.import_ops(graph_def, input_map,
                                     [renamed[op.name] for op in template.ops], colocated)
  for i, controls in template.controls.items():
    interception.add_control_inputs(copies[i], _their_controls(controls, template.made, theirs))
  by_op = dict(zip(template.ops, copies))

  def counterpart(tensor: tf.Tensor) -> tf.Tensor | None:
    op = by_op.get(tensor.op) if isinstance(tensor, tf.Tensor) else None
    if op is None or tensor.value_index >= len(op.outputs):  # an output added later
      return None
    return op.outputs[tensor.value_index]
  return counterpart, None


def _loops_copied(template: Template, graph_def, prefix: str, device: str) -> str | None:
  """The instance's loops (in `graph_def`) call copies of the template's functions, added to
  the graph; or why they cannot (tower 0's loop was rewritten since the template was read)."""
  loops = [(op, node_def, copied) for op, node_def, copied
           in zip(template.ops, template.node_defs, graph_def.node)
           if op.type in loop_copies.LOOPS]
  if not loops:
    return None
  stale = [op.name for op, node_def, _ in loops if loop_copies.stale(op, node_def)]
  if stale:
    return (f'{stale[0]} was rewritten in place by its gradient (a loop built without all '
            f'its intermediates as outputs)')
  called, functions = loop_copies.copies(template.functions, prefix, template.home, device)
  for _, _, copied in loops:
    loop_copies.rename(copied, called)
  control_flow.add_functions(template.ops[0].graph, functions)
  return None


def _resource_device(op: tf.Operation, input_map: dict) -> str | None:
  """The device of the variable an instance of `op` reads, if its handle comes from outside."""
  for tensor in op.inputs:
    if tensor.dtype == tf.resource:
      mapped = input_map.get(f'{tensor.op.name}:{tensor.value_index}')
      return None if mapped is None else interception.resource_device(mapped)
  return None


def _their_controls(controls: list, made: set, theirs: Counterpart) -> list:
  """An instance's control inputs for the template's `controls` from outside.

  A shared op is the same op; one the owner made for itself is its
  counterpart, or none if it has none (an update of the owner's, dropped).
  """
  found = []
  for control in controls:
    if control not in made:
      found.append(control)
    elif _op_name(theirs, control) is not None:
      found.append(control.graph.get_operation_by_name(_op_name(theirs, control)))
  return found


def _op_name(theirs: Counterpart, op: tf.Operation) -> str | None:
  """The name of the counterpart of `op` (through its first output), or None."""
  if not op.outputs:
    return None
  found = theirs(op.outputs[0])
  return None if found is None else found.op.name


def _colocation_targets(op: tf.Operation) -> list:
  try:
    groups = op.get_attr('_class')
  except ValueError:
    return []
  return [op.graph.get_operation_by_name(g.decode()[len('loc:@'):]) for g in groups
          if g.startswith(b'loc:@')]


def _unsafe(op: tf.Operation) -> str | None:
  """Why `op` cannot be imported again as it is, or None."""
  if control_flow.in_control_flow(op):
    return f'{op.name} is inside a v1 tf.cond or tf.while_loop'
  if control_flow.calls_function(op):
    return loop_copies.why_not(op)
  if op.type in ('Placeholder', 'PlaceholderV2'):
    return f'the model_fn made a placeholder ({op.name})'
  try:
    shared = op.get_attr('shared_name')
  except ValueError:
    shared = b''
  if shared:
    return f'{op.name} is a stateful op with a shared name'
  if (op.op_def.is_stateful and any(t.dtype == tf.resource for t in op.outputs)
      and not any(t.dtype == tf.resource for t in op.inputs)):
    return (f'{op.name} ({op.type}) creates a resource (a lookup table, queue or '
            f'iterator) that only its own initializer fills')
  return None


def _graph_seeded(op: tf.Operation, graph: tf.Graph, seed_range: range) -> bool:
  """True if op's seeds came from the graph-level seed and the op seed counter."""
  if graph.seed is None:
    return False
  try:
    seed, seed2 = op.get_attr('seed'), op.get_attr('seed2')
  except ValueError:
    return False
  expected = tf.compat.v1.random.get_seed(0)[0]  # the graph-level seed, truncated
  if (seed, seed2) == (0, 2**31 - 1):  # get_seed's stand-in for (0, 0)
    seed2 = 0
  return seed == expected and seed2 in seed_range
