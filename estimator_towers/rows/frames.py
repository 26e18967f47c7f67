"""Frames: the loops of control flow v1 (`disable_v2_behavior()`), read like a While's body.

The rule. A v1 `tf.while_loop` is a frame of ops in the graph: its values enter
(`Enter`), each loop-carried value meets its next step's at a `Merge` (the back edge a
`NextIteration`), a `Switch` by the condition (`LoopCond`) passes it to the body or
out (`Exit`). The reader visits them in graph order, a `Merge` before its body: it takes
the kind its value enters with, and at the `NextIteration` the body's value is joined in
(`loops.join`); where that changes the `Merge`'s kind, the frame's ops read so far are read
again with it, until the kinds settle (a fixed point, as `loops` reads a While). At an
`Exit`, the condition's kind says how many steps ran, as for a While (`loops`): of no
input of the shard, the settled kind; of the batch size, values the body changes are such
values, a list of the batch's examples written at the step's index stays one, and rows
mix; the batch's longest length only where each example's rows are copied through past
its own length. TensorArrays (`TensorArrayV3` and its reads, writes, scatters, gathers)
are lists whose kind rides on their flow tensor; the handle is no value of the batch.
"""

from __future__ import annotations

import tensorflow as tf

from estimator_towers.rows import loops
from estimator_towers.rows.kinds import (BOUND, COLS, EXAMPLE, LIST, ROWS, SIZE, SHAPE, STAT,
                                         SIZE_KIND, STAT_KIND, Kind)

_ROUNDS = 8
_LOOP_OPS = frozenset(('Enter', 'RefEnter', 'Exit', 'RefExit', 'NextIteration',
                       'RefNextIteration', 'LoopCond'))


def applies(op: tf.Operation) -> bool:
  """Whether `rule` reads `op`: an op of a v1 loop's frame, or a TensorArray's."""
  t = op.type
  return t in _LOOP_OPS or t in RULES or (
      t in ('Merge', 'RefMerge') and _back_edge(op) is not None) or (
          t in ('Switch', 'RefSwitch') and op.inputs[1].op.type == 'LoopCond')


def _back_edge(merge: tf.Operation):
  for t in merge.inputs:
    if t.op.type in ('NextIteration', 'RefNextIteration'):
      return t.op
  return None


def rule(reader, op: tf.Operation, kinds: list):
  """The kinds of `op`'s outputs (a Kind, a list, or a str: why it mixes)."""
  t = op.type
  if t in RULES:
    return RULES[t](reader, op, kinds)
  if t in ('Enter', 'RefEnter', 'LoopCond'):
    return kinds[0]
  if t in ('Merge', 'RefMerge'):
    settled = reader.loops.get(op.name)
    start = kinds[0] if settled is None else settled[0]
    reader.loops[op.name] = (start, len(reader.mixing), len(reader.frontier))
    return [start, None]
  if t in ('Switch', 'RefSwitch'):   # out of the loop (to its Exit), into the body
    out = _exit(reader, op, kinds[0])
    return out if isinstance(out, str) else [out, kinds[0]]
  if t in ('NextIteration', 'RefNextIteration'):
    return _next_iteration(reader, op, kinds[0])
  return kinds[0]   # Exit: its Switch's value out of the loop


def _next_iteration(reader, op, kind):
  """The back edge: the body's value joined into its `Merge`'s, the frame read again where
  that changes it."""
  merge = [c for c in op.outputs[0].consumers() if c.type in ('Merge', 'RefMerge')]
  if len(merge) != 1:
    return kind
  merge = merge[0]
  if merge.name not in reader.loops:   # it entered with a value of no input of the shard
    order = _order(merge.graph)
    mixing = [i for i, m in enumerate(reader.mixing) if order[m.op.name] >= order[merge.name]]
    reader.loops[merge.name] = (None, mixing[0] if mixing else len(reader.mixing),
                                len(reader.frontier))
  for _ in range(_ROUNDS):
    start, mixing, frontier = reader.loops[merge.name]
    if kind is not None and kind.tag == EXAMPLE:
      return 'a loop-carried value made from one example\'s values (the next step\'s)'
    joined = loops.join(start, kind)
    if isinstance(joined, str) or joined == start:
      return joined if isinstance(joined, str) else kind
    reader.loops[merge.name] = (joined, mixing, frontier)
    kind = _read_again(reader, merge, op, mixing, frontier)
  return 'a while loop whose carried values do not settle'


def _read_again(reader, merge, back, mixing, frontier):
  """The frame's ops from `merge` to `back` read again; the body's value at `back`."""
  names = [o.name for o in reader.order]
  if merge.name not in names:
    return reader.kind(back.inputs[0])
  first, last = names.index(merge.name), len(names) - 1 - names[::-1].index(back.name)
  again = reader.order[first:last]
  del reader.order[first:]
  for o in again:
    for t in o.outputs:
      reader.kinds.pop(t.name, None)
  del reader.mixing[mixing:]
  for t in reader.frontier[frontier:]:
    reader.forget_frontier(t)
  for o in again:
    settled = reader.loops.get(o.name) if o.type in ('Merge', 'RefMerge') else None
    if settled is not None and settled[0] is not None:
      reader.order.append(o)
      reader.kinds[o.outputs[0].name] = settled[0]   # its value's kind so far
    else:
      reader.visit(o)
  reader.order.append(back)
  return reader.kind(back.inputs[0])


def _order(graph):
  return {o.name: i for i, o in enumerate(graph.get_operations())}


def _exit(reader, switch, kind):
  """A value out of the loop, given how many steps ran (its condition's kind)."""
  steps = reader.kind(switch.inputs[1])
  if steps is None or kind is None and steps.tag == BOUND:
    return kind
  merge = switch.inputs[0].op
  back = _back_edge(merge) if merge.type in ('Merge', 'RefMerge') else None
  changed = back is None or not _passed_through(back.inputs[0], switch)
  if steps.tag == BOUND:
    if not changed or (kind.tag == ROWS and _copied_through(back.inputs[0], steps, switch)) or (
        kind.tag == LIST and kind.of == ROWS and _written_through(back.inputs[0], steps)):
      return kind
    return ('a while loop run up to the batch\'s longest length that changes an example\'s '
            'values past its own length')
  if steps.tag not in (SIZE, SHAPE, STAT):
    return f'a while loop whose number of steps depends on {steps.tag} of the batch'
  if not changed:
    return kind
  if kind is None or kind.tag in (SIZE, SHAPE) and steps.tag != STAT:
    return STAT_KIND if steps.tag == STAT else SIZE_KIND
  if kind.tag == LIST and kind.of == EXAMPLE and steps.tag != STAT:
    return kind
  what = 'the batch size' if steps.tag != STAT else 'a statistic of the batch'
  return (f'a while loop whose number of steps depends on {what}, of values of the batch it '
          f'changes at each step ({kind.tag})')


def _passed_through(t, switch) -> bool:
  while t.op.type == 'Identity':
    t = t.op.inputs[0]
  return t is switch.outputs[1]


def _lengths(t, steps) -> bool:
  while t.op.type in ('Identity', 'Enter', 'Cast', 'RefEnter'):
    t = t.op.inputs[0]
  return t.name == steps.index


def _copied_through(t, steps, switch) -> bool:
  """`t` is `Select(time >= length, old, new)`: the step's value copied through past an
  example's own length (`old` this loop variable's value at the step, or zeros)."""
  while t.op.type == 'Identity':
    t = t.op.inputs[0]
  if t.op.type not in ('Select', 'SelectV2'):
    return False
  condition, then = t.op.inputs[0], t.op.inputs[1]
  if condition.op.type != 'GreaterEqual' or not _lengths(condition.op.inputs[1], steps):
    return False
  return switch is None and _zeros(then) or switch is not None and _passed_through(then, switch)


def _zeros(t) -> bool:
  while t.op.type in ('Identity', 'Enter', 'RefEnter'):
    t = t.op.inputs[0]
  return loops.zeros(t)


def _written_through(flow, steps) -> bool:
  """A TensorArray's flow written at each step with a value copied through (zeros past an
  example's own length)."""
  while flow.op.type == 'Identity':
    flow = flow.op.inputs[0]
  return flow.op.type == 'TensorArrayWriteV3' and _copied_through(flow.op.inputs[2], steps, None)


# --- TensorArrays (control flow v1): the list's kind on its flow ------------------------

def _array(reader, op, kinds):
  size = kinds[0]
  if size is None:
    return None
  if size.tag == SIZE and loops.batch_size(reader, op.inputs[0]):
    return [None, loops.list_of(Kind(EXAMPLE))]   # as many elements as examples
  return 'a TensorArray of a size computed from the batch'


def _scatter(reader, op, kinds):
  indices, value, flow = kinds[1], kinds[2], kinds[3]
  if indices is not None and indices.tag not in (SIZE, SHAPE):
    return 'a TensorArray scattered at indices computed from the batch'
  if value is None:
    return flow
  if value.tag == ROWS and value.blocks == 1:
    return loops.join(flow, loops.list_of(Kind(EXAMPLE)))
  if value.tag == COLS:
    return loops.join(flow, loops.list_of(Kind(ROWS)))
  return f'a TensorArray of the elements of values that are not rows ({value.tag})'


def _read(reader, op, kinds):
  index, flow = kinds[1], kinds[2]
  if index is not None:
    return 'an element of a TensorArray picked by a value of the batch'
  if flow is None:
    return None
  if flow.tag != LIST:
    return f'a TensorArray op on values that are not a list ({flow.tag})'
  element = loops.element_of(flow)
  return Kind(EXAMPLE, index=_index(op.inputs[1])) if element.tag == EXAMPLE else element


def _index(t):
  while t.op.type in ('Identity',):
    t = t.op.inputs[0]
  return t.name


def _write(reader, op, kinds):
  index, value, flow = kinds[1], kinds[2], kinds[3]
  if index is not None:
    return 'a TensorArray written at an index computed from the batch'
  if value is not None and value.tag == EXAMPLE:
    if value.index != _index(op.inputs[1]):
      return 'one example\'s values written at another index of a TensorArray'
    return loops.join(flow, loops.list_of(Kind(EXAMPLE)))
  if flow is not None and flow.of == EXAMPLE and value is None:
    return flow
  return loops.join(flow, loops.list_of(value))


def _gather(reader, op, kinds):
  indices, flow = kinds[1], kinds[2]
  if flow is None:
    return None
  if indices is not None and indices.tag not in (SIZE, SHAPE):
    return 'a gather from a TensorArray by values of the batch'
  if flow.tag != LIST:
    return f'a TensorArray op on values that are not a list ({flow.tag})'
  return loops.stacked(flow)


def _size(reader, op, kinds):
  flow = kinds[1]
  return SIZE_KIND if flow is not None and flow.tag == LIST and flow.of == EXAMPLE else None


RULES = {'TensorArrayV3': _array, 'TensorArrayScatterV3': _scatter,
         'TensorArrayReadV3': _read, 'TensorArrayWriteV3': _write,
         'TensorArrayGatherV3': _gather, 'TensorArraySizeV3': _size}
