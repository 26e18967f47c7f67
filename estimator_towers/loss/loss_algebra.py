"""The loss algebra: a loss as a function of the batch's additive statistics.

The rule. A plain model_fn's loss is computed from *statistics* of the batch,
values that add up over its examples (or tokens), and from values that do not
depend on the batch at all, combined by elementwise arithmetic:

- a statistic is a one-element `tf.reduce_sum` of something computed per
  example (a sum of losses, a weighted sum, a sum of weights, a count of
  non-zero weights), a `tf.size` or `tf.shape(x)[0]` of a shard tensor (an
  element count), a `tf.reduce_mean` (its sum over its element count: two
  statistics), or a tensor declared with `loss_denominator`;
- a *shard-independent* term depends on no input of the shard: a
  regulariser, a hyper-parameter, a loss scale, a learned task weight;
- they are combined by elementwise ops and reductions of them (`+`, `-`,
  `*`, `/`, `divide_no_nan`, `maximum`, `tf.add_n`, casts, logs,
  `tf.reduce_mean(tf.stack([...]))`, the max of a stack of losses, ...).

`analyse` recognises that structure on tower 0's loss. The whole batch's
loss is then the same function of the whole batch's statistics, each the sum
of the shards' (towers' and micro-batches') values, with every
shard-independent term counted once:

    L = f(S_1, ..., S_m, c),   S_i = sum over shards k of s_ik

`Expression.rebuild` builds exactly that, and the whole-batch gradient is its
gradient: BERT's `sum(w * l) / (sum(w) + 1e-5) + mean(nsp)` becomes
`sum_k sum(w_k * l_k) / (sum_k sum(w_k) + 1e-5) + sum_k sum(nsp_k) /
sum_k size(nsp_k)`, the plain loss on the whole batch, and a regulariser is
added once rather than once per tower. No shard's own ratio is in the
differentiated graph, so a shard with no tokens (0 / 0) makes no NaN.

When the example-count rule is exact it is kept, since it adds nothing
between devices and lets each tower start its backward pass without waiting
for the others: a loss that is a combination of means (`reduce_mean`, a sum
over an element count, with shard-independent terms; the rule 'mean': tower
k weighs n_k / B) or a combination of sums with no shard-independent term
(the rule 'sum': weights 1).

A loss the rule cannot rebuild (an op that is not elementwise arithmetic on
statistics, a denominator not declared) keeps the example-count rule, and
`analyse` logs one warning that names the op; with `loss_reduction='exact'`
that is an error instead. A loss it rebuilds exactly logs nothing. A loss
that reads ops mixing the batch's rows (a max, a top-k or a sort over the
batch, a sum of values divided by the batch's sum: `row_dependence`) trains
through its head on the whole batch (`request_seeds`); where that head
cannot be built, `row_dependence`'s warning says why, not this one.

The seeds of the whole-batch gradient that follow from the rule, with
towers and with micro-batches, are `seeds`'.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence
import weakref

import tensorflow as tf

from estimator_towers.base import logs
from estimator_towers.base import tower_parts
from estimator_towers.draws import keyed
from estimator_towers.rows import row_dependence
from estimator_towers.towers import tower_context

# Ops the algebra rebuilds by copying them onto the whole batch's values.
_ELEMENTWISE = row_dependence.ARITHMETIC | {'Pack', 'Reshape', 'Squeeze', 'ExpandDims'}
# Reductions: a leaf when one-element over per-example values; rebuilt as
# algebra when over values that are themselves statistics (a stack of losses).
_SUMS = ('Sum', 'Mean')
_DIVISIONS = ('RealDiv', 'Div', 'DivNoNan')
_REDUCTIONS = frozenset(('Sum', 'Mean', 'Max', 'Min', 'Prod', 'All', 'Any',
                         'EuclideanNorm', 'ArgMax', 'ArgMin'))
SHAPE_OPS = frozenset(('Shape', 'ShapeN', 'Size', 'Rank', 'OnesLike', 'ZerosLike'))
# Ops whose output's number of rows depends on values, not on the examples.
_VALUE_SHAPED = frozenset(('Where', 'Unique', 'UniqueV2', 'UniqueWithCounts',
                           'UniqueWithCountsV2', 'DynamicPartition', 'ListDiff',
                           'DenseToDenseSetOperation', 'DenseToSparseSetOperation'))
_SEARCH_LIMIT = 20000

_lock = threading.Lock()
_declared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {tensor name}


def loss_denominator(denominator: tf.Tensor) -> tf.Tensor:
  """Declares a statistic of the loss that the library cannot recognise.

  Write the loss as `numerator / estimator_towers.loss_denominator(d)` (or
  with `d` anywhere in the loss's arithmetic), with `d` a value that adds up
  across shards (a count of tokens, a sum of weights), however it is
  computed (a matrix product, a custom op). The whole batch's loss then uses
  the sum of the shards' `d`, exactly as the plain model_fn uses the whole
  batch's `d`. Needed only when `d` is not one of what the library
  recognises (`tf.reduce_sum`, `tf.reduce_mean`, `tf.size`, `tf.shape(x)[0]`,
  and so every `tf.compat.v1.losses` / Keras reduction).

  Outside a towered model_fn (a plain model_fn, one tower) it does nothing.

  Args:
    denominator: a scalar Tensor, this shard's value.

  Returns:
    `denominator` itself.

  Raises:
    ValueError: if `denominator` is not a scalar Tensor.

  Example:
      ```python
      tokens = tf.squeeze(tf.matmul(mask_rows, ones_column))   # a count the library cannot read
      loss = tf.reduce_sum(xent * mask) / estimator_towers.loss_denominator(tokens)
      ```
  """
  if not isinstance(denominator, tf.Tensor) or denominator.shape.rank not in (None, 0):
    raise ValueError(
        f'loss_denominator(d) takes the scalar Tensor the loss divides by (a '
        f'count of tokens, a sum of weights), got {denominator!r}. Reduce it '
        f'first, e.g. loss_denominator(tf.reduce_sum(weights)).')
  if tower_context.current_tower().num_towers > 1:
    with _lock:
      _declared.setdefault(denominator.graph, set()).add(denominator.name)
  return denominator


def _is_declared(tensor: tf.Tensor) -> bool:
  with _lock:
    return tensor.name in _declared.get(tensor.graph, ())


is_declared = _is_declared   # for row_dependence's readers


class Dependence:
  """Which tensors depend on the shard's inputs or read given variables."""

  def __init__(self, inputs: Sequence[tf.Tensor], variables: Sequence[Any] = ()):
    self.input_tensors = list(inputs)
    self.inputs = {t.op.name for t in inputs if isinstance(t, tf.Tensor)}
    tensors = [t for t in inputs if isinstance(t, tf.Tensor)]
    # of a sync point's table, this shard's tower's part only (`base.tower_parts`)
    self.skip = tower_parts.others(tensors[0].graph, [t.name for t in tensors]) if tensors else None
    self._variables = set()
    for v in variables:
      handle = getattr(v, 'handle', None)
      self._variables.add((handle if handle is not None else v).op.name)
    self._memo: dict = {}

  def of(self, tensor: tf.Tensor, values: bool = False) -> tuple[bool, bool]:
    """(depends on the shard, reads a trained variable), over the ancestors.

    With `values`, only through the shard's values: a path through a Shape,
    Size, Rank, OnesLike or ZerosLike (the shard's shape) does not count.
    """
    key = (tensor.op.name, values)
    if key not in self._memo:
      self._memo[key] = _search(tensor.op, self.inputs, self._variables, values, draws=True,
                                skip=self.skip)
    return self._memo[key]

  def shard(self, tensor: tf.Tensor) -> bool:
    return self.of(tensor)[0]


def _search(start: tf.Operation, inputs: set, variables: set, values: bool,
            draws: bool = False, skip: Callable | None = None) -> tuple[bool, bool]:
  """(reaches an op of `inputs`, reaches one of `variables`); `draws`: a keyed draw counts
  as the shard's inputs (values of its examples, by their positions); `skip(op)`: inputs of
  a sync point's table that are other towers' parts, not followed."""
  shard = variable = False
  pending, seen = [start], set()
  while pending and len(seen) < _SEARCH_LIMIT and not (shard and variable):
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if draws and keyed.built_by_draws(op):
      shard = True
      continue
    shard = shard or op.name in inputs
    variable = variable or op.name in variables
    if not (values and op.type in SHAPE_OPS):
      _extend(pending, op, skip)
    pending.extend(op.control_inputs)
  return shard, variable


def _extend(pending: list, op: tf.Operation, skip: Callable | None) -> None:
  """`pending` plus the ops of `op`'s inputs, but other towers' parts of a table (`skip`)."""
  others = skip(op) if skip is not None else ()
  pending.extend(t.op for i, t in enumerate(op.inputs) if i not in others)


def depends_on(tensor: tf.Tensor, op_names: set) -> bool:
  """True if `tensor`'s value (not only its shape) is computed from an op named in `op_names`."""
  return _search(tensor.op, op_names, set(), True)[0]


def _one_element(tensor: tf.Tensor) -> bool:
  return tensor.shape.is_fully_defined() and tensor.shape.num_elements() == 1


def _is_batch_size(tensor: tf.Tensor) -> bool:
  """True for tf.shape(x)[0]: a StridedSlice of element 0 of a Shape."""
  op = tensor.op
  if op.type != 'StridedSlice' or op.inputs[0].op.type != 'Shape' or tensor.shape.rank != 0:
    return False
  begin, end = tf.get_static_value(op.inputs[1]), tf.get_static_value(op.inputs[2])
  return begin is not None and end is not None and list(begin) == [0] and list(end) == [1]


@dataclasses.dataclass
class Statistic:
  """One additive per-shard value a leaf is made of.

  Attributes:
    key: unique within the expression.
    source: tower 0's tensor the statistic is made from.
    counts: an element count (depends on the shard only through its shape).
    trained: depends on a trained variable (a numerator).
    per_example: for a count, proportional to the shard's examples (no
      `tf.boolean_mask` or other op whose rows depend on values made it).
    reduce: the statistic from a shard's counterpart of `source` (None: itself).
  """
  key: str
  source: tf.Tensor
  counts: bool
  trained: bool
  reduce: str | None = None   # None, 'sum' or 'size'
  per_example: bool = True

  def of(self, source: tf.Tensor) -> tf.Tensor:
    """This statistic of a shard whose counterpart of `source` is `source`."""
    if self.reduce is None:
      return source
    with tf.compat.v1.get_default_graph().colocate_with(source.op):
      if self.reduce == 'sum':
        return tf.reduce_sum(source)
      return tf.cast(tf.size(source), source.dtype)


@dataclasses.dataclass
class Leaf:
  """A one-element tensor of tower 0's loss that is a function of statistics."""
  tensor: tf.Tensor
  statistics: list   # [Statistic]
  mean: bool = False  # tensor = sum / count of its two statistics

  def whole(self, totals: dict) -> tf.Tensor:
    if not self.mean:
      return totals[self.statistics[0].key]
    value = totals[self.statistics[0].key] / totals[self.statistics[1].key]
    return tf.reshape(value, self.tensor.shape) if self.tensor.shape.rank else value


@dataclasses.dataclass
class Expression:
  """Tower 0's loss as f(statistics, shard-independent terms)."""
  loss: tf.Tensor
  leaves: dict          # tensor name -> Leaf
  dependence: Dependence

  @property
  def statistics(self) -> list:
    return [s for leaf in self.leaves.values() for s in leaf.statistics]

  def rebuild(self, totals: dict) -> tf.Tensor:
    """f on the whole batch: each statistic replaced by its total (key -> tensor)."""
    memo: dict = {}

    def build(t: tf.Tensor) -> tf.Tensor:
      if t.name in memo:
        return memo[t.name]
      leaf = self.leaves.get(t.name)
      if leaf is not None:
        out = leaf.whole(totals)
      elif not self.dependence.shard(t):
        out = t   # counted once: tower 0's
      else:
        out = copy_op(t.op, [build(i) for i in t.op.inputs]).outputs[t.value_index]
      memo[t.name] = out
      return out

    return build(self.loss)


def copy_op(op: tf.Operation, inputs: Sequence[tf.Tensor]) -> tf.Operation:
  """A new op like `op` (type and attributes) on `inputs`, in the current scopes."""
  attrs = {k: v for k, v in op.node_def.attr.items() if not k.startswith('_')}
  return op.graph.create_op(op.type, list(inputs), [o.dtype for o in op.outputs],
                            attrs=attrs, name=op.type)


@dataclasses.dataclass
class Analysis:
  """What `analyse` found: the rule for the whole-batch loss.

  Attributes:
    rule: 'mean' (towers weighted by their share of the examples), 'sum'
      (towers add up) or 'rebuild' (`expression` on the whole batch's totals).
    expression: for 'rebuild'.
    exact: False when the rule is a fallback for an unrecognised loss.
  """
  rule: str
  expression: Expression | None = None
  exact: bool = True


class _Unrecognised(Exception):
  def __init__(self, op: tf.Operation, why: str):
    super().__init__(why)
    self.op, self.why = op, why


class _Parser:
  """Tower 0's loss -> leaves, or `_Unrecognised` naming the op."""

  def __init__(self, dependence: Dependence, auto: bool, static_count: Callable | None,
               batch_norms: Callable[[tf.Tensor], bool] = lambda t: False,
               rows: Callable[[tf.Tensor], bool] = lambda t: False):
    self.dependence = dependence
    self.batch_norms = batch_norms
    self.rows = rows
    self.auto = auto
    self.static_count = static_count
    self.leaves: dict = {}
    self._seen: set = set()
    self._nested: dict = {}

  def visit(self, t: tf.Tensor) -> None:
    if t.name in self._seen:
      return
    self._seen.add(t.name)
    if _is_declared(t):
      self._leaf(t, [Statistic(t.name, t, False, self.dependence.of(t, values=True)[1])])
      return
    if not self.dependence.shard(t):
      return   # a shard-independent term
    if not self.auto:
      raise _Unrecognised(t.op, 'not declared')
    op = t.op
    if op.type in _SUMS and _one_element(op.inputs[0]):
      self.visit(op.inputs[0])   # a sum of one value (tf.compat.v1.losses sums twice)
      return
    if _one_element(t) and op.type in _SUMS and not self._nests(op.inputs[0]):
      self._reduction_leaf(t)
      return
    if _one_element(t) and (op.type == 'Size' or _is_batch_size(t)):
      self._leaf(t, [Statistic(t.name, t, True, False, per_example=self._per_example(t))])
      return
    if op.type in _REDUCTIONS and not self._nests(op.inputs[0]):
      raise _Unrecognised(op, 'a reduction over the batch other than a sum or a mean')
    if op.type not in _ELEMENTWISE and op.type not in _REDUCTIONS:
      raise _Unrecognised(op, 'an op that is not elementwise arithmetic on statistics')
    if op.type in _DIVISIONS:
      self._constant_divisor(op.inputs[1])
    for i in op.inputs:
      self.visit(i)

  def _constant_divisor(self, d: tf.Tensor) -> None:
    """A divisor that is the shard's static element count is a count statistic.

    With a static batch, `tf.size(x)` and `tf.ones_like(x)` of a shard
    tensor are constants of the graph: `static_count` tells them from a
    hyper-parameter by comparing the shards' values.
    """
    if (self.static_count is not None and d.name not in self.leaves
        and not self.dependence.shard(d) and _one_element(d) and self.static_count(d)):
      self._seen.add(d.name)
      self._leaf(d, [Statistic(d.name, d, True, False)])

  def _reduction_leaf(self, t: tf.Tensor) -> None:
    op = t.op
    x = op.inputs[0]
    counts = not self.dependence.of(t, values=True)[0]
    trained = self.dependence.of(x, values=True)[1] and not counts
    per_example = self._per_example(x)
    if op.type == 'Sum':
      self._leaf(t, [Statistic(t.name, t, counts, trained, per_example=per_example)])
    else:
      self._leaf(t, [Statistic(t.name + ':sum', x, counts, trained, 'sum'),
                     Statistic(t.name + ':count', x, True, False, 'size', per_example)],
                 mean=True)

  def _leaf(self, t: tf.Tensor, statistics: list, mean: bool = False) -> None:
    self.leaves[t.name] = Leaf(t, statistics, mean)

  def _per_example(self, x: tf.Tensor) -> bool:
    """False if an op whose rows depend on values (tf.boolean_mask's Where) made `x`, unless
    the row reader reads `x` as rows (a lookup of sparse ids summed back per example)."""
    if self.rows(x):
      return True
    pending, seen = [x.op], set()
    while pending and len(seen) < _SEARCH_LIMIT:
      op = pending.pop()
      if op.name in seen:
        continue
      seen.add(op.name)
      if op.type in _VALUE_SHAPED and self.dependence.shard(op.outputs[0]):
        return False
      if not keyed.built_by_draws(op):   # a keyed draw has one value per example
        _extend(pending, op, self.dependence.skip)
    return True

  def _nests(self, x: tf.Tensor) -> bool:
    """True if `x` is computed from a one-element reduction of the shard's values.

    Such an `x` is not per-example (a stack of losses, values divided by
    their batch's sum), so a sum of it is not a sum of the shards' sums. A
    value of the batch's size (the row reader's: a SparseTensor's dense shape
    reduced to its example count) shapes rows, not their values; a
    batch norm's statistic does not count either: rows it normalises stay rows
    (`row_dependence`; with `sync_batch_norm` the global batch's, whose
    count a synchronised batch norm sums to one element).
    """
    if x.op.name in self._nested:
      return self._nested[x.op.name]
    found = False
    pending, seen = [x.op], set()
    while pending and len(seen) < _SEARCH_LIMIT and not found:
      op = pending.pop()
      if op.name in seen:
        continue
      seen.add(op.name)
      if op.type in _REDUCTIONS and op.outputs and _one_element(op.outputs[0]) and (
          not self.batch_norms(op.outputs[0])):
        found = self.dependence.of(op.outputs[0], values=True)[0]
      if not keyed.built_by_draws(op):   # a keyed draw's own arithmetic is no statistic
        _extend(pending, op, self.dependence.skip)
    self._nested[x.op.name] = found
    return found


def analyse(loss: Any, inputs: Sequence[tf.Tensor], variables: Sequence[Any],
            loss_reduction: str, fallback: Callable[[], str],
            static_count: Callable[[tf.Tensor], bool] | None = None,
            targets: Sequence[tf.Tensor] | None = None, micro_batches: bool = False,
            note: str | None = None) -> Analysis:
  """The rule for the whole-batch loss of tower 0's `loss` (see the module doc).

  Args:
    loss: tower 0's loss (what gradients are asked of).
    inputs: tower 0's shard tensors, flattened.
    variables: the trained variables.
    loss_reduction: the plan's: 'auto', 'exact', 'mean' or 'sum'.
    fallback: the example-count rule's reduction ('mean' or 'sum') for a
      loss the algebra does not rebuild (the recorded reduction).
    static_count: for a shard-independent one-element divisor, whether it
      is the shard's element count made a constant by a static batch.
    targets: what the request differentiates, if not `loss` alone (read for
      ops that mix the batch's rows: `row_dependence`).
    micro_batches: whether the shards are micro-batches.
    note: why the whole batch's head of a mixing loss could not be built.

  An op that mixes the batch's rows is `row_dependence`'s to report (one
  warning, or an error); the algebra then says nothing more of the loss.

  Raises:
    ValueError: with loss_reduction='exact', for a loss that cannot be rebuilt
      or that mixes the batch's rows; with micro-batches, for one that mixes.
  """
  rows = row_dependence.check(targets if targets is not None else [loss], inputs,
                              loss_reduction, micro_batches, _is_declared, note)
  auto = loss_reduction in ('auto', 'exact')
  if not isinstance(loss, tf.Tensor) or not _one_element(loss):
    return Analysis(loss_reduction if not auto else fallback(), exact=not auto)
  dependence = Dependence(inputs, variables)
  parser = _Parser(dependence, auto, static_count, functools.partial(_batch_norms, rows),
                   functools.partial(_rows, rows))
  try:
    parser.visit(loss)
  except _Unrecognised as unrecognised:
    if not auto:
      return Analysis(loss_reduction)
    rule = fallback()
    if not rows.mixing:
      _report(loss, unrecognised, rule, strict=loss_reduction == 'exact')
    return Analysis(rule, exact=False)
  expression = Expression(loss, parser.leaves, dependence)
  if not auto:
    declared = any(_is_declared(leaf.tensor) for leaf in parser.leaves.values())
    return Analysis('rebuild', expression) if declared else Analysis(loss_reduction)
  form = _form(expression, loss)
  if form in ('mean', 'const'):
    return Analysis('mean')
  if form == 'sum':
    return Analysis('sum')
  return Analysis('rebuild', expression)


def read_quietly(value: Any, inputs: Sequence[tf.Tensor],
                 static_count: Callable[[tf.Tensor], bool] | None = None) -> Analysis | None:
  """The rule of a scalar that is not the loss (one a summary or a hook reads), or None
  where the algebra does not read it; nothing is reported. Its rule 'const': the value
  does not depend on the shard (tower 0's is every tower's)."""
  if not isinstance(value, tf.Tensor) or not _one_element(value) or not value.dtype.is_floating:
    return None
  dependence = Dependence(inputs, ())
  parser = _Parser(dependence, True, static_count, lambda t: False)
  try:
    parser.visit(value)
  except _Unrecognised:
    return None
  expression = Expression(value, parser.leaves, dependence)
  form = _form(expression, value)
  return Analysis(form) if form in ('mean', 'sum', 'const') else Analysis('rebuild', expression)


def _rows(rows: row_dependence.RowDependence, t: tf.Tensor) -> bool:
  """True for rows of the shard's examples (the row reader's reading of `t`)."""
  kind = rows.kind(t)
  return kind is not None and kind.tag == row_dependence.ROWS


def _batch_norms(rows: row_dependence.RowDependence, t: tf.Tensor) -> bool:
  """True for a batch norm's statistic, a value of the batch's size or one of values the same
  on every shard (the row reader's reading of `t`: a SparseTensor's dense shape's product, the
  examples or the entries per example it reshapes to) or a loop's bound."""
  kind = rows.kind(t)
  if kind is None and t.op.inputs and rows.kinds.get(t.op.inputs[0].name, 0) is None:
    return True   # of values the reader found the same on every shard (a dense shape's sizes)
  return kind is not None and (kind.tag == row_dependence.STAT and kind.norm or (
      kind.tag in (row_dependence.SIZE, row_dependence.BOUND)))  # BOUND: rows don't depend on it


def _form(expression: Expression, t: tf.Tensor) -> str | None:
  """'mean', 'sum' or 'const' if the example-count rule of that name is exact for `t`.

  'mean': a combination of means (a reduce_mean, a sum over one element
  count) and shard-independent terms with shard-independent coefficients;
  'sum': a combination of sums with shard-independent coefficients and no
  shard-independent term.
  """
  leaf = expression.leaves.get(t.name)
  if leaf is None and not expression.dependence.shard(t):
    return 'const'
  if leaf is not None:
    if leaf.mean:
      return 'mean' if leaf.statistics[1].per_example else None
    statistic = leaf.statistics[0]
    return None if statistic.counts or _is_declared(t) else 'sum'
  op = t.op
  if op.type in ('Identity', 'Cast', 'Neg', 'Reshape', 'Squeeze', 'ExpandDims') or (
      op.type in _SUMS and _one_element(op.inputs[0])):
    return _form(expression, op.inputs[0])
  if op.type in ('Add', 'AddV2', 'Sub', 'AddN'):
    forms = {_form(expression, i) for i in op.inputs}
    if forms <= {'mean', 'const'}:
      return 'mean'
    return 'sum' if forms == {'sum'} else None
  if op.type == 'Mul':
    a, b = (_form(expression, i) for i in op.inputs)
    if a == 'const' or b == 'const':
      return b if a == 'const' else a
    return None
  if op.type in ('RealDiv', 'Div', 'DivNoNan'):
    a, b = (_form(expression, i) for i in op.inputs)
    if b == 'const':
      return a
    if a == 'sum' and _one_count(expression, op.inputs[1]):
      return 'mean'
  return None


def _one_count(expression: Expression, t: tf.Tensor) -> bool:
  """True if `t` is one element count, through casts."""
  while t.op.type in ('Identity', 'Cast') and t.name not in expression.leaves:
    t = t.op.inputs[0]
  leaf = expression.leaves.get(t.name)
  return (leaf is not None and not leaf.mean and leaf.statistics[0].counts
          and leaf.statistics[0].per_example and not _is_declared(t))


def _report(loss: tf.Tensor, unrecognised: _Unrecognised, rule: str, strict: bool) -> None:
  op = unrecognised.op
  instead = ('the mean of the towers\' losses weighted by their share of the '
             'examples' if rule == 'mean' else 'the sum of the towers\' losses')
  message = (
      f'estimator_towers: the loss {loss.name} is computed from {op.type} op '
      f'{op.name!r} ({unrecognised.why}), which the loss algebra cannot rebuild '
      f'for the whole batch from the shards\' statistics (it recognises sums, '
      f'means, sizes and batch sizes combined by elementwise arithmetic; see '
      f'estimator_towers.loss_algebra). The towers compute {instead} instead, '
      f'which equals the single-device loss only if {op.name} over the whole '
      f'batch is that combination of its values on the shards.')
  advice = (' If the op divides by a sum over the batch, declare that sum with '
            'estimator_towers.loss_denominator(d).')
  if strict:
    raise ValueError(message + advice + " loss_reduction='exact' makes this an "
                     "error; use loss_reduction='auto' to train with the rule above.")
  logs.warning_once(message + advice + " Pass loss_reduction='exact' to make "
                    "this an error.", key=f'loss_algebra:{op.name}')
