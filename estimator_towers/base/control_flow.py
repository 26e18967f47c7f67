"""Control flow and function graphs as TensorFlow keeps them: the private reads and writes.

Each exists because TensorFlow 2.15 offers no public hook for it. This module and
`interception` are the only ones that import TensorFlow's private API, so that an
upgrade has two files to check: `interception` wraps TensorFlow's functions while towers
are built; this module reads and sets the control flow of ops already built.

- Where an op is: inside a v1 `tf.cond` or `tf.while_loop` (`Operation._control_flow_context`),
  the innermost v1 loop being built and the iteration counter `maximum_iterations` adds
  (`WhileContext`), a functional loop's body being built (`WhileBodyFuncGraph`: its counter,
  and its loop variables' outer values from while_v2's `wrapped_body` frame tracing it), a
  `tf.cond` branch (`CondBranchFuncGraph`'s captures): keyed draws inside loops
  (`draws.loop_keys`), ordering and placement.
- The functions an op calls (`Graph._get_function`, in its graph or the graphs it is
  inside; `Graph._functions`): a functional `If`'s branches, a `While`'s condition and body,
  a call's function, read by the row reader (`rows`) and counted by `reporting.work_share`;
  every function body's nodes (`draws.step_order`).
- A tower's loops and their gradients placed (`Operation._set_attr`, `_set_device`): a
  gradient's `While` kept as a loop of its own (`_lower_using_switch_merge`), an op's
  colocation groups (`_class`) narrowed or cleared (`placement.strategies`).
- Loops a tower copy imports again (`towers.op_templates`): a function's FunctionDef read by
  name and new ones added to the graph (`function.from_library`), and a functional loop
  built with all its intermediates as outputs while tower 0 is built
  (`control_flow_util_v2`'s override, read and put back), so that its gradient does not
  rewrite it in place after its copies were made.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Iterator

import tensorflow as tf

from tensorflow.core.framework import function_pb2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import function as function_lib  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_util_v2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import control_flow_v2_func_graphs  # pylint: disable=g-direct-tensorflow-import


def cond_branch(graph: tf.Graph) -> tuple[tf.Graph, list] | None:
  """A `tf.cond` branch's graph: (the graph it is in, [(outer, inner) captures]); else None."""
  if not isinstance(graph, control_flow_v2_func_graphs.CondBranchFuncGraph):
    return None
  return graph.outer_graph, list(graph.captures)


_while_inputs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # body -> pairs


def while_body(graph: tf.Graph) -> tuple[tf.Tensor, list] | None:
  """A functional `tf.while_loop`'s body graph being built: (its iteration counter, [(outer,
  inner)] of its loop variables, read once from the `loop_vars` of while_v2's `wrapped_body`
  frame tracing it, and of its captured values); None for any other graph."""
  if not isinstance(graph, control_flow_v2_func_graphs.WhileBodyFuncGraph):
    return None
  if graph not in _while_inputs:
    frame, _while_inputs[graph] = sys._getframe(1), []  # pylint: disable=protected-access
    while frame is not None and not (
        frame.f_code.co_name == 'wrapped_body' and 'while_v2' in frame.f_code.co_filename
        and getattr(frame.f_locals.get('loop_counter'), 'graph', None) is graph):
      frame = frame.f_back
    if frame is not None:
      outer = frame.f_locals['loop_vars']
      flat = list(outer[:2]) + tf.nest.flatten(list(outer[2:]), expand_composites=True)
      _while_inputs[graph] = [(o, i) for o, i in zip(flat, graph.inputs)
                              if isinstance(o, tf.Tensor)]
  return graph.inputs[0], _while_inputs[graph] + [
      (o, i) for o, i in graph.captures if isinstance(o, tf.Tensor)]


def while_context(graph: tf.Graph, inside: Any = None) -> Any:
  """The innermost v1 `tf.while_loop` (its `WhileContext`) the ops built now are in (or, given
  `inside`, the one that v1 loop is nested in); None outside v1 loops."""
  context = graph._get_control_flow_context() if inside is None else inside.outer_context  # pylint: disable=protected-access
  while context is not None and not context.IsWhileContext():
    context = context.outer_context
  return context


def while_iteration(context: Any) -> tf.Tensor | None:
  """A v1 loop's iteration counter as its body reads it (0, 1, ...), where the loop has one:
  `tf.while_loop(..., maximum_iterations=n)` makes it its first loop variable (Enter, Merge,
  Switch, Identity of `iteration_counter`); None for a loop without one."""
  enters = context.loop_enters
  if not enters or not enters[0].op.inputs[0].op.name.split('/')[-1].startswith(
      'iteration_counter'):
    return None
  merges = [op for op in enters[0].consumers() if op.type == 'Merge']
  switches = [op for m in merges for op in m.outputs[0].consumers() if op.type == 'Switch']
  bodies = [op for s in switches for op in s.outputs[1].consumers() if op.type == 'Identity']
  return bodies[0].outputs[0] if bodies else None


def calls_function(op: tf.Operation) -> bool:
  """True if `op` calls a graph function (a functional If or While, a Defun's call op)."""
  if op.graph._get_function(op.type) is not None:  # pylint: disable=protected-access
    return True
  return any(value.WhichOneof('value') == 'func' or value.list.func
             for value in op.node_def.attr.values())


def in_control_flow(op: tf.Operation) -> bool:
  """True if `op` is inside a v1 `tf.cond` or `tf.while_loop`."""
  return op._control_flow_context is not None  # pylint: disable=protected-access


def function_nodes(graph: tf.Graph) -> Iterator[tuple[str, Any]]:
  """(function name, NodeDef) of every function body the graph holds (`Graph._functions`)."""
  for name, function in list(graph._functions.items()):  # pylint: disable=protected-access
    yield from ((name, node) for node in getattr(function.definition, 'node_def', ()))


def branch_graphs(op: tf.Operation) -> list | None:
  """The FuncGraphs of a functional `If`'s two branches (then, else), or None: found by
  name in the graph's function library (`Graph._get_function`), for `row_dependence`."""
  graphs = []
  for attr in ('then_branch', 'else_branch'):
    try:
      name = op.get_attr(attr).name
    except ValueError:
      return None
    function = op.graph._get_function(name)  # pylint: disable=protected-access
    graph = getattr(function, 'graph', None)
    if graph is None:
      return None
    graphs.append(graph)
  return graphs


def function_graphs(op: tf.Operation, attrs: tuple) -> list | None:
  """The FuncGraphs of the functions `op` names in `attrs` (a `While`'s 'cond' and 'body', a
  call's 'f'), or None: found by name in the graph's function library (`Graph._get_function`,
  in the graph of `op` or the graphs it is inside), for `row_dependence`."""
  graphs = []
  for attr in attrs:
    try:
      name = op.get_attr(attr).name
    except ValueError:
      return None
    graph, function = op.graph, None
    while graph is not None and function is None:
      function = graph._get_function(name)  # pylint: disable=protected-access
      graph = getattr(graph, 'outer_graph', None)
    if getattr(function, 'graph', None) is None:
      return None
    graphs.append(function.graph)
  return graphs


def function_def(graph: tf.Graph, name: str) -> Any:
  """The FunctionDef of function `name` in `graph`'s library, or None."""
  function = graph._get_function(name)  # pylint: disable=protected-access
  return None if function is None else function.definition


def has_function(graph: tf.Graph, name: str) -> bool:
  """True if `graph`'s library holds a function `name`."""
  return graph._get_function(name) is not None  # pylint: disable=protected-access


def add_functions(graph: tf.Graph, function_defs: list) -> None:
  """`function_defs` added to `graph`'s library (a name it holds already is left as it is)."""
  library = function_pb2.FunctionDefLibrary()
  library.function.extend(f for f in function_defs
                          if graph._get_function(f.signature.name) is None)  # pylint: disable=protected-access
  for function in function_lib.from_library(library):
    function.add_to_graph(graph)


@contextlib.contextmanager
def loops_with_all_intermediates() -> Iterator[None]:
  """Functional loops built in the block output every intermediate their gradient may need
  (`tf.compat.v1.experimental.output_all_intermediates`), as Keras has them in graph mode:
  differentiating one then adds a gradient loop without rewriting the loop itself."""
  saved = control_flow_util_v2._EXPERIMENTAL_OUTPUT_ALL_INTERMEDIATES_OVERRIDE  # pylint: disable=protected-access
  tf.compat.v1.experimental.output_all_intermediates(True)
  try:
    yield
  finally:
    control_flow_util_v2._EXPERIMENTAL_OUTPUT_ALL_INTERMEDIATES_OVERRIDE = saved  # pylint: disable=protected-access


def keep_loop(op: tf.Operation) -> None:
  """`op` (a While loop, built) runs as a loop of its own, its body not inlined into the graph
  (its attribute `_lower_using_switch_merge`): the gradient loops of a tower's loops, whose
  inlined copies would share their ops' colocation groups, which name ops inside them,
  across devices. (A forward loop is inlined, as on one device: while_v2 sets the attribute
  itself once the loop is built.)"""
  op._set_attr('_lower_using_switch_merge', tf.compat.v1.AttrValue(b=False))  # pylint: disable=protected-access


def colocate_only(op: tf.Operation, groups: list) -> None:
  """`op` (an op already built) in the colocation `groups` (b'loc:@name') only."""
  op._set_attr('_class', tf.compat.v1.AttrValue(  # pylint: disable=protected-access
      list=tf.compat.v1.AttrValue.ListValue(s=list(groups))))


def place_alone(op: tf.Operation, device: str) -> None:
  """`op` (an op already built) runs on `device`, in no other op's colocation group
  (`Operation._set_device`, its '_class' attribute): a gradient loop built colocated with a
  forward loop left unpinned."""
  op._set_device(device)  # pylint: disable=protected-access
  op._set_attr('_class', tf.compat.v1.AttrValue(  # pylint: disable=protected-access
      list=tf.compat.v1.AttrValue.ListValue(s=[b'loc:@' + op.name.encode()])))
