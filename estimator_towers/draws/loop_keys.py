"""Loop keys: a random op inside a while loop draws by the loop's iteration and the example.

The rule. A random op built inside a `tf.while_loop` body (a functional `While`'s
body graph under TF2 behaviour, a v1 loop's frame in the model_fn's graph under
`disable_control_flow_v2()`, and a `tf.cond` inside either) is keyed as one outside
loops (`keyed`), and by the iterations of the loops around it: the op's own
counter word is XORed with a code of their iteration counters (innermost
`i + 1`, each outer one's shifted left by 21 bits), computed in the graph, so
iteration t of every loop draws its own values, the same on every topology. Its
rows are the example's: the *places* of a loop give
- the rows of the loop: a loop variable or captured value is of its outer
  value's kind, whatever the body does with it (a loop variable keeps its shape
  from one iteration to the next, so its rows stay the examples'), a v1 loop's
  `Enter`s likewise and its `Switch`es on the loop's own condition pass theirs on;
  an element read from a TensorArray (a list of tensors) made by unstacking a
  time-major transpose of rows (`[time, batch, ...]`, what `dynamic_rnn` and
  Keras RNNs make) is rows;
- the first row's global position: the first entry of the shard's *positions*
  (its first row's position plus `range(rows)`, declared rows), captured by the
  body. A head that runs the loop on the whole batch (a loop the row reader
  cannot split) gathers them like any rows of the shard, so its draws are the
  whole batch's, on any worker.
Inside a loop every op's value is kept at each iteration for the gradient (TensorFlow
accumulates a loop's intermediates), so a draw of rows there is few ops
(`padded_rows`): each row's elements padded to whole Philox groups, the shard's
rows drawn at the counter of its first row, the padding sliced off.
A stateless op inside a loop keeps its own seed (the same values every
iteration, as without the library). Refused at graph construction: a random op
in a `tf.function`'s body or in a loop's condition (no iteration to key it
by), a v1 loop with no iteration counter (`maximum_iterations` gives it one),
and loops nested more than three deep.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf

from estimator_towers.base import control_flow
from estimator_towers.draws import streams
from estimator_towers.rows import row_dependence as rd

__all__ = ['LoopPlaces', 'Place', 'padded_rows', 'static_tail']

_SHIFT = 2 ** 21   # an outer loop's iteration code is shifted left by 21 bits
_DEPTH = 3         # 3 * 21 bits of 63


@dataclasses.dataclass
class Place:
  """Where a random op is built: its rows' reader, its first row's position, the code of the
  iterations of the loops around it (None outside loops) and how to read a tensor's kind."""
  reader: rd.GrowingRead
  position: tf.Tensor
  iteration: tf.Tensor | None
  seed: Callable[[tf.Tensor], None] = lambda t: None
  depth: int = 0
  lists: set = dataclasses.field(default_factory=set)   # a body's lists of rows (by name)
  frame: bool = False   # in a v1 loop's frame, in the model_fn's graph

  def kind(self, t: tf.Tensor) -> rd.Kind | None:
    self.seed(t)
    return self.reader.kind(t)

  def mark(self, t: tf.Tensor, kind: rd.Kind) -> None:
    """A keyed draw `t` is of `kind`: declared (every later read takes it so), but in a v1
    loop's frame, whose values the model_fn's graph reads only through the loop's exits."""
    if self.frame:
      self.reader.add(t, kind)
    else:
      self.reader.declare(t, kind)


class LoopPlaces:
  """The places of one model_fn call's random ops.

  Args:
    graph: the model_fn's graph.
    rows: its reader (the shard's inputs).
    position: the shard's first row's global position.
    refusal: `refusal(why, fix)`, the error for a random op that cannot be keyed.
  """

  def __init__(self, graph: tf.Graph, rows: rd.GrowingRead, position: tf.Tensor,
               refusal: Callable[[str, str], Exception]):
    self.graph, self.rows, self.position, self._refusal = graph, rows, position, refusal
    self._main = Place(rows, position, None)
    # The model_fn's graph as the loops read it: with the batch sizes read off transposes.
    self._outer = Place(rows, position, None, seed=self._seed_sizes)
    self._sized: set = set()     # ops `_seed_sizes` has looked at
    self._places: dict = {}      # a body or branch graph -> its Place
    self._positions = None       # the shard's rows' positions (built once)
    self._first = None           # the shard's first row's position, from them (built once)
    self._seeded: set = set()    # v1 ops whose outputs' kinds are seeded

  def place(self, graph: tf.Graph) -> Place:
    """The place of a random op built now in `graph` (raises the refusal where none)."""
    if graph is self.graph:
      context = control_flow.while_context(graph)
      return self._main if context is None else self._v1(context)
    place = self._places.get(graph) or self._new_place(graph)
    outer = self._outer_of(graph)
    branch, body = control_flow.cond_branch(graph), control_flow.while_body(graph)
    for captured, inner in (branch or body)[1]:   # captures grow as the graph is built
      if captured.dtype not in (tf.variant, tf.resource):
        place.reader.add(inner, outer.kind(captured))
      elif captured.dtype == tf.variant and self._rows_list(captured, outer):
        place.lists.add(inner.name)
    return place

  def _new_place(self, graph: tf.Graph) -> Place:
    branch, body = control_flow.cond_branch(graph), control_flow.while_body(graph)
    if branch is None and body is None:
      where = ('a while loop\'s condition' if type(graph).__name__ == 'WhileCondFuncGraph'
               else 'a function body')
      raise self._refusal(f'it is built inside {where} ({graph.name}), whose every call '
                          f'draws the same keyed values', 'draw it outside (a mask of the '
                          'whole sequence) and pass it in, or draw it in a tf.while_loop body')
    outer = self._outer_of(graph)
    reader = rd.GrowingRead([])
    with graph.as_default():
      if body is None:   # a tf.cond's branch: its iterations are the loop's around it
        place = Place(reader, outer.position, outer.iteration, depth=outer.depth)
      else:
        self._deep(outer.depth)
        place = Place(reader, self.first_position(),
                      _code(outer.iteration, body[0]), depth=outer.depth + 1)
    place.seed = lambda t: _seed_lists(reader, t, place.lists)
    self._places[graph] = place
    return place

  def _outer_of(self, graph: tf.Graph) -> Place:
    outer = self.place(graph.outer_graph)
    return self._outer if outer is self._main else outer

  def _seed_sizes(self, t: tf.Tensor) -> None:
    """The batch size read off a transpose of rows (`tf.shape(time_major)[1]`, what
    `dynamic_rnn` makes its zero state of) is the batch size; a fill of a shape that starts
    with the batch size (`tf.zeros(concat([[batch], [units]]))`, a zero state) is rows."""
    fills = []
    stack = [t.op]
    while stack:
      op = stack.pop()
      if op.name in self._sized:
        continue
      self._sized.add(op.name)
      stack.extend(x.op for x in op.inputs)
      if op.type == 'Fill':
        fills.append(op)
      if op.type != 'StridedSlice' or op.inputs[0].op.type != 'Shape':
        continue
      moved = op.inputs[0].op.inputs[0]
      perm = tf.get_static_value(moved.op.inputs[1]) if moved.op.type == 'Transpose' else None
      begin, end = (tf.get_static_value(x) for x in op.inputs[1:3])
      if (perm is None or begin is None or end is None or len(begin) != 1
          or op.get_attr('shrink_axis_mask') != 1 or not 0 <= begin[0] < len(perm)):
        continue
      if perm[begin[0]] == 0 and self.rows.kind(moved.op.inputs[0]) == rd.Kind(rd.ROWS):
        self.rows.add(op.outputs[0], rd.Kind(rd.SIZE))
    for op in fills:
      if self._leading_size(op.inputs[0]) and self.rows.kind(op.inputs[1]) is None:
        self.rows.add(op.outputs[0], rd.Kind(rd.ROWS))

  def _leading_size(self, dims: tf.Tensor) -> bool:
    """Whether the shape vector `dims` starts with the batch size."""
    while dims.op.type in ('ConcatV2', 'ExpandDims', 'Reshape', 'Pack', 'Identity'):
      if dims.op.type == 'Pack':
        return self.rows.kind(dims.op.inputs[0]) == rd.Kind(rd.SIZE)
      dims = dims.op.inputs[0]
    return dims.shape.rank == 0 and self.rows.kind(dims) == rd.Kind(rd.SIZE)

  def positions(self) -> tf.Tensor:
    """The shard's rows' global positions ([rows] int64, rows), built in the model_fn's graph
    outside any loop, once."""
    if self._positions is None:
      rows = [t for t in self.rows.inputs if t.shape.rank != 0
              and self.rows.kind(t) == rd.Kind(rd.ROWS)]
      if not rows:
        raise self._refusal('the model_fn\'s inputs have no rows to key it by',
                            'pass the batch as a Tensor or dict of Tensors')
      with self.graph.as_default(), tf.control_dependencies(None), \
          tf.name_scope('keyed_draw'):
        count = tf.shape(rows[0], out_type=tf.int64)[0]
        self._positions = tf.add(tf.cast(self.position, tf.int64), tf.range(count),
                                 name='positions')
      self.rows.declare(self._positions, rd.Kind(rd.ROWS))
    return self._positions

  def first_position(self) -> tf.Tensor:
    """The shard's first row's global position (a scalar, 0 for no rows), from `positions()`
    in the model_fn's graph outside any loop, once: a loop's draws read it, and so do the
    accumulators a loop's gradient adds to its body. It is the shard's offset, not a row:
    declared of no kind (a slice of the positions' batch axis would read as mixing it)."""
    if self._first is None:
      positions = self.positions()
      with self.graph.as_default(), tf.control_dependencies(None), \
          tf.name_scope('keyed_draw'):
        self._first = tf.reduce_sum(positions[:1], name='first_position')
      self.rows.declare(self._first, None)
    return self._first

  def _v1(self, context) -> Place:
    """The place of a random op in a v1 loop's frame."""
    outer = control_flow.while_context(self.graph, context)
    outer_code = None if outer is None else self._v1(outer).iteration
    depth = 0 if outer is None else self._v1(outer).depth
    counter = control_flow.while_iteration(context)
    if counter is None:
      raise self._refusal(
          f'it is built inside a v1 tf.while_loop ({context.name}) that counts no '
          f'iterations, and a random op inside a loop is keyed by its iteration',
          'give the loop maximum_iterations (any bound: tf.while_loop(..., '
          'maximum_iterations=n) counts its iterations), or use control flow v2')
    self._deep(depth)
    return Place(self.rows, self.first_position(), _code(outer_code, counter),
                 seed=self._seed_v1, depth=depth + 1, frame=True)

  def _deep(self, depth: int) -> None:
    if depth >= _DEPTH:
      raise self._refusal(f'it is inside loops nested more than {_DEPTH} deep, whose '
                          f'iterations a keyed draw cannot tell apart',
                          'draw it in an outer loop and pass it in')

  def _rows_list(self, t: tf.Tensor, outer: Place) -> bool:
    """Whether the list `t` (a TensorArray's) is a time-major transpose of rows, unstacked."""
    while t.op.type in ('Identity', 'Enter'):
      t = t.op.inputs[0]
    return t.op.type == 'TensorListFromTensor' and _time_major(t.op.inputs[0], outer.kind)

  def _seed_v1(self, t: tf.Tensor) -> None:
    """Seeds the kinds of a v1 frame's Enters, loop Switches and TensorArray reads that `t`
    is computed from (inputs first)."""
    order, seen, stack = [], set(), [(t.op, False)]
    while stack:
      op, done = stack.pop()
      if done:
        order.append(op)
        continue
      if op.name in seen or op.name in self._seeded or not control_flow.in_control_flow(op):
        continue
      seen.add(op.name)
      stack.append((op, True))
      stack.extend((x.op, False) for x in op.inputs)
    for op in order:
      self._seeded.add(op.name)
      if op.type in ('Enter', 'RefEnter'):
        self._seed_sizes(op.inputs[0])
        self.rows.add(op.outputs[0], self.rows.kind(op.inputs[0]))
      elif op.type in ('Switch', 'RefSwitch') and op.inputs[1].op.type == 'LoopCond':
        kind = self.rows.kind(op.inputs[0])
        for out in op.outputs:
          self.rows.add(out, kind)
      elif op.type == 'TensorArrayReadV3' and self._rows_array(op.inputs[0]):
        self.rows.add(op.outputs[0], rd.Kind(rd.ROWS))

  def _rows_array(self, handle: tf.Tensor) -> bool:
    """Whether a v1 TensorArray (its handle) holds a time-major transpose of rows, scattered."""
    while handle.op.type in ('Identity', 'Enter'):
      handle = handle.op.inputs[0]
    if handle.op.type != 'TensorArrayV3':
      return False
    return any(op.type == 'TensorArrayScatterV3' and _time_major(op.inputs[2], self.rows.kind)
               for op in handle.consumers())


def padded_rows(kind: str, shape: tf.Tensor, found: rd.Kind, dtype: tf.DType, key: tf.Tensor,
                counter: tf.Tensor | None, word: tf.Tensor | None, position: tf.Tensor,
                extra: dict) -> tf.Tensor | None:
  """A draw of rows in a loop: row i of the global batch is elements [i * P, i * P + R) of
  the draw at `counter` (R a row's elements, P: R padded to whole Philox groups), so the
  shard asks for its rows at the counter of its first row ([steps, word] for the op's own
  word, else `counter` advanced); None where the row's shape is not known when the graph is
  built (or the rows are flat or stacked)."""
  tail = static_tail(shape) if shape.shape.num_elements() != 0 else None   # not a scalar's
  if tail is None or found.blocks != 1 or found.layout == rd.FLAT:
    return None
  row = int(np.prod(tail, dtype=np.int64))
  group = streams.group_size(kind, dtype)
  padded = -(-row // group) * group
  with tf.name_scope('keyed_draw'):
    rows = tf.cast(shape[0], tf.int64)
    steps = position * (padded // group * streams.group_skip(kind, dtype))
    counter = (streams.advance(counter, steps) if word is None else
               tf.bitcast(tf.stack([steps, word]), tf.uint64))
    drawn = streams.draw(kind, tf.stack([rows, padded]), dtype, key, counter, **extra)
    if padded != row:
      drawn = drawn[:, :row]
    return tf.reshape(drawn, tf.concat([tf.reshape(rows, [1]), tail], 0))


def static_tail(shape: tf.Tensor) -> list | None:
  """The sizes after the first of a shape vector, where known when the graph is built
  (`keyed`'s draws of rows read it too)."""
  op = shape.op
  while op.type in ('Cast', 'Identity'):
    op = op.inputs[0].op
  if op.type == 'Shape':
    dims = op.inputs[0].shape
    return dims[1:].as_list() if dims.rank and dims[1:].is_fully_defined() else None
  value = tf.get_static_value(op.outputs[0], partial=True)
  if value is None or any(v is None for v in value[1:]):
    return None
  return [int(v) for v in value[1:]]


def _time_major(t: tf.Tensor, kind_of: Callable) -> bool:
    """Whether `t` is a transpose of rows whose first element is along the batch
    (`[time, batch, ...]`): each element along axis 0 is rows."""
    if t.op.type != 'Transpose':
      return False
    perm = tf.get_static_value(t.op.inputs[1])
    return (perm is not None and len(perm) >= 2 and perm[0] != 0 and perm[1] == 0
            and kind_of(t.op.inputs[0]) == rd.Kind(rd.ROWS))


def _code(outer: tf.Tensor | None, counter: tf.Tensor) -> tf.Tensor:
  """The iteration code: counter + 1, after the outer loops' code shifted left."""
  with tf.name_scope('keyed_draw'):
    own = tf.cast(counter, tf.int64) + 1
    return own if outer is None else outer * _SHIFT + own


def _seed_lists(reader: rd.GrowingRead, t: tf.Tensor, lists: set) -> None:
  """An element read from a list of rows (`lists`: the body's inputs) is rows."""
  if not lists:
    return
  seen, stack = set(), [t.op]
  while stack:
    op = stack.pop()
    if op.name in seen or op.graph is not t.graph:
      continue
    seen.add(op.name)
    if op.type == 'TensorListGetItem' and op.inputs[0].name in lists:
      reader.add(op.outputs[0], rd.Kind(rd.ROWS))
      continue
    stack.extend(x.op for x in op.inputs)
