"""Cuts after the ops that mix the batch's rows: at the input, and mid-network as a sync point.

The rule. Where an op that mixes the batch's rows (`row_dependence`) gives
one row per example (a permutation of the rows: mixup's `reverse(x, [0])`, a
shuffle, a roll; a matrix product with rows on the left: attention's
`h h^T`; arithmetic of rows with batch statistics: `x - mean(x, 0)`), it
is computed once, on the whole batch, on the first tower's device, and every
tower reads its own rows of its output (the *cut* tensor) instead of its
own value. From the cut on each tower's rows are per-example again (they are
classified as rows: `row_dependence.add_rows`), so the network after it runs
on the towers, each on its own device and rows, under the usual rules (the
loss algebra, tower copies). Cuts are made in rounds (attention's second
product reads the first's cut) as long as each leaves the loss
per-example.

- **At the input** (the *input stage*: the mixing ops computed from the
  shard's inputs through ops that read no variable): the stage's inputs are
  the towers' inputs concatenated in input order (an empty shard's borrowed
  row left out; across workers, all-gathered in rank order, uneven counts
  too) and its ops are copies of tower 0's on them, so a shape read is the
  whole batch's and a random op is drawn once for the batch. Nothing is
  differentiated through it (it reads no variable): no gradient crosses
  between towers, and each tower's backward pass stays its own.
- **Mid-network** (a sync point, as batch norm): the stage also reads rows
  computed by trained layers (attention's hidden rows `h`), gathered from
  the towers in input order. Forward, every tower's rows meet there;
  backward, the gradient of every tower's rows of the cut must meet there
  too before it flows into the gathered rows and back to each tower's own:
  the towers' backward passes are then one (`Seeds.one_pass`), never a copy
  per tower, which with per-tower variables would miss what a tower's
  variables owe to the other towers' losses. Across workers the rows are
  the cluster's (all-gathered in rank order) and their gradient is summed
  over the workers before each takes its own rows'. Kept only where the
  cuts leave the loss per-example; an in-batch softmax (whose labels
  `tf.range(B)` mix after `q d^T`) stays the whole-batch head's, which
  gathers less.

A shard empty at run time reads the batch's first row (its weight is 0).
Not cut (then `whole_batch_head` computes the loss on the whole batch): a
mixing op of another kind, a stage that itself reads a variable, or a
sparse or ragged input, a stage that reads the shard's size as a Python
int (`whole_batch_head.static_size`), a cut tensor whose shape beyond the
rows depends on a static batch (attention's `h h^T` on static shards: the
ops after it were built for the shard's columns), a tower without a
counterpart of a cut tensor, and,
across workers, an input of a dtype the all-reduce cannot sum. A cut tensor
found at run time with another number of rows than the batch stops the step
with an error saying so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.heads import whole_batch_head
from estimator_towers.rows import row_dependence as rd
from estimator_towers.towers import counterparts

_VARIABLE_OPS = frozenset(('ReadVariableOp', 'VarHandleOp', 'VariableV2', 'Variable',
                           'ResourceGather', 'ResourceGatherNd', 'VarIsInitializedOp'))
_GATHERED_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)
_ROUNDS = 8


@dataclasses.dataclass
class Shards:
  """The towers of one gradient request.

  Attributes:
    ys: per tower, the request's tensors (tower 0's first).
    inputs: per tower, its shard's tensors, flattened (aligned).
    sizes, nonempty: per tower, its examples (int or scalar Tensor) and
      whether it has any (bool or Tensor).
    across: a `cross_worker.CrossWorker` when the batch spans workers.
    adopt: `adopt(i, {tower 0's tensor ref: tower i's})`: tensors made after
      the towers' forward passes whose counterparts a copied pass needs.
  """
  ys: Sequence[list]
  inputs: Sequence[list]
  sizes: Sequence
  nonempty: Sequence
  across: Any = None
  adopt: Callable[[int, dict], None] = lambda i, pairs: None
  start: Any = 0          # where this worker's rows begin in the cluster's batch
  examples: Any = None    # the whole batch's examples (the cluster's)


JOINED = 'joined'


@dataclasses.dataclass
class _Round:
  """One cut: its stage's ops, the cut tensors and their towers' counterparts."""
  found: rd.RowDependence
  ops: list
  outputs: list
  sources: list   # per-example tensors of trained layers the stage reads (gathered)
  theirs: list    # per cut tensor, per tower, its counterpart


def cut(shards: Shards, declared: Callable[[tf.Tensor], bool]) -> bool | str:
  """Cuts every tower after the mixing ops it can (see the module doc).

  Each tower's rows of a cut tensor are rows from then on
  (`row_dependence.add_rows`). Returns False where nothing is cut, `JOINED`
  where a cut reads trained layers' rows (then the towers' backward passes
  must be one: the gradient of every tower's rows meets in the stage).
  """
  inputs = [t for t in shards.inputs[0] if isinstance(t, tf.Tensor)]
  earlier = bool(rd.cut_rows(inputs[0].graph)) if inputs else False
  plan = _plan(shards, inputs, declared, joined=True)
  if plan and plan[-1] is None:   # mixing left after a mid-network cut: the head's
    plan = _plan(shards, inputs, declared, joined=False)
  whole: dict = {}   # tower 0's tensor name -> the whole batch's value
  made = []
  for stage in plan:
    values = _whole_values(stage, whole, shards) if stage is not None else None
    if values is None or not all(t.shape[1:].is_compatible_with(v.shape[1:])
                                 for t, v in zip(stage.outputs, values)):
      break   # a static shard's columns of the batch (h h^T): its consumers' shapes differ
    _rewire(stage.outputs, stage.theirs, values, shards, whole)
    made.append(stage)
  if earlier:
    _check_rebuilt(shards, declared)
  if not made:
    return False
  logs.info_once_per_graph(
      f'estimator_towers: {sum(len(r.outputs) for r in made)} tensor(s) that mix the '
      f'batch\'s rows are computed on the whole batch (first {made[0].outputs[0].name}); '
      f'every tower reads its rows of them.')
  return JOINED if any(r.sources for r in made) else True


def _plan(shards: Shards, inputs: list, declared: Callable, joined: bool) -> list:
  """The cuts, in order, as classified with the earlier cuts' tensors as rows.

  With `joined`, cuts may read trained layers' rows; a last None says that
  mixing is left after such a cut (then the whole-batch head is better).
  """
  rounds: list = []
  cuts: list = []
  for _ in range(_ROUNDS):
    found = rd.classify(shards.ys[0], inputs + cuts, declared)
    stage = _stage(found, inputs + cuts, joined)
    if stage is not None and whole_batch_head.static_size(stage[0], found, inputs) is None:
      ops, outputs, sources = stage
      theirs = [[t] + [counterparts.along(shards.ys[0], ys, t) for ys in shards.ys[1:]]
                for t in outputs]
      if all(c is not None for found_k in theirs for c in found_k):
        rounds.append(_Round(found, ops, outputs, sources, theirs))
        cuts = cuts + outputs
        continue
    if found.mixing and any(r.sources for r in rounds):
      rounds.append(None)
    break
  return rounds


def _check_rebuilt(shards: Shards, declared: Callable[[tf.Tensor], bool]) -> None:
  """Raises if a tower built again for a later request has an input stage tower 0's lacks."""
  for i in range(1, len(shards.ys)):
    mine = [t for t in shards.inputs[i] if isinstance(t, tf.Tensor)]
    if _stage(rd.classify(shards.ys[i], mine, declared), mine, False):
      raise ValueError(
          f'estimator_towers: tower {i} was built again for a later gradient request (its '
          f'tensors {[t.name for t in shards.ys[i]]} were made after the first request), '
          f'and its input stage mixes the batch\'s rows, while tower 0 reads the rows its '
          f'first request cut on the whole batch: the towers would differ. Compute the '
          f'later losses before the first gradient request (before the first minimize), '
          f'or run this model_fn on one device.')


def _stage(found: rd.RowDependence, inputs: list, joined: bool
           ) -> tuple[list, list, list] | None:
  """(the stage's ops in graph order, the cut tensors, the trained rows it reads), or None."""
  names = {t.name for t in inputs}
  ops: dict = {}
  sources: dict = {}
  cut_ops = []
  for mixing in found.mixing:
    reached = (_ancestors(mixing.op, names, found, joined)
               if _one_row_each(mixing.op, found) else None)
    if reached is not None:
      ops.update(reached[0])
      sources.update(reached[1])
      cut_ops.append(mixing.op)
  if not cut_ops:
    return None
  order = {op.name: i for i, op in enumerate(cut_ops[0].graph.get_operations())}
  outputs = [t for op in cut_ops for t in op.outputs if t.consumers()]
  return (sorted(ops.values(), key=lambda op: order[op.name]), outputs,
          list(sources.values()))


_PERMUTATIONS = frozenset(('ReverseV2', 'RandomShuffle', 'StatelessShuffle', 'Roll'))
_PRODUCTS = {'MatMul': 'transpose_a', 'BatchMatMul': 'adj_x', 'BatchMatMulV2': 'adj_x',
             'BatchMatMulV3': 'adj_x'}
_ARITHMETIC = frozenset(('Add', 'AddV2', 'Sub', 'Mul', 'RealDiv', 'Div', 'DivNoNan', 'MulNoNan',
                         'Maximum', 'Minimum', 'SquaredDifference', 'Pow', 'Select',
                         'SelectV2'))


def _one_row_each(op: tf.Operation, found: rd.RowDependence) -> bool:
  """True for a mixing op whose output has one row per example of its rows input.

  A permutation of the rows (a reverse, a shuffle, a roll), a matrix product
  of rows with anything, arithmetic of rows with batch statistics or the
  batch size: the whole batch's value then has a row per example, and a
  tower's rows are its examples' rows. Anything else is left to the
  whole-batch head.
  """
  kinds = [found.kind(t) for t in op.inputs]
  rows = rd.Kind(rd.ROWS)
  if op.type in _PERMUTATIONS:
    return kinds[0] == rows
  if op.type in _PRODUCTS:
    return kinds[0] == rows and not op.get_attr(_PRODUCTS[op.type])
  if op.type not in _ARITHMETIC or rows not in kinds:
    return False
  ranks = [t.shape.rank for t in op.inputs]
  top = max(r for k, r in zip(kinds, ranks) if k == rows) if None not in ranks else None
  return top is not None and all(
      (k is None or k == rows or k.tag in (rd.STAT, rd.SIZE)) and r <= top
      for k, r in zip(kinds, ranks))


def _ancestors(op: tf.Operation, inputs: set, found: rd.RowDependence, joined: bool
               ) -> tuple[dict, dict] | None:
  """(the ops between the sources and `op`, the trained rows among the sources), or None.

  The sources are `inputs` and, with `joined`, rows computed from trained
  variables (a layer's output). None if the stage itself reads a variable.
  """
  reached, sources, pending = {}, {}, [op]
  while pending:
    x = pending.pop()
    if x.name in reached:
      continue
    if x.type in _VARIABLE_OPS or x.control_inputs:
      return None
    reached[x.name] = x
    for t in x.inputs:
      kind = found.kind(t)
      if t.name in inputs or t.name in sources:
        continue
      if t.op.type in _VARIABLE_OPS or (kind is None and _reads_variable(t, inputs)):
        return None
      if kind is not None and _reads_variable(t, inputs):
        if not joined or kind != rd.Kind(rd.ROWS):
          return None
        sources[t.name] = t
      elif kind is not None:
        pending.append(t.op)
  return reached, sources


def _reads_variable(t: tf.Tensor, inputs: set = frozenset(), limit: int = 200) -> bool:
  """True if `t` is computed from a variable (not through `inputs`); True past `limit` ops."""
  pending, seen = [t], set()
  while pending and len(seen) < limit:
    x = pending.pop()
    if x.op.name in seen or x.name in inputs:
      continue
    seen.add(x.op.name)
    if x.op.type in _VARIABLE_OPS:
      return True
    pending.extend(x.op.inputs)
  return len(seen) >= limit


def _whole_values(stage: _Round, whole: dict, shards: Shards) -> list | None:
  """The whole batch's value of each cut tensor (None: an input cannot be gathered)."""
  ops, outputs, found = stage.ops, stage.outputs, stage.found
  device = outputs[0].op.device
  read = {t.name for op in ops for t in op.inputs}
  first = shards.inputs[0]
  with tf.name_scope('batch_mixing'):
    for t in stage.sources:
      parts = [t] + [counterparts.along(shards.ys[0], ys, t) for ys in shards.ys[1:]]
      if any(p is None for p in parts):
        return None
      if t.name not in whole:
        with tf.device(device):
          whole[t.name] = _gathered(parts, shards, trained=True)
    for j, t in enumerate(first):
      if t.name not in read or t.name in whole:
        continue
      if found.kind(t) != rd.Kind(rd.ROWS) or (
          shards.across is not None and t.dtype.base_dtype not in _GATHERED_DTYPES):
        return None
      with tf.device(device):
        whole[t.name] = _gathered([s[j] for s in shards.inputs], shards)
    mapped = dict(whole)
    with tf.device(device):
      for op in ops:
        copy = whole_batch_head.copy_op(op, [mapped.get(t.name, t) for t in op.inputs])
        for a, b in zip(op.outputs, copy.outputs):
          mapped[a.name] = b
  return [mapped[t.name] for t in outputs]


def _gathered(parts: list, shards: Shards, trained: bool = False) -> tf.Tensor:
  """The towers' rows of one tensor in input order; across workers, the cluster's.

  Across workers, rows of `trained` layers are differentiable: the gradient
  of the cluster's rows is summed over the workers (each differentiates its
  own towers' losses), and this worker's rows of it flow back to its towers.
  """
  rows = whole_batch_head.gathered(parts, rd.Kind(rd.ROWS), shards.sizes, shards.nonempty)
  if shards.across is not None:
    value = _cluster(rows, shards) if trained else _cluster_values(rows, shards)
    value.set_shape(tf.TensorShape([None]).concatenate(rows.shape[1:]))
    rows = value
  if shards.examples is None:
    shards.examples = tf.shape(rows)[0]
  return rows


def _cluster_values(rows: tf.Tensor, shards: Shards) -> tf.Tensor:
  value, shards.start = whole_batch_head.cluster_rows(rows, shards.across)
  return value


def _cluster(rows: tf.Tensor, shards: Shards) -> tf.Tensor:
  """The cluster's rows, whose gradient is summed over the workers (see `_gathered`)."""
  across = shards.across

  @tf.custom_gradient
  def cluster_rows(mine):
    value, offset = whole_batch_head.cluster_rows(mine, across)
    shards.start = offset

    def grad(upstream):
      (total,) = across.sum([upstream])
      with tf.device(across.device):
        return total[offset:offset + tf.shape(mine)[0]]
    return value, grad

  with tf.name_scope('across_workers'):
    return cluster_rows(rows)


def _offsets(shards: Shards) -> list:
  """Where each tower's rows begin in the whole batch (after lower ranks' rows, across workers)."""
  start, found = shards.start, []
  for size in shards.sizes:
    found.append(start)
    start = start + size
  return found


def _rewire(outputs: list, mine: list, values: list, shards: Shards, whole: dict) -> list:
  """Every tower's consumers of its cut tensors (`mine`: per cut tensor, per tower) read
  its rows of `values`; returns tower 0's rows."""
  offsets = _offsets(shards)
  first = []
  for t, value, theirs in zip(outputs, values, mine):
    graph = t.graph
    start = graph.version
    with tf.name_scope('batch_mixing'):
      check = _check_rows(t, value, shards)
      pairs = []
      for i, own in enumerate(theirs):
        with tf.device(own.op.device), tf.control_dependencies([check]):
          rows = _rows(value, own, offsets[i], shards.sizes[i])
        pairs.append((own, rows))
    rd.add_rows([rows for _, rows in pairs])
    made = set(graph.get_operations()[start:])
    for i, (own, rows) in enumerate(pairs):
      for consumer in list(own.consumers()):
        if consumer in made:
          continue
        for index, x in enumerate(consumer.inputs):
          if x is own:
            interception.replace_input(consumer, index, rows)
      if i:
        shards.adopt(i, {pairs[0][1].ref(): rows})
    whole[pairs[0][1].name] = whole[t.name] = value
    first.append(pairs[0][1])
  return first


def _rows(value: tf.Tensor, own: tf.Tensor, offset: Any, size: Any) -> tf.Tensor:
  """A tower's rows of the whole batch's `value` (a shard empty at run time, whose one
  borrowed example has weight 0: the batch's first row)."""
  begin = tf.cast(offset, tf.int32)
  count = tf.cast(size, tf.int32)
  borrowed = 0 if isinstance(size, int) else tf.maximum(1 - count, 0)
  rows = tf.concat([value[begin:begin + count], value[:borrowed]], 0)
  rows.set_shape(own.shape[:1].concatenate(value.shape[1:]))
  return rows


def _check_rows(t: tf.Tensor, value: tf.Tensor, shards: Shards) -> tf.Operation:
  """Asserts that the whole batch's value of the cut tensor `t` has one row per example."""
  with tf.device(value.op.device):
    return tf.debugging.assert_equal(
        tf.shape(value)[0], shards.examples, message=(
            f'estimator_towers: {t.name} mixes the batch\'s rows at the input and is '
            f'computed on the whole batch before the shards are cut, so it must have one '
            f'row per example of the batch (each tower reads its own rows); it has another '
            f'number of rows. Compute it with one row per example (or run the model_fn on '
            f'one device)'))
