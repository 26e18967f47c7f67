"""Loop copies: a tower copy's functional loops call copies of tower 0's loop functions.

A functional `While` loop (control flow v2: `tf.while_loop`, `dynamic_rnn`, `tf.scan`,
`tf.map_fn`, and the gradient loop TensorFlow builds for each) calls its condition and
body by name, and tower 0's functions put their ops on tower 0's device. A tower copy
of such a loop calls copies of them, and of every function they call, named for the
copy, with each op that was on tower 0's device on the copy's device (any other device
kept): what building the loop again on the copy's device gives, without tracing its
body and its gradient's body again (most of a recurrent tower's construction time).

A loop is copied only where that is what building it would give: its functions draw
no seeded random number (a built tower's loop would draw with seeds of its own; keyed
draws are stateless), and tower 0's loop is still the one copied (`stale`): TensorFlow's
gradient of a loop rewrites it in place to output the intermediates it needs unless the
loop outputs them all already, which the towers ask for while tower 0 is built
(`control_flow.loops_with_all_intermediates`).
"""

from __future__ import annotations

import re

import tensorflow as tf

from estimator_towers.base import control_flow
from estimator_towers.placement import strategies as placement_lib

LOOPS = placement_lib.LOOP_OPS
_FUNCTION_ATTRS = ('cond', 'body')


def why_not(op: tf.Operation) -> str | None:
  """Why a function-calling `op` cannot be copied, or None for a loop (whose functions
  `called_by` checks)."""
  if op.type not in LOOPS:
    return (f'{op.name} calls a function (a tf.cond or tf.function in graph mode, or a v1 '
            f'loop\'s)')
  return None


def stale(op: tf.Operation, node_def) -> bool:
  """True if loop `op` no longer calls the functions its template's `node_def` names."""
  return any(op.node_def.attr[a].func.name != node_def.attr[a].func.name
             for a in _FUNCTION_ATTRS if a in node_def.attr)


def closure(graph: tf.Graph, names: set) -> dict | None:
  """The FunctionDefs of `names` and of every function they call, by name; None if one is
  not in `graph`'s library."""
  found, pending = {}, list(names)
  while pending:
    name = pending.pop()
    if name in found:
      continue
    function = control_flow.function_def(graph, name)
    if function is None:
      return None
    found[name] = function
    for node in function.node_def:
      pending.extend(_called(node, graph) - set(found))
  return found


def called_by(graph: tf.Graph, loops: list) -> dict | str:
  """The FunctionDefs `loops` (loop ops) call, and those they call, by name; or why the
  loops cannot be copied (a function not in the graph's library, a seeded draw)."""
  names = set()
  for op in loops:
    names |= _called(op.node_def, graph)
  functions = closure(graph, names)
  if functions is None:
    return f'{loops[0].name} is a loop whose functions are not all in the graph\'s library'
  for name, function in functions.items():
    for node in function.node_def:
      if 'seed2' in node.attr and (node.attr['seed'].i or node.attr['seed2'].i):
        return (f'the loop function {name} draws seeded random numbers '
                f'({node.op} {node.name})')
  return functions


def copies(functions: dict, suffix: str, home: str, device: str) -> tuple[dict, list]:
  """(new name by old, the new FunctionDefs) of `functions` (`called_by`'s), for a copy on
  `device` of a tower on `home`."""
  tag = re.sub(r'[^A-Za-z0-9_]', '_', suffix)
  renamed = {name: f'{name}_{tag}' for name in functions}
  home_spec = tf.DeviceSpec.from_string(home)
  specs = {}
  made = []
  for name, function in functions.items():
    copy = type(function)()
    copy.CopyFrom(function)
    copy.signature.name = renamed[name]
    for node in copy.node_def:
      if node.device:
        if node.device not in specs:
          specs[node.device] = tf.DeviceSpec.from_string(node.device) == home_spec
        if specs[node.device]:
          node.device = device
      rename(node, renamed)
    made.append(copy)
  return renamed, made


def rename(node, renamed: dict) -> None:
  """`node` (a NodeDef) calls the functions of `renamed` by their new names."""
  if node.op in renamed:
    node.op = renamed[node.op]
  for value in node.attr.values():
    if value.WhichOneof('value') == 'func' and value.func.name in renamed:
      value.func.name = renamed[value.func.name]
    for func in value.list.func:
      if func.name in renamed:
        func.name = renamed[func.name]


def _called(node, graph: tf.Graph) -> set:
  """The names of the functions a NodeDef calls (its function attributes, or its op)."""
  names = set()
  for value in node.attr.values():
    if value.WhichOneof('value') == 'func':
      names.add(value.func.name)
    names.update(f.name for f in value.list.func)
  if control_flow.has_function(graph, node.op):
    names.add(node.op)
  return names
