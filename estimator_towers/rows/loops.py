"""Loops: a while loop's body read like the rest, and the lists it reads and writes.

The rule. A functional `While` (control flow v2: `tf.while_loop`, `dynamic_rnn`,
`tf.scan`, `tf.map_fn`, Keras' recurrent layers) keeps each example's rows where its body
does: the body's function graph is read with its loop-carried values of the kinds they
enter with, and again with the kinds it gives back joined in, until they settle (a fixed
point: a value that does not depend on the batch joined with one of a kind is of that
kind; two different kinds mix). Its condition decides how many steps run: a value that
does not depend on the batch leaves the settled kinds as they are; one of the batch size
(`tf.map_fn`'s loop over the examples) or of a statistic makes every value the body
changes such a value, and mixes rows it changes, but a list of the batch's examples
written at the step's index; the batch's longest length (`dynamic_rnn`'s
`max(sequence_length)`) is a loop bound only where each example's values the body
changes are copied through past that example's own length (`Select(time >= length,
old, new)`, its outputs zeros there), so that the steps the longest example adds do not
change the others'.

Lists (`TensorList*` ops, TensorArrays of control flow v2) are of the kind of their
elements: unstacking a time-major tensor (`COLS`, the batch on axis 1) gives a list
of rows, one per step, stacking it the time-major tensor again; unstacking rows gives
the list of the batch's examples (`tf.map_fn`), of which a step reads one example's
values (`EXAMPLE`) by its index: anything computed from them alone is that example's,
written back at the same index it is the list of examples again, which stacks to rows;
they combined with the batch's other values, or carried to the next step, mix. A list
of as many elements as examples is such a list. `ReverseSequence` of rows along
another axis reverses each example's own steps (`bidirectional_dynamic_rnn`).

A function call (`PartitionedCall`, `StatefulPartitionedCall`: a `tf.function` called in
graph mode) is its function's graph read like the rest, with the call's inputs' kinds.
Control flow v1 (`Enter`, `Merge`, `Switch`, `NextIteration`, `Exit`, `TensorArrayV3`):
`frames`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from estimator_towers.base import control_flow
from estimator_towers.rows.kinds import (BOUND, COLS, COLS_KIND, COLS_SHAPE, EXAMPLE, LIST,
                                         ROWS, ROWS_KIND, SHAPE, SIZE, SIZE_KIND, STAT,
                                         STAT_KIND, Kind)
from estimator_towers.rows.op_tables import ARITHMETIC
from estimator_towers.rows.sizes import batch_multiple
from estimator_towers.rows.static_values import static_value

TAGS = frozenset((LIST, EXAMPLE, BOUND, COLS_SHAPE))
_ROUNDS = 8
_KEEPS = frozenset(('Identity', 'Snapshot', 'StopGradient', 'Cast', 'EnsureShape'))
_BOUND_OPS = ARITHMETIC | frozenset(('LogicalAnd', 'Less', 'LessEqual', 'Greater',
                                     'GreaterEqual', 'Maximum', 'Minimum'))


def list_of(element: Kind | None) -> Kind | None:
  """A list whose elements are of kind `element` (None: of values of no input of the shard)."""
  if element is None:
    return None
  return Kind(LIST, element.blocks, element.norm, of=element.tag, per=element.per,
              index=element.index)


def element_of(kind: Kind) -> Kind:
  return Kind(kind.of, kind.blocks, kind.norm, per=kind.per, index=kind.index)


def applies(op: tf.Operation, kinds: list) -> bool:
  """Whether `rule` reads `op`: a loop or list op, a value of a loop's kinds, a loop bound."""
  return op.type in RULES or any(k is not None and k.tag in TAGS for k in kinds) or (
      op.type == 'Max' and _is_bound(op, kinds))


def rule(reader, op: tf.Operation, kinds: list):
  """The kinds of `op`'s outputs (a Kind, a list of Kinds, or a str: why it mixes)."""
  t = op.type
  present = [k for k in kinds if k is not None]
  if t in RULES:
    return RULES[t](reader, op, kinds)
  if t == 'Max' and _is_bound(op, kinds):
    return Kind(BOUND, index=_source(op.inputs[0]).name)
  tags = {k.tag for k in present}
  if tags == {EXAMPLE}:
    if len({k.index for k in present}) > 1:
      return 'values of different examples combined (read at different steps of a loop)'
    return present[0] if t != 'IdentityN' else [present[0] if k else None for k in kinds]
  if EXAMPLE in tags:
    return 'one example\'s values (read by a loop over the examples) combined with the batch\'s'
  if tags == {BOUND} and t in _BOUND_OPS and len({k.index for k in present}) == 1:
    return present[0]
  if BOUND in tags:
    return 'the batch\'s longest length (a max over the batch) used other than as a loop\'s bound'
  if tags == {COLS_SHAPE}:
    return _cols_shape(op, kinds)
  if tags == {LIST} and t in _KEEPS and len(present) == 1:
    return present[0]
  if t == 'IdentityN':
    return [k for k in kinds]
  return f'an op on a list of the batch\'s values the library does not follow ({t})'


def _cols_shape(op, kinds):
  """The shape of time-major values [T, n, ...]: its element 1 is the batch size."""
  if op.type in _KEEPS:
    return kinds[0]
  if op.type == 'StridedSlice' and all(k is None for k in kinds[1:]) and (
      op.get_attr('shrink_axis_mask') == 1) and not op.get_attr('ellipsis_mask'):
    begin = static_value(op.inputs[1])
    if begin is not None and begin.size == 1:
      return SIZE_KIND if int(begin[0]) == 1 else None
  return SIZE_KIND   # a value computed from the batch size


def _source(t: tf.Tensor) -> tf.Tensor:
  """`t` behind copies and casts (the tensor a length or a bound was made from)."""
  while t.op.type in _KEEPS:
    t = t.op.inputs[0]
  return t


def _is_bound(op: tf.Operation, kinds: list) -> bool:
  """A max over the batch of each example's own length ([n] integers) that feeds only loops'
  bounds (through maxima, minima, copies): `dynamic_rnn`'s `max(sequence_length)`."""
  if not kinds or kinds[0] is None or kinds[0].tag != ROWS or kinds[0].blocks != 1 or (
      not op.inputs[0].dtype.is_integer) or op.inputs[0].shape.rank != 1:
    return False
  pending, seen = [op.outputs[0]], set()
  while pending:
    t = pending.pop()
    if t.name in seen:
      continue
    seen.add(t.name)
    consumers = t.consumers()
    if not consumers:
      return False
    for c in consumers:
      if c.type in ('While', 'StatelessWhile', 'Enter'):
        continue
      if c.type not in _KEEPS | {'Maximum', 'Minimum'}:
        return False
      pending.extend(c.outputs)
  return True


# --- Lists: TensorList ops ------------------------------------------------------------

def _from_tensor(reader, op, kinds):
  x = kinds[0]
  if x is None:
    return None
  if x.tag == ROWS and x.blocks == 1:
    return list_of(Kind(EXAMPLE))   # the batch's examples, one per element
  if x.tag == COLS:
    return list_of(ROWS_KIND)       # time-major: one step of every example per element
  if x.tag in (STAT, SIZE):
    return list_of(x)
  return f'a list of the elements of values that are not rows ({x.tag})'


def _empty(reader, op, kinds):
  """An empty list holds no value of the batch, whatever its elements' shape: its kind is
  what is pushed onto it (a gradient's record of a loop's steps, as long as its steps)."""
  return None


def _reserve(reader, op, kinds):
  shape, count = kinds[0], kinds[1] if len(kinds) > 1 else None
  if count is not None:
    if count.tag == SIZE and shape is None and batch_size(reader, op.inputs[1]):
      return list_of(Kind(EXAMPLE))   # as many elements as examples
    return 'a list of a number of elements computed from the batch'
  if shape is None:
    return None
  if shape.tag == SHAPE and shape.layout is None and shape.blocks == 1:
    return list_of(ROWS_KIND)         # elements of the rows' shape
  return 'a list of elements shaped by the batch other than as rows'


def batch_size(reader, t) -> bool:
  """Whether `t` is the shard's number of examples."""
  return batch_multiple(reader, t) == 1


def _get_item(reader, op, kinds):
  items, index = kinds[0], kinds[1]
  if index is not None:
    return 'an element of a list picked by a value of the batch'
  if items is None:
    return None
  if items.tag != LIST:
    return f'a list op on values that are not a list ({items.tag})'
  element = element_of(items)
  if element.tag == EXAMPLE:
    return Kind(EXAMPLE, index=op.inputs[1].name)   # the example of this step's index
  return element


def _set_item(reader, op, kinds):
  items, index, value = kinds[0], kinds[1], kinds[2]
  if index is not None:
    return 'a list written at an index computed from the batch'
  if value is not None and value.tag == EXAMPLE:
    if value.index != op.inputs[1].name:
      return 'one example\'s values written at another index of a list'
    value = Kind(EXAMPLE)
    if items is not None and items != list_of(value):
      return 'one example\'s values written into a list of other values'
    return list_of(value)
  if items is not None and items.of == EXAMPLE and value is None:
    return items   # a value of no input written for an example
  return join(items, list_of(value))


def _push_back(reader, op, kinds):
  items, value = kinds[0], kinds[1]
  if value is not None and value.tag == EXAMPLE:
    value = Kind(EXAMPLE)   # a step's example, in the order of the steps (a gradient's record)
  return join(items, list_of(value))


def _pop_back(reader, op, kinds):
  items = kinds[0]
  if items is None:
    return None
  if items.tag != LIST or any(k is not None for k in kinds[1:]):
    return 'a list op on values that are not a list'
  return [items, element_of(items) if items.of != EXAMPLE else 'one example popped from a list']


def _stack(reader, op, kinds):
  items = kinds[0]
  if items is None:
    return None
  if items.tag != LIST:
    return f'a list op on values that are not a list ({items.tag})'
  if op.type == 'TensorListGather' and kinds[1] is not None:
    return 'a gather from a list by values of the batch'
  return stacked(items, op.type == 'TensorListGather')


def stacked(items: Kind, gathered: bool = False):
  """The kind of a list's elements stacked on a new axis 0."""
  if items.of == EXAMPLE and not gathered:
    return ROWS_KIND
  if items.of == ROWS and items.blocks == 1:
    return COLS_KIND
  if items.of in (STAT, SIZE):
    return Kind(items.of, norm=items.norm)
  return f'a list of elements of kind {items.of} stacked'


def _length(reader, op, kinds):
  items = kinds[0]
  return SIZE_KIND if items is not None and items.of == EXAMPLE else None


def _element_shape(reader, op, kinds):
  items = kinds[0]
  if items is None or items.of == EXAMPLE:
    return None
  return Kind(SHAPE) if items.of == ROWS else SIZE_KIND


def _reverse_sequence(reader, op, kinds):
  """`tf.reverse_sequence`: each example's first `lengths[i]` steps reversed."""
  x, lengths = kinds[0], kinds[1]
  batch_axis = op.get_attr('batch_dim')
  seq_axis = op.get_attr('seq_dim')
  if x is None or lengths is None or lengths.tag != ROWS or lengths.blocks != 1:
    return 'a reverse of sequences of lengths that are not each example\'s own'
  if x.tag == ROWS and x.blocks == 1 and batch_axis == 0 and seq_axis != 0:
    return ROWS_KIND
  if x.tag == COLS and batch_axis == 1 and seq_axis != 1:
    return COLS_KIND
  return 'a reverse of sequences along the batch axis'


# --- While loops -----------------------------------------------------------------------

def join(a: Kind | None, b: Kind | None):
  """The kind of a value that is of kind `a` or of kind `b` (a loop-carried value's)."""
  if a is None or a == b:
    return b
  if b is None:
    return a
  if a.tag == LIST and b.tag == LIST and a.of == EXAMPLE and b.of == EXAMPLE:
    return a
  return f'a loop-carried value of the batch that changes kind ({a.tag}, then {b.tag})'


def _while(reader, op, kinds):
  graphs = control_flow.function_graphs(op, ('cond', 'body'))
  if graphs is None:
    return 'a while loop whose body the library cannot find'
  cond, body = graphs
  if not len(body.inputs) == len(body.outputs) == len(op.inputs) == len(cond.inputs):
    return 'a while loop whose body the library cannot read'
  carried, inner = list(kinds), None
  for _ in range(_ROUNDS):
    inner = _read_graph(reader, body, carried, body.outputs)
    if isinstance(inner, str):
      return f'a while loop whose body has {inner}'
    after = [inner.kind(o) for o in body.outputs]
    for k in after:
      if k is not None and k.tag == EXAMPLE:
        return 'a loop-carried value made from one example\'s values (the next step\'s)'
    joined = [join(a, b) for a, b in zip(carried, after)]
    for k in joined:
      if isinstance(k, str):
        return k
    if joined == carried:
      break
    carried = joined
  else:
    return 'a while loop whose carried values do not settle'
  steps = _read_graph(reader, cond, carried, cond.outputs[:1])
  if isinstance(steps, str):
    return f'a while loop whose condition has {steps}'
  return _after(op, body, carried, steps.kind(cond.outputs[0]))


def _read_graph(reader, graph, kinds, outputs):
  """The reader of `graph` (a function's) from its inputs of `kinds` to `outputs`, or why it
  mixes."""
  given = {t.name: k for t, k in zip(graph.inputs, kinds) if k is not None}
  found = reader.inner(list(outputs), given)
  if found.mixing:
    return found.mixing[0].describe()
  return found


def _changed(body) -> list:
  """For each loop-carried value, whether the body gives back another value."""
  result = []
  for i, o in zip(body.inputs, body.outputs):
    while o.op.type == 'Identity' and o is not i:
      o = o.op.inputs[0]
    result.append(o is not i)
  return result


def _records(op, body) -> list:
  """For each loop-carried value, whether it is a record of the steps for the gradient: a
  list the body pushes a value onto, which only gradient loops read (or nothing yet)."""
  result = []
  for o, out in zip(body.outputs, op.outputs):
    while o.op.type == 'Identity':
      o = o.op.inputs[0]
    result.append(o.op.type == 'TensorListPushBack' and all(
        c.type in ('While', 'StatelessWhile', 'ZerosLike') and c is not op
        for c in _readers(out)))   # ZerosLike: tf.gradients' zero gradient of an output
  return result


def _readers(t) -> list:
  """The ops that read `t`, through the Identity ops a functional loop puts on its outputs
  (a loop built with all its intermediates as outputs: its records' readers)."""
  found, pending = [], list(t.consumers())
  while pending:
    c = pending.pop()
    if c.type == 'Identity':
      pending.extend(c.outputs[0].consumers())
    else:
      found.append(c)
  return found


def _after(op, body, carried, steps):
  """The kinds of a loop's outputs, given how many steps it runs (`steps`' kind)."""
  if steps is None:
    return carried
  # The gradient's records run the same steps backward, each example's alone.
  changed = [c and not r for c, r in zip(_changed(body), _records(op, body))]
  if steps.tag == BOUND:
    return _bounded(op, body, carried, changed, steps)
  if steps.tag not in (SIZE, SHAPE, STAT):
    return f'a while loop whose number of steps depends on {steps.tag} of the batch'
  result = []
  for kind, change in zip(carried, changed):
    if not change:
      result.append(kind)
    elif kind is None or kind.tag in (SIZE, SHAPE) and steps.tag != STAT:
      result.append(STAT_KIND if steps.tag == STAT else SIZE_KIND)
    elif kind.tag == LIST and kind.of == EXAMPLE and steps.tag != STAT:
      result.append(kind)   # one step per example, each written at its own index
    else:
      what = 'the batch size' if steps.tag != STAT else 'a statistic of the batch'
      return (f'a while loop whose number of steps depends on {what}, of values of the batch '
              f'it changes at each step ({kind.tag})')
  return result


def _bounded(op, body, carried, changed, bound):
  """A loop run up to the batch's longest length: each example's values copied through past
  its own length, else it mixes (see the module doc)."""
  outer = {i.name: o for i, o in zip(body.inputs, op.inputs)}
  lengths = {i.name for i, o in zip(body.inputs, op.inputs) if _source(o).name == bound.index}
  why = ('a while loop run up to the batch\'s longest length that changes an example\'s '
         'values past its own length')
  for i, o, kind, change in zip(body.inputs, body.outputs, carried, changed):
    if not change or kind is None:
      continue
    if kind.tag == ROWS and not _copied_through(o, lengths, lambda t, i=i: t is i):
      return why
    if kind.tag == LIST and kind.of == ROWS:
      while o.op.type == 'Identity':
        o = o.op.inputs[0]
      if o.op.type != 'TensorListSetItem' or not _copied_through(
          o.op.inputs[2], lengths, lambda t: zeros(outer.get(t.name, t))):
        return why
    elif kind.tag not in (ROWS, LIST):
      return why
  return carried


def _copied_through(t, lengths, old) -> bool:
  """`t` is `Select(time >= length, old, new)`, `length` each example's own (`lengths`)."""
  while t.op.type == 'Identity':
    t = t.op.inputs[0]
  if t.op.type not in ('Select', 'SelectV2'):
    return False
  condition, then = t.op.inputs[0], t.op.inputs[1]
  return (condition.op.type == 'GreaterEqual' and _source(condition.op.inputs[1]).name in lengths
          and old(_source(then)))


def zeros(t) -> bool:
  """Whether every element of `t` is zero by construction."""
  value = static_value(t)
  if value is not None:
    return not np.any(value)
  if t.op.type == 'Fill':
    fill = static_value(t.op.inputs[1])
    return fill is not None and not np.any(fill)
  return t.op.type == 'ZerosLike'


def _call(reader, op, kinds):
  """A function call (`tf.function` in graph mode): its body read like the rest."""
  graphs = control_flow.function_graphs(op, ('f',))
  if graphs is None or len(graphs[0].inputs) != len(op.inputs) or (
      len(graphs[0].outputs) != len(op.outputs)):
    return 'a function call the library cannot see inside, fed by the batch\'s rows'
  body = graphs[0]
  inner = _read_graph(reader, body, kinds, [t for t in body.outputs if t is not None])
  if isinstance(inner, str):
    return f'a function call whose body has {inner}'
  return [None if t is None else inner.kind(t) for t in body.outputs]


# Op type -> the reader of its kinds (reader, op, kinds): `rule`'s dispatch.
RULES = {'TensorListFromTensor': _from_tensor, 'TensorListReserve': _reserve,
         'EmptyTensorList': _empty, 'TensorListGetItem': _get_item,
         'TensorListSetItem': _set_item, 'TensorListPushBack': _push_back,
         'TensorListPopBack': _pop_back, 'TensorListStack': _stack,
         'TensorListGather': _stack, 'TensorListLength': _length,
         'TensorListElementShape': _element_shape, 'ReverseSequence': _reverse_sequence,
         'While': _while, 'StatelessWhile': _while,
         'PartitionedCall': _call, 'StatefulPartitionedCall': _call}
