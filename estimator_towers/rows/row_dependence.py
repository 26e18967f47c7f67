"""Row dependence: how each tensor's rows relate to the shard's examples.

The rule. A towered model_fn is exact for free where every example's values
are computed from that example alone: then a shard's rows are the whole
batch's rows of its examples, and what is left between the shards is the
loss's statistics (`loss_algebra`) and the batch norms' (`sync_points.batch_norm`).
The row reader reads tower 0's graph, from the shard's input tensors to a
target (the loss), and gives each tensor in between one *kind*:

- **rows** (per-example): row i is computed from example i only (the
  shard's inputs, and whatever elementwise arithmetic, layers, per-row
  softmaxes, reductions over other axes, gathers of a table by the rows'
  ids, ... make of them). Stacked layouts are tracked: two views of each
  example concatenated on axis 0 (SimCLR's `concat(split(x, 2, -1), 0)`) are
  rows in 2 blocks, and a split of them back into 2 is rows again, so an
  encoder run on the stacked views stays per-example.
- **flat**: every row belongs to one example, in example order, but not one
  row per example (a reshape of [n, T, d] to [n * T, d], `tf.boolean_mask`'s
  rows, `tf.where`'s positions gathered); sums of it are still statistics.
  `per` is how many entries each example has: where each example has the
  same T rows (a reshape's), T, and a reshape back to [n, T, d] is rows
  again; a `tf.where`'s name where the mask's values decide it.
- **lifted**: rows or flat rows behind a new leading axis of 1 ([1, n,
  ...]: the r1 Transformer's pad-removing FFN's `expand_dims(x, 0)`), the
  batch on axis 1; a tensordot (Dense on rank 3) keeps them, a squeeze of
  axis 0 gives them back, a reduction over axis 1 is a statistic, anything
  else on them mixes. Their shape is a `lifted shape`.
- **positions**: `tf.where`'s indices, positions in the shard's rows or
  flat rows: the shard's layout, not values of its examples. A gather,
  `gather_nd` or `scatter_nd` by them is per-example only at positions of
  the same rows (`flat`: `tf.boolean_mask`, the pad remover); a cast or copy
  keeps them; anything else on them mixes. A head on the whole batch
  computes them again from the gathered mask, never gathers them.
- **offsets** and **indices**: `range(n) * T` (each example's first row in a
  flat tensor of T rows per example) and positions plus them: positions of
  each example's own rows (as BERT's `gather_indexes` makes them; a
  position must be in [0, T), the input's promise). A gather of the flat
  rows of T per example by them is per-example; any other op on indices, or
  a gather of the batch's rows by other positions, mixes the rows; offsets
  read elsewhere are batch-size values.
- **statistic**: a reduction over the batch axis of rows that adds up over
  the shards (a sum, a mean, `L2Loss`, a batch norm's moments), and
  arithmetic on such values: what the
  loss algebra rebuilds (or says it cannot) and what sync batch norm joins.
  A batch norm's statistics (`tf.nn.moments` over axis 0, a fused batch
  norm) normalising rows keep them rows: that is `sync_batch_norm`'s choice.
- **batch size**: a value of the shard's size (`tf.shape(x)[0]`, `tf.size`,
  `tf.range` of it, a one-hot of width 2B, an identity matrix of it);
  `shape` is the shape vector whose first element is the batch size, which
  makes rows of constants (`tf.zeros([n, d])`, random noise of `tf.shape(x)`).
- **distinct values**: `tf.unique` of the batch's ids (what
  `embedding_lookup_sparse` looks up once per id); rows again only where a
  sparse segment reduction sums them back per example.
- **row splits**: a RaggedTensor's `row_splits` (its `flat_values` are
  flat); their differences are rows (each example's length), and the
  segment ids made from them (`RaggedSplitsToSegmentIds`) flat.
- **columns**: the batch on axis 1 (a transpose of [n, d], a time-major
  [T, n, ...] sequence: a step of it is rows); its shape a `columns shape`.
- **list**, **one example**, **longest length** (`loops`, `frames`): a
  TensorList or TensorArray of elements of a kind; one example's values, read
  by a loop's step from the list of the batch's examples (`tf.map_fn`); the
  batch's longest length, a max over the batch that only bounds a loop whose
  body copies each example's values through past its own length.
- **mixed**: a row depends on other examples of the batch. The first op that
  makes a mixed tensor out of none is a *mixing op*: a matrix product of two
  batch operands, a transpose, top-k, reverse, gather or slice across the
  batch axis, a reduction over the batch axis no sum of the shards' values
  gives (a max, a min, an arg-max, a product, `reduce_all` / `reduce_any`),
  a concat on the batch axis of rows with other values, rows
  combined with a statistic that is not a batch norm's or with a batch-size
  value, and any op the reader does not know (a `py_func`, a functional
  `Case`) fed by the batch: an op that cannot
  be classified counts as mixing, never as per-example.

Tensors that depend on no input of the shard (variables, constants,
hyper-parameters) have no kind. A tensor declared with `loss_denominator` is
a statistic, whatever computes it; a tower's rows of an input stage computed
on the whole batch (`batch_mixing`) are rows.

`classify` returns the kinds, the mixing ops (each with why), and the
frontier: the last per-example tensors (rows or flat) that mixing ops read.

Never silently wrong: `check` reads tower 0's loss when the towers' loss
rule is chosen (`loss_algebra.analyse`, in TRAIN and EVAL). A mixing op that
the library does not compute on the whole batch gets one warning at graph
construction naming the op and why (an error with `loss_reduction='exact'`,
and with micro-batches, whose head reads a first pass: `cached_gradients`); a model whose rows are all
per-example gets nothing.

The modules of `rows/`, each by what it reads: `kinds` (the kinds and the
result types), `op_tables` (the op types by how they treat rows),
`static_values` (values known when the graph is built), `sizes`,
`elementwise`, `statistics`, `einsum`, `flat` and `stacked` (the families of
ops), `reader` (the walk, the mixing ops and the frontier), `messages` (the
warning or error). This module holds the entry points (`classify`, `check`,
`in_eval_spec`, `add_rows`, `cut_rows`) and re-exports the names callers use (`einsum_subscripts`: an equation's subscripts per
operand, for the heads that split an einsum's rows).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence
import weakref

import tensorflow as tf

from estimator_towers.base import shapes
from estimator_towers.rows import messages
from estimator_towers.rows.einsum import subscripts as einsum_subscripts
from estimator_towers.rows.flat import input_kinds
from estimator_towers.rows.kinds import (BOUND, COLS, FLAT, INDICES, LIFTED, LIFTED_SHAPE, MIXED, OFFSETS,
                                         POSITIONS, ROWS, ROWS_KIND, SHAPE, SIZE, SPLITS, STAT,
                                         UNIQUE, Kind, Mixing, RowDependence, flat_kind,
                                         same_for_each)
from estimator_towers.rows.op_tables import ARITHMETIC, ASSIGNS
from estimator_towers.rows.reader import Reader, declare_kind, declared_kinds, extend, read
from estimator_towers.rows.sparse import POSITION_MARKS as SPARSE_POSITIONS

# The names the other stages read as `row_dependence.<name>` (the kinds and the op table
# re-exported from `kinds` and `op_tables`).
__all__ = ['ARITHMETIC', 'BOUND', 'COLS', 'FLAT', 'INDICES', 'LIFTED', 'LIFTED_SHAPE', 'MIXED', 'OFFSETS',
           'POSITIONS', 'ROWS', 'SHAPE', 'SIZE', 'SPLITS', 'STAT', 'UNIQUE', 'Kind', 'Mixing',
           'RowDependence', 'SPARSE_POSITIONS', 'add_rows', 'check', 'classify', 'cut_rows', 'declare_kind',
           'declared_kind', 'einsum_subscripts', 'flat_kind', 'GrowingRead', 'same_for_each', 'in_eval_spec']

_cut_rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {tensor name}


def add_rows(tensors: Sequence[tf.Tensor]) -> None:
  """`tensors` are rows of their tower's examples, whatever computes them.

  `batch_mixing` cuts the towers at the input stage's mixing ops: each tower
  reads its rows of the whole batch's value, made from every tower's inputs.
  """
  for t in tensors:
    _cut_rows.setdefault(t.graph, set()).add(t.name)


def declared_kind(tensor: tf.Tensor) -> Kind | None:
  """The kind `declare_kind` gave `tensor`, if any."""
  return declared_kinds(tensor.graph).get(tensor.name)


class GrowingRead:
  """The kinds of a graph still being built (a model_fn's), read as they are asked for.

  `inputs`: the shard's tensors (each rows); `kinds`: more tensors of known
  kinds. A tensor's kind depends only on what computes it, so what was read
  stays read as the graph grows.
  """

  def __init__(self, inputs: Sequence[tf.Tensor], kinds: dict | None = None):
    self.inputs = [t for t in inputs if isinstance(t, tf.Tensor)]
    self._reader = Reader(_static_examples(self.inputs), lambda t: False)
    self._reader.kinds.update(input_kinds(self.inputs) if self.inputs else {})
    self._reader.kinds.update(kinds or {})

  def add(self, tensor: tf.Tensor, kind: Kind | None) -> None:
    """`tensor` (an input of a graph inside another: a captured value) is of `kind`."""
    if kind is not None and tensor.name not in self._reader.kinds:
      self._reader.kinds[tensor.name] = kind

  def kind(self, tensor: tf.Tensor) -> Kind | None:
    """`tensor`'s kind (None: it does not depend on the shard's inputs)."""
    if not self._reader.kinds:
      return None
    extend(self._reader, [tensor])
    return self._reader.kind(tensor)

  def declare(self, tensor: tf.Tensor, kind: Kind) -> None:
    """`tensor` is of `kind` whatever computes it, here and in every later read."""
    declare_kind(tensor, kind)
    self._reader.kinds[tensor.name] = kind


def cut_rows(graph: tf.Graph) -> frozenset:
  """The names of the tensors `add_rows` made rows in `graph`."""
  return frozenset(_cut_rows.get(graph, ()))


def classify(targets: Sequence[tf.Tensor], inputs: Sequence[tf.Tensor],
             declared: Callable[[tf.Tensor], bool] = lambda t: False) -> RowDependence:
  """The row dependence of everything between the shard's `inputs` and `targets`.

  Args:
    targets: tower 0's tensors of interest (the loss).
    inputs: tower 0's shard tensors, flattened (features and labels; labels
      may be absent). Each is rows.
    declared: whether a tensor is declared a statistic (`loss_denominator`).
  """
  inputs = [t for t in inputs if isinstance(t, tf.Tensor)]
  targets = [t for t in targets if isinstance(t, tf.Tensor)]
  if not inputs or not targets:
    return RowDependence({}, [], [])
  kinds = input_kinds(inputs)
  kinds.update((name, ROWS_KIND) for name in _cut_rows.get(targets[0].graph, ()))
  reader = read(targets, kinds, _static_examples(inputs), declared)
  for t in targets:
    if reader.kind(t) is not None and reader.kind(t).tag == UNIQUE:
      reader.mixing.append(Mixing(t.op, 'a value of the batch\'s distinct ids, which no '
                                        'sum over shards gives'))
  return RowDependence(reader.kinds, reader.mixing, reader.frontier)


def _static_examples(inputs: Sequence[tf.Tensor]) -> int | None:
  for t in inputs:
    if shapes.dim(t) is not None:
      return shapes.dim(t)
  return None


def in_eval_spec(spec: Any, inputs: Sequence[tf.Tensor]) -> RowDependence:
  """`classify` of an EVAL EstimatorSpec: its loss, its metrics and what updates them.

  A metric's update reaches its variables through assignments (often only a
  control edge leads from the update op to them), so every value assigned to
  a local or metric variable in the graph is a target too.
  """
  targets = [t for t in tf.nest.flatten(
      (spec.loss, [v for v in (spec.eval_metric_ops or {}).values()
                   if isinstance(v, (tuple, list))]))
             if isinstance(t, tf.Tensor)]
  inputs = [t for t in inputs if isinstance(t, tf.Tensor)]
  if not inputs:
    return RowDependence({}, [], [])
  graph = inputs[0].graph
  metric_variables = {getattr(v, 'handle', v).op.name for v in graph.get_collection(
      tf.compat.v1.GraphKeys.LOCAL_VARIABLES) + graph.get_collection(
          tf.compat.v1.GraphKeys.METRIC_VARIABLES)}
  for op in graph.get_operations():
    if op.type in ASSIGNS and op.inputs[0].op.name in metric_variables:
      targets.extend(op.inputs[1:])
  return classify(targets, inputs)


def check(targets: Sequence[tf.Tensor], inputs: Sequence[tf.Tensor], loss_reduction: str,
          micro_batches: bool, declared: Callable[[tf.Tensor], bool] = lambda t: False,
          note: str | None = None) -> RowDependence:
  """`classify`, and the warning or error for a mixing op (see the module doc).

  Args:
    targets: tower 0's loss (or the tensors a gradient request is of).
    inputs: tower 0's shard tensors, flattened.
    loss_reduction: the plan's ('exact' makes the warning an error).
    micro_batches: whether shards are micro-batches (a mixing op is an error).
    declared: whether a tensor is declared a statistic (`loss_denominator`).
    note: why the library does not compute the head on the whole batch here.

  Raises:
    ValueError: for a mixing op with micro-batches or loss_reduction='exact'.
  """
  found = classify(targets, inputs, declared)
  if found.mixing:
    messages.report([t for t in targets if isinstance(t, tf.Tensor)], found, loss_reduction,
                    micro_batches, note)
  return found
