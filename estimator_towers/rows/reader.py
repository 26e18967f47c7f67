"""The reader: tower 0's graph from the shard's inputs to the targets, op by op.

The rule. `read` walks back from the targets to the shard's inputs (not
into what computes a declared statistic, nor into another shard's inputs, nor
behind another tower's part of a sync point's table: `base.tower_parts`)
and visits the ops in between in graph order, each after its inputs. An op
that depends on no input of the shard gives no kind; one fed by a mixed
tensor is mixed; otherwise its op type picks the family that reads it
(`sizes`, `elementwise`, `statistics`, `einsum`, `flat`, `stacked`,
`sparse`; an op on a SparseTensor's marked indices first asks `sparse`; a
tf.cond's branches are read like the rest when the choice is not the
batch's, its functional `If` or control flow v1's `Switch` and `Merge`; loops, lists
and function calls by `loops` and `frames`, before the families), and an op
no family knows, a `py_func` or a functional `Case` fed by the batch mixes its rows: never
per-example by default, and so does an op not named in `_LIFTED_OPS` on
entries lifted onto axis 1, or one not named in `_POSITION_OPS` on
`tf.where`'s positions. Offsets and indices of each example's own rows
(`range(n) * T`, positions plus them) are read by `flat.indexing` before
the families, whatever the op. A
mixing op is recorded with why, and the rows or flat rows it reads (through
the transposes that made them columns) are the frontier, each once.
"""

from __future__ import annotations

from typing import Callable, Sequence
import weakref

import tensorflow as tf

from estimator_towers.base import control_flow
from estimator_towers.base import fixed_sums
from estimator_towers.base import tower_parts
from estimator_towers.rows import einsum
from estimator_towers.rows import elementwise
from estimator_towers.rows import flat
from estimator_towers.rows import frames
from estimator_towers.rows import loops
from estimator_towers.rows import sizes
from estimator_towers.rows import sparse
from estimator_towers.rows import stacked
from estimator_towers.rows import statistics
from estimator_towers.rows.kinds import (COLS, FLAT, FLAT_KIND, INDICES, LIFTED, LIFTED_SHAPE,
                                         MIXED, MIXED_KIND, OFFSETS, POSITIONS, ROWS, SPLITS,
                                         STAT_KIND, UNIQUE, UNIQUE_KIND, Kind, Mixing)
from estimator_towers.rows.op_tables import (ELEMENTWISE, FUNCTIONS, REDUCTIONS, SEGMENT_SUMS,
                                             SHAPES, SPARSE_SEGMENTS)

_SEARCH_LIMIT = 200000
_FAMILIES = (sizes, elementwise, statistics, einsum, flat, stacked, sparse)
# Op type -> its family's reader: (reader, op, kinds) -> a Kind, a list of Kinds (per
# output), or a str (a mixing op: why). No type is read by two families.
_RULES = {t: rule for family in _FAMILIES for t, rule in family.RULES.items()}
assert len(_RULES) == sum(len(family.RULES) for family in _FAMILIES)
# The op types whose rules read entries lifted onto axis 1 ([1, n, ...]) and their shape;
# any other op fed by them mixes.
_LIFTED_OPS = ELEMENTWISE | REDUCTIONS | SHAPES | frozenset((
    'Size', 'ArgMax', 'ArgMin', 'L2Loss', 'Reshape', 'Transpose', 'ExpandDims', 'Squeeze',
    'ConcatV2', 'Pack', 'StridedSlice', 'GatherV2', 'MatMul', 'BatchMatMul', 'BatchMatMulV2',
    'BatchMatMulV3'))
# The op types whose rules read `tf.where`'s positions: a copy of them, a gather or scatter by
# them, their count; any other op fed by them mixes (a position is the shard's layout).
_POSITION_OPS = SHAPES | frozenset((
    'Size', 'Identity', 'Cast', 'StopGradient', 'Snapshot', 'EnsureShape', 'CheckNumerics',
    'Reshape', 'Squeeze', 'StridedSlice', 'GatherV2', 'Gather', 'GatherNd', 'ScatterNd')
) | frozenset(sparse.RULES)   # positions in rows are a SparseTensor's indices
# The op types `sparse` reads on unmarked kinds too: a column of positions in rows, entries of
# two SparseTensors combined or gathered at the other's mask.
_ENTRY_OPS = ELEMENTWISE | {'StridedSlice', 'GatherV2', 'Gather', 'ResourceGather'}


# graph -> {tensor name: Kind}: tensors of a kind whatever computes them (keyed random draws).
_declared_kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def declare_kind(tensor: tf.Tensor, kind: Kind) -> None:
  """`tensor` is of `kind` whatever computes it: every read takes it so (`draws.keyed`)."""
  _declared_kinds.setdefault(tensor.graph, {})[tensor.name] = kind


def declared_kinds(graph: tf.Graph) -> dict:
  """The kinds `declare_kind` gave tensors of `graph`, by name."""
  return dict(_declared_kinds.get(graph, {}))


def read(targets: Sequence[tf.Tensor], input_kinds: dict, examples: int | None,
         declared: Callable[[tf.Tensor], bool]) -> Reader:
  """The reader after visiting, in graph order, the ops between the inputs and `targets`."""
  declared_stats = {}
  input_kinds = {**declared_kinds(targets[0].graph), **input_kinds}

  def stop(t: tf.Tensor) -> bool:
    if t.name in input_kinds:
      return True
    if declared(t):   # a declared statistic: what computes it is not read
      declared_stats[t.name] = STAT_KIND
      return True
    # another shard's inputs (a row borrowed from this one): not this shard's
    return t.op.name.startswith('shard_inputs')

  ops = _ops_before([t.op for t in targets if not declared(t)], stop,
                    tower_parts.others(targets[0].graph, input_kinds))
  reader = Reader(examples, declared)
  reader.kinds.update(input_kinds)
  reader.kinds.update(declared_stats)
  reader.kinds.update({t.name: STAT_KIND for t in targets if declared(t)})
  for op in ops:
    reader.visit(op)
  return reader


def extend(reader: 'Reader', targets: Sequence[tf.Tensor]) -> None:
  """`reader` after visiting also the ops between what it has read and `targets`.

  For a graph that grows while it is read (a model_fn being built): a
  tensor's kind depends only on what computes it, so what was read stays.
  """
  for op in _ops_before([t.op for t in targets if t.name not in reader.kinds],
                        lambda t: t.name in reader.kinds):
    reader.visit(op)


def _ops_before(pending: list, stop: Callable[[tf.Tensor], bool],
                skip: Callable[[tf.Operation], frozenset] | None = None) -> list:
  """The ops `pending` and what computes their inputs up to `stop`, in graph order; of a
  join's table (`skip`: its inputs that are other towers' parts), this tower's part only."""
  ops, seen = [], set()
  while pending and len(seen) < _SEARCH_LIMIT:
    op = pending.pop()
    if op in seen:
      continue
    seen.add(op)
    ops.append(op)
    others = skip(op) if skip is not None else ()
    pending.extend(t.op for i, t in enumerate(op.inputs) if i not in others and not stop(t))
  if ops:  # graph order (ops hash by identity: no name built per op of the graph)
    order = {op: i for i, op in enumerate(ops[0].graph.get_operations())}
    ops.sort(key=lambda op: order.get(op, -1))
  return _inputs_first(ops)


def _inputs_first(ops: list) -> list:
  """`ops` (in graph order) each after those of them it reads: a v1 loop's `Enter` is made
  after the op that reads it; a `Merge`'s back edge (`NextIteration`) is no such read."""
  among, done, result = set(ops), set(), []
  for start in ops:
    stack = [(start, False)]
    while stack:
      op, ready = stack.pop()
      if op in done:
        continue
      if ready:
        done.add(op)
        result.append(op)
        continue
      stack.append((op, True))
      for t in reversed(op.inputs):
        if t.op in among and t.op not in done and not (
            op.type in ('Merge', 'RefMerge') and 'NextIteration' in t.op.type):
          stack.append((t.op, False))
  return result


class Reader:
  """Visits ops in graph order, each after its inputs; fills `kinds`."""

  def __init__(self, examples: int | None, declared: Callable[[tf.Tensor], bool]):
    self.examples = examples
    self.declared = declared
    self.kinds: dict = {}
    self.mixing: list = []
    self.frontier: list = []
    self._frontier_names: set = set()
    self.loops: dict = {}   # what `frames` keeps of each v1 loop's Merge while it reads it
    self.order: list = []   # the ops visited, in order

  def forget_frontier(self, t: tf.Tensor) -> None:
    """`t` is no longer on the frontier (a v1 loop's frame read again: `frames`)."""
    self.frontier = [f for f in self.frontier if f.name != t.name]
    self._frontier_names.discard(t.name)

  def kind(self, t: tf.Tensor) -> Kind | None:
    return self.kinds.get(t.name)

  def inner(self, outputs: Sequence[tf.Tensor], given: dict) -> 'Reader':
    """The reader of a function's graph (a loop's body, a called function), from its inputs
    of the `given` kinds (by name) to `outputs`."""
    return read(outputs, given, self.examples, self.declared)

  def visit(self, op: tf.Operation) -> None:
    self.order.append(op)
    if not op.outputs or all(o.name in self.kinds for o in op.outputs):
      return
    kinds = [self.kind(t) for t in op.inputs]
    if all(k is None for k in kinds):
      return   # depends on no input of the shard
    if any(k is not None and k.tag == MIXED for k in kinds):
      self._set(op, MIXED_KIND)
      return
    if any(self.declared(o) for o in op.outputs):
      self._set(op, STAT_KIND)
      return
    found = _rule(self, op, kinds)
    if isinstance(found, str):   # a mixing op: why
      self.mixing.append(Mixing(op, found))
      for t, k in zip(op.inputs, kinds):
        while k is not None and (
            k.tag == COLS and t.op.type in ('Transpose', 'Reshape', 'Einsum') or (
                k.tag == LIFTED and t.op.type in ('Transpose', 'Reshape', 'ExpandDims'))):
          # the rows a transpose (or an einsum of one batch operand) made columns of, or lifted
          t = [i for i in t.op.inputs if self.kind(i) is not None][0]
          k = self.kind(t)
        if k is not None and k.tag in (ROWS, FLAT) and t.name not in self._frontier_names:
          self._frontier_names.add(t.name)
          self.frontier.append(t)
      self._set(op, MIXED_KIND)
    elif isinstance(found, list):
      for o, k in zip(op.outputs, found):
        self.kinds[o.name] = k
    else:
      self._set(op, found)

  def _set(self, op: tf.Operation, kind: Kind) -> None:
    for o in op.outputs:
      self.kinds[o.name] = kind


def _rule(reader: Reader, op: tf.Operation, kinds: list):
  """The kinds of `op`'s outputs: a Kind, a list of Kinds (per output), or a str (mixing: why)."""
  t = op.type
  if frames.applies(op):   # control flow v1's loops, TensorArrays
    return frames.rule(reader, op, kinds)
  if loops.applies(op, kinds):   # While loops, lists and what they give
    return loops.rule(reader, op, kinds)
  present = [k for k in kinds if k is not None]
  if t in ('Mul', 'Add', 'AddV2') or any(k.tag in (OFFSETS, INDICES) for k in present):
    found = flat.indexing(reader, op, kinds)
    if found is not None:
      return found
    kinds = flat.degraded(kinds)
    present = [k for k in kinds if k is not None]
  if t not in sparse.RULES and (t in _ENTRY_OPS or any(sparse.marked(k) for k in present)):
    found = sparse.on_entries(reader, op, kinds)
    if found is not None:
      return found
    kinds = sparse.degraded(kinds)
    present = [k for k in kinds if k is not None]
  if 'RaggedSplitsToSegmentIds/' in op.name and all(k.tag != MIXED for k in present):
    return FLAT_KIND   # which example each entry of a RaggedTensor belongs to
  if any(k.tag == SPLITS for k in present):
    return flat.splits(op, kinds)
  if any(k.tag in (LIFTED, LIFTED_SHAPE) for k in present) and t not in _LIFTED_OPS:
    return f'an op on entries lifted onto axis 1 the reader does not follow ({t})'
  if any(k.tag == POSITIONS for k in present) and t not in _POSITION_OPS:
    return (f'an op on tf.where\'s positions (the shard\'s layout, not an example\'s '
            f'values) ({t})')
  if t == 'ScatterNd' and any(k.tag in (FLAT, POSITIONS) for k in present):
    return flat.scatter_nd(reader, op, kinds)
  if t.startswith('Collective') or t in ('ScatterNd', 'TensorScatterUpdate', 'TensorScatterAdd'
                                         ) or fixed_sums.in_sum_across_workers(op):
    return statistics.across_workers(op, present)
  if t in SEGMENT_SUMS:
    return flat.segment_sum(op, kinds)
  if present and all(k.tag == UNIQUE for k in present) and t not in SPARSE_SEGMENTS and (
      t not in ('GatherV2', 'Gather', 'ResourceGather') or kinds[0] is not None):
    return UNIQUE_KIND   # values per distinct id, whatever computes them
  if t in _RULES:
    return _RULES[t](reader, op, kinds)
  if t == 'Where' and len(op.inputs) == 1:
    return flat.where(op, kinds)
  if t in ('If', 'StatelessIf'):
    return _cond(reader, op, kinds)
  if t in ('Switch', 'RefSwitch', 'Merge', 'RefMerge'):
    return _cond_v1(t, kinds)
  if t in FUNCTIONS:
    return (f'a {"function call" if "Call" in t else "Python function" if "Py" in t else "functional control flow op"}'
            f' the library cannot see inside, fed by the batch\'s rows')
  return f'an op the library does not know how it treats the batch\'s rows ({t})'


def _cond_v1(t: str, kinds: list):
  """A tf.cond of control flow v1 (`disable_control_flow_v2()`): its `Switch` passes its data's
  kind to both branches when the choice is not the batch's, its `Merge` gives the branches'
  common kind (its second output, the branch taken, none)."""
  if t.endswith('Switch'):
    if kinds[1] is not None:
      return 'a tf.cond whose branch is chosen by a value of the batch'
    return [kinds[0], kinds[0]]
  present = [k for k in kinds if k is not None]
  if any(k != present[0] for k in present):
    return 'a tf.cond whose branches give rows of different kinds'
  return [present[0] if present else None, None]


def _cond(reader: Reader, op: tf.Operation, kinds: list):
  """A functional tf.cond: its branches read like the rest, when the choice is not the batch's."""
  if kinds[0] is not None:
    return 'a tf.cond whose branch is chosen by a value of the batch'
  graphs = control_flow.branch_graphs(op)
  if graphs is None:
    return 'a functional control flow op the library cannot see inside, fed by the batch\'s rows'
  results = []
  for graph in graphs:
    inner = {t.name: k for t, k in zip(graph.inputs, kinds[1:]) if k is not None}
    outputs = [t for t in graph.outputs if t is not None]
    if len(outputs) != len(op.outputs):
      return 'a tf.cond whose branches the library cannot read'
    branch = read(outputs, inner, reader.examples, reader.declared) if outputs else None
    if branch is not None and branch.mixing:
      return f'a tf.cond whose branch has {branch.mixing[0].describe()}'
    results.append([None if branch is None else branch.kind(t) for t in outputs])
  found = []
  for a, b in zip(*results):
    if a is None or b is None or a == b:
      found.append(a if b is None else b)
    else:
      return 'a tf.cond whose branches give rows of different kinds'
  return found
