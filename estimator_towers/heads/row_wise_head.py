"""A head made of rows: each tower computes its own rows against the gathered columns.

The rule. Where the whole-batch head (`whole_batch_head`) is made of rows
(a softmax per row over the whole batch's columns, then a mean of the rows'
values), each tower computes its own rows, as OpenCLIP's local loss does,
so that no device holds a B x B tensor:

- *local rows*: row i of a head tensor is the whole batch's row
  offset_k + i, computed by tower k on its device for its own rows only.
  A frontier tensor's local rows are the tower's own (not gathered); a
  matrix product `a @ b^T` with `a` local rows is `a_k @ B^T` against the
  gathered columns `B` (n_k x B), and so is an einsum whose output leads
  with a local operand's batch letter (`ab,cb->ac`: q_k against the
  gathered d; `bqd,nd->bqn`; an operand whose letter is its second, of a
  matrix, gives its transpose's rows); elementwise ops, a cross-entropy
  per row of a matrix, a softmax over the last axis (of any rank),
  reductions and concatenations along other axes than the rows', a
  one-hot of local rows, a reshape that keeps every row (a vector to a
  vector, [n, C] to [-1, C]), a `tf.ones_like` of local rows keep local
  rows; a `tf.range(batch)` of the whole batch's size (the labels of an
  in-batch softmax) is the local range offset_k + range(n_k). The transpose of a
  product `a @ b^T` has the rows of `b @ a^T` (an einsum's, those of its
  output letters swapped), so CLIP's column term is row-wise too.
- *whole*: the gathered frontier columns (on the first tower's device,
  all-gathered across workers), the whole batch's sizes and shapes, values
  of no shard (a trained temperature), and the *tail*: the per-row values
  (a vector of B numbers, gathered from the towers' local rows) and what is
  computed from them (the mean over the rows, sums of terms), once, on the
  first tower's device.

Anything else (an op of the head these rules do not know, a B x B value
the tail would need, the tail reading the frontier itself) is not row-wise:
the head then runs once, on the first tower's device (`whole_batch_head`).

Gradients. The tail's gradient with respect to the per-row values is cut
into each tower's rows and seeds its local part; each local part's backward
pass gives the gradient with respect to its own rows and to the gathered
columns, and the columns' gradients of every tower (every worker's, across
workers) are summed once, never a local-only or 1/N share, before each
tower's rows of them join its seeds. The values of no shard the head reads
(the temperature) are seeded in the first tower's backward pass with the
sum of the local parts' gradients and the tail's (the tail's on the first
worker only), so each is counted once. A tail linear in the per-row values
(a mean, a weighted sum of means) has coefficients their values do not
change: taken on stand-ins of the whole batch's shape, they seed each
tower's rows without waiting for the other towers' per-row values, which
only the loss's value (and a trained weight's gradient) gathers.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from estimator_towers.base import shapes
from estimator_towers.heads import whole_batch_head as wbh
from estimator_towers.rows import row_dependence as rd

# Applied elementwise (with broadcasting): local rows in, local rows out.
_ELEMENTWISE = rd.ARITHMETIC
# Within each row of a matrix (over its last axis).
_PER_ROW = frozenset(('Softmax', 'LogSoftmax', 'SparseSoftmaxCrossEntropyWithLogits',
                      'SoftmaxCrossEntropyWithLogits'))
# Over the last axis of any rank (the cross-entropies: of a matrix only).
_LAST_AXIS = frozenset(('Softmax', 'LogSoftmax'))
_REDUCTIONS = frozenset(('Sum', 'Mean', 'Max', 'Min', 'Prod'))


class NotRowWise(Exception):
  """The head is not made of rows (the message says where)."""


def build(found: rd.RowDependence, loss: tf.Tensor, grad_y: Any, find: Callable,
          frontier: list, shapes: list, per_shard: list, sizes: Sequence, nonempty: Sequence,
          batch: Any, across: Any) -> tuple[tf.Tensor, list, list, str] | str:
  """The head split into the towers' local rows and the tail (see the module docstring).

  Args: as `whole_batch_head.build`'s `split`.

  Returns:
    (whole-batch loss, per shard (ys, initial gradients), [] (no pass of the
    loss itself is needed), where it runs), or a sentence saying why not.
  """
  split = Split(found, find, frontier, shapes, per_shard, sizes, nonempty, batch, across,
                 loss.op.device)
  try:
    whole = split.whole(loss)
  except NotRowWise as why:
    return str(why)
  if not split.tail:
    return 'no per-row values'
  return _seeds(split, whole, grad_y, per_shard)


def _seeds(split: Split, whole: tf.Tensor, grad_y: Any, per_shard: list
           ) -> tuple[tf.Tensor, list, list, str] | str:
  """Two backward passes: the tail's to the per-row values, the local parts' from them."""
  rows = [r for parts in split.tail for r in parts]
  outside = [t for _, t in split.outside.values()]
  everything = [t for shard in per_shard for t in shard]
  tail = split.tail_gradients(whole, grad_y, everything, 'row_wise_head/tail_gradients')
  if isinstance(tail, str):
    return tail
  tail_rows, tail_outside = tail
  linear = _linear_coefficients(split, whole, grad_y)
  seeded = [(r, g) for r, g in zip(rows, linear or tail_rows) if g is not None]
  with tf.device(split.device), tf.name_scope('row_wise_head/local_gradients'):
    local = tf.compat.v1.gradients([r for r, _ in seeded], everything + outside,
                                   grad_ys=[g for _, g in seeded],
                                   stop_gradients=everything + outside,
                                   colocate_gradients_with_ops=True)
  seeds = wbh.shard_seeds(per_shard, per_shard, local)
  seed_outside(seeds, [(k, t, mine, theirs) for (k, t), mine, theirs in zip(
      split.outside.values(), local[len(everything):], tail_outside)], split.across)
  where = (f'row-wise: each tower its own rows against the gathered columns, the mean over '
           f'the rows on {split.device or "the first tower"}')
  return whole, seeds, [], where


def seed_outside(seeds: list, outside: list, across: Any) -> None:
  """Values of no shard (a temperature) join shard k's seeds: per (k, value, the local
  parts' gradient, the tail's), their sum, the tail's counted on the first worker only
  (zeros on the others: every worker's seeds alike)."""
  first_worker = across is None or across.rank == 0
  for k, t, mine, theirs in outside:
    parts = [tf.convert_to_tensor(g) for g in (mine, theirs) if g is not None]
    if not parts:
      continue
    with tf.device(t.op.device):
      if theirs is not None and not first_worker:
        parts[-1] = tf.zeros_like(parts[-1])
      seeds[k][0].append(t)
      seeds[k][1].append(tf.add_n(parts))


def _linear_coefficients(split: Split, whole: tf.Tensor, grad_y: Any) -> list | None:
  """The tail's gradient with respect to each tower's per-row values, where it is linear.

  A tail linear in the per-row values (a mean of them, a weighted sum of
  means, even with a trained weight) has a gradient with respect to them
  that their values do not change: it is taken on stand-ins (zeros of the
  whole batch's shape, from the shards' sizes), so each tower's backward
  pass starts from its own rows' coefficients without waiting for the other
  towers' per-row values (only the loss's value gathers them). None where
  the gradient reads a stand-in's values (the tail is not linear).
  """
  stand_ins = {}
  with tf.device(split.device), tf.name_scope('row_wise_head/coefficients'):
    for value in split.gathered:
      if not value.shape[1:].is_fully_defined():
        return None
      shape = tf.concat([tf.reshape(tf.cast(split.total(), tf.int32), [1]),
                         tf.constant(value.shape[1:].as_list(), tf.int32)], 0)
      stand_ins[value.name] = tf.zeros(shape, value.dtype)
    tail = split.tail_names()
    copy = _copied(whole, stand_ins, tail, {})
    coefficients = tf.compat.v1.gradients(copy, list(stand_ins.values()),
                                          grad_ys=None if grad_y is None else [grad_y])
  if _reads_values(coefficients, {t.name for t in stand_ins.values()}) or any(
      shapes.dim(part) not in (None, n) for parts in split.tail
      for part, n in zip(parts, split.sizes) if isinstance(n, int)):
    return None   # not linear, or a tower's per-row values are not one per row
  per_part = []
  for g, parts in zip(coefficients, split.tail):
    g = None if g is None else tf.convert_to_tensor(g)
    for k, part in enumerate(parts):
      if g is None:
        per_part.append(None)
        continue
      with tf.device(split.device), tf.name_scope('row_wise_head/coefficients'):
        start = split.offset_of(k)
        per_part.append(g[start:start + tf.cast(split.sizes[k], tf.int32)])
  return per_part


def _copied(t: tf.Tensor, stand_ins: dict, tail: set, done: dict) -> tf.Tensor:
  """`t` again, the tail's ops copied onto the stand-ins (the rest read as they are)."""
  if t.name in stand_ins:
    return stand_ins[t.name]
  if t.name not in tail:
    return t
  if t.name not in done:
    inputs = [_copied(i, stand_ins, tail, done) for i in t.op.inputs]
    copy = wbh.copy_op(t.op, inputs)
    for a, b in zip(t.op.outputs, copy.outputs):
      done[a.name] = b
  return done[t.name]


def _reads_values(tensors: list, stand_ins: set) -> bool:
  """Does any of `tensors` read a stand-in's values (not only its shape)?"""
  seen, todo = set(), [t for t in tensors if t is not None]
  while todo:
    t = todo.pop()
    if t.name in stand_ins:
      return True
    if t.name in seen or t.op.type in ('Shape', 'ShapeN', 'Size', 'Rank'):
      continue
    seen.add(t.name)
    todo.extend(t.op.inputs)
  return False


class Split:
  """Builds a head tensor's whole value or a tower's local rows of it (or of its transpose)."""

  def __init__(self, found, find, frontier, shapes, per_shard, sizes, nonempty, batch, across,
               device):
    self.found, self.sizes, self.nonempty, self.batch = found, sizes, nonempty, batch
    self.find = find
    self.across, self.device, self.per_shard = across, device, per_shard
    self.frontier = {t.name: j for j, t in enumerate(frontier)}
    self.shapes = {t.name for t in shapes}
    self.tail: list = []         # per tail input: every tower's local rows of it
    self.gathered: list = []     # per tail input: its gathered value (the whole batch's rows)
    self.outside: dict = {}      # name -> (shard, value of no shard the head reads)
    self._whole: dict = {}       # name -> (value, origins: 'tail' / 'columns')
    self._rows: list = [{} for _ in per_shard]
    self._local = 0              # > 0: building a tower's local rows
    self._tower = 0              # whose local rows are being built
    self._offset = None
    self._total = None

  def tail_gradients(self, whole: tf.Tensor, grad_y: Any, everything: list, scope: str
                     ) -> tuple[list, list] | str:
    """The tail's gradient with respect to every tower's per-row values (in `tail`'s
    order) and to the values of no shard (in `outside`'s), or why the head is not
    row-wise (the tail reads the frontier tensors `everything` itself)."""
    rows = [r for parts in self.tail for r in parts]
    outside = [t for _, t in self.outside.values()]
    with tf.device(self.device), tf.name_scope(scope):
      grads = tf.compat.v1.gradients(whole, rows + outside + everything,
                                     grad_ys=None if grad_y is None else [grad_y],
                                     stop_gradients=rows + outside + everything,
                                     colocate_gradients_with_ops=True)
    if any(g is not None for g in grads[len(rows) + len(outside):]):
      return 'the tail after the per-row values reads the frontier itself'
    return grads[:len(rows)], grads[len(rows):len(rows) + len(outside)]

  def tail_names(self) -> set:
    """The names of the whole values built so far that are the tail's (computed from the
    per-row values)."""
    return {v.name for v, origins in self._whole.values() if 'tail' in origins}

  def whole(self, t: tf.Tensor) -> tf.Tensor:
    if self.found.kind(t) is None:
      return self._outside(t)
    if self._local and t.name in self.frontier and self.across is None:
      return self._columns_on(self._tower, t)
    if t.name not in self._whole:
      with tf.device(self.device), tf.name_scope('row_wise_head/whole/'):
        self._whole_of(t)
    value, origins = self._whole[t.name]
    if self._local and 'tail' in origins:
      raise NotRowWise(f'a local row reads {t.name}, a value of every row')
    if not self._local and 'columns' in origins:
      raise NotRowWise(f'the tail reads {t.name}, a value of the gathered columns')
    return value

  def _outside(self, t: tf.Tensor) -> tf.Tensor:
    """A value of no shard (a trained temperature): the tower's own counterpart in its rows.

    Seeded in that tower's backward pass (the tail's: in the first tower's),
    so that every tower's seeds have the same tensors (a copied tower's pass
    stays a copy). Constants are not seeded.
    """
    if not t.dtype.is_floating or tf.get_static_value(t) is not None:
      return t
    k = self._tower if self._local else 0
    mine = t if k == 0 else (self.find(k, t) if self.find is not None else None)
    if mine is None:
      k, mine = 0, t
    self.outside.setdefault(mine.name, (k, mine))
    return mine

  def _whole_of(self, t: tf.Tensor) -> None:
    kind = self.found.kind(t)
    if t.name in self.frontier:
      self._whole[t.name] = (self._columns(t, kind), {'columns'})
    elif t.name in self.shapes:
      self._whole[t.name] = (wbh.whole_shape(t, self.found.kind(t.op.inputs[0]), self.batch),
                             set())
    elif kind.tag == rd.MIXED and _per_row(t):
      value = self._gather_rows(t)
      self.gathered.append(value)
      self._whole[t.name] = (value, {'tail'})
    else:
      self._copy_whole(t, kind)

  def _copy_whole(self, t: tf.Tensor, kind: rd.Kind) -> None:
    rank = t.shape.rank
    if t.op.type in ('Shape', 'Size', 'Rank'):   # of a whole value: small
      pass
    elif rank is None or (rank > 1 and kind.tag not in (rd.COLS, rd.STAT)) or (
        rank == 1 and kind.tag == rd.MIXED) or kind.tag in (rd.ROWS, rd.FLAT):
      raise NotRowWise(f'{t.name} ({t.op.type}) is not a row of the head')
    inputs = [self.whole(i) for i in t.op.inputs]
    origins = set()
    for i in t.op.inputs:
      origins |= self._whole[i.name][1] if i.name in self._whole else set()
    copy = wbh.copy_op(t.op, inputs)
    for a, b in zip(t.op.outputs, copy.outputs):
      self._whole[a.name] = (b, origins)

  def _columns(self, t: tf.Tensor, kind: rd.Kind) -> tf.Tensor:
    """The towers' rows of frontier tensor `t`, gathered: the columns every tower reads.

    One row per example: each shard's own rows, cut once on its own device
    (`_own_rows`), concatenated; their gradients add up there before the cut's.
    """
    j = self.frontier[t.name]
    if kind.tag == rd.ROWS and kind.blocks == 1:
      parts = [self._own_rows(k, j) for k in range(len(self.per_shard))]
      value = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
    else:
      value = wbh.gathered([s[j] for s in self.per_shard], kind, self.sizes, self.nonempty)
    if self.across is not None:
      value = wbh.across_workers(value, kind, self.across, summed=True)
    return value

  def _columns_on(self, k: int, t: tf.Tensor) -> tf.Tensor:
    """Frontier tensor `t`'s columns gathered on tower k's device (its local rows read them).

    Each tower receives the other towers' rows straight from them (an
    all-gather: (N - 1) / N of the columns per tower), not through the first
    tower; their gradients go back the same way and add up on their owners.
    """
    key = (t.name, 'columns')
    if key not in self._rows[k]:
      self._rows[k][key] = self._columns(t, self.found.kind(t))   # under tower k's device
    return self._rows[k][key]

  def _gather_rows(self, t: tf.Tensor) -> tf.Tensor:
    """The per-row values of `t`: every tower's local rows, in input order (a tail input)."""
    parts = [self.rows(k, t) for k in range(len(self.per_shard))]
    self.tail.append(parts)
    value = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
    if self.across is not None:
      value = wbh.across_workers(value, rd.Kind(rd.ROWS), self.across)
    return value

  # -- A tower's local rows --------------------------------------------------

  def rows(self, k: int, t: tf.Tensor, transposed: bool = False) -> tf.Tensor:
    """Tower k's rows of `t` (of its transpose, with `transposed`)."""
    key = (t.name, transposed)
    if key not in self._rows[k]:
      device = self.per_shard[k][0].op.device if self.per_shard[k] else self.device
      self._local += 1
      tower, self._tower = self._tower, k
      try:
        with tf.device(device), tf.name_scope(f'row_wise_head/tower_{k}/'):
          self._rows[k][key] = (self._transposed(k, t) if transposed else self._rows_of(k, t))
      finally:
        self._local -= 1
        self._tower = tower
    return self._rows[k][key]

  def _rows_of(self, k: int, t: tf.Tensor) -> tf.Tensor:
    op = t.op
    if t.name in self.frontier:
      return self._own(k, t)
    if self.found.kind(t) is None:
      raise NotRowWise(f'{t.name} is not rows')
    if op.type in _ELEMENTWISE:
      return self._elementwise(k, op, t)
    if op.type in _PER_ROW and (op.inputs[0].shape.rank == 2 or op.type in _LAST_AXIS and (
        op.inputs[0].shape.rank or 0) > 2):
      return self._copy(k, op, [self.rows(k, i) for i in op.inputs], t)
    if op.type == 'MatMul' and not op.get_attr('transpose_a'):
      return tf.matmul(self.rows(k, op.inputs[0]), self.whole(op.inputs[1]),
                       transpose_b=op.get_attr('transpose_b'))
    if op.type == 'Einsum':
      return self._einsum(k, op, transposed=False)
    if op.type == 'Transpose' and _swaps(op):
      return self.rows(k, op.inputs[0], transposed=True)
    if op.type in _REDUCTIONS and 0 not in _axes(op, op.inputs[1]):
      return self._copy(k, op, [self.rows(k, op.inputs[0]), op.inputs[1]], t)
    if op.type == 'ConcatV2' and 0 not in _axes(op, op.inputs[-1], op.inputs[0]):
      return self._copy(k, op, [self.rows(k, i) for i in op.inputs[:-1]] + [op.inputs[-1]], t)
    if op.type == 'OneHot' and op.get_attr('axis') == -1:
      return self._copy(k, op, [self.rows(k, op.inputs[0])]
                        + [self.whole(i) for i in op.inputs[1:]], t)
    if op.type == 'Reshape' and _keeps_rows(op):
      return self.rows(k, op.inputs[0])
    if op.type == 'Fill' and op.inputs[0].op.type == 'Shape':   # ones_like of local rows
      return tf.fill(tf.shape(self.rows(k, op.inputs[0].op.inputs[0]),
                              out_type=op.inputs[0].dtype), self.whole(op.inputs[1]))
    if op.type == 'Range' and self._batch_range(op):
      offset = self.offset_of(k)
      return tf.range(tf.cast(self.sizes[k], t.dtype), dtype=t.dtype) + tf.cast(offset, t.dtype)
    raise NotRowWise(f'the rows of {t.name} ({op.type}) are not the towers\' own')

  def _transposed(self, k: int, t: tf.Tensor) -> tf.Tensor:
    """Tower k's rows of t^T, for a matrix t."""
    op = t.op
    if t.shape.rank != 2:
      raise NotRowWise(f'{t.name} is not a matrix')
    if op.type == 'MatMul' and not op.get_attr('transpose_a'):   # (a b)^T = b^T a^T
      b = op.inputs[1]
      mine = self.rows(k, b) if op.get_attr('transpose_b') else self.rows(k, b, transposed=True)
      return tf.matmul(mine, self.whole(op.inputs[0]), transpose_b=True)
    if op.type == 'Einsum':
      return self._einsum(k, op, transposed=True)
    if op.type == 'Transpose' and _swaps(op):
      return self.rows(k, op.inputs[0])
    if op.type in _ELEMENTWISE:
      inputs = []
      for i in op.inputs:
        if i.shape.rank == 0:
          inputs.append(self.whole(i))
        elif i.shape.rank == 2 and self.found.kind(i) is not None:
          inputs.append(self.rows(k, i, transposed=True))
        else:
          raise NotRowWise(f'{i.name} does not broadcast over a transpose\'s rows')
      return wbh.copy_op(op, inputs).outputs[t.value_index]
    raise NotRowWise(f'the transpose of {t.name} ({op.type}) is not made of rows')

  def _einsum(self, k: int, op: tf.Operation, transposed: bool) -> tf.Tensor:
    """Tower k's rows of an einsum (of its transposed matrix): the one operand holding
    the output's first letter, once, gives its local rows (of its transpose, where the
    letter is a matrix's second), the others their whole values (the gathered columns)."""
    equation = op.get_attr('equation')
    read = rd.einsum_subscripts(equation.decode() if isinstance(equation, bytes) else equation,
                                [i.shape.rank for i in op.inputs])
    if read is None or not read[1]:
      raise NotRowWise(f'the rows of {op.name}\'s einsum cannot be read')
    operands, output = read[0], read[1][::-1] if transposed else read[1]
    letter = output[0]
    holders = [j for j, sub in enumerate(operands) if letter in sub]
    j = holders[0] if len(holders) == 1 else None
    place = -1 if j is None or operands[j].count(letter) != 1 else operands[j].find(letter)
    if place not in (0, 1) or (place == 1 and len(operands[j]) != 2):
      raise NotRowWise(f'the einsum {op.name} ({operands} -> {output}) does not lead with one '
                       f'operand\'s rows')
    swap = place == 1
    inputs = [self.rows(k, x, transposed=swap) if i == j else self.whole(x)
              for i, x in enumerate(op.inputs)]
    subs = [s[::-1] if i == j and swap else s for i, s in enumerate(operands)]
    return tf.raw_ops.Einsum(inputs=inputs, equation=f'{",".join(subs)}->{output}')

  def _elementwise(self, k: int, op: tf.Operation, t: tf.Tensor) -> tf.Tensor:
    rank = t.shape.rank
    inputs = []
    for i in op.inputs:
      mine = i.shape.rank
      if mine is None or rank is None:
        raise NotRowWise(f'{i.name} has no known rank')
      if mine < rank or mine == 0 or shapes.dim(i) == 1:   # broadcast along the rows
        inputs.append(self.whole(i))
      elif self.found.kind(i) is None:
        raise NotRowWise(f'{i.name}, a value of no shard, has a row per example')
      else:
        inputs.append(self.rows(k, i))
    return self._copy(k, op, inputs, t)

  def _copy(self, k: int, op: tf.Operation, inputs: list, t: tf.Tensor) -> tf.Tensor:
    copy = wbh.copy_op(op, inputs)
    for a, b in zip(op.outputs, copy.outputs):
      self._rows[k].setdefault((a.name, False), b)
    return copy.outputs[t.value_index]

  def _own(self, k: int, t: tf.Tensor) -> tf.Tensor:
    """Shard k's own rows of frontier tensor `t` (without an empty shard's borrowed row)."""
    kind = self.found.kind(t)
    if kind.tag != rd.ROWS or kind.blocks != 1:
      raise NotRowWise(f'{t.name} is not one row per example')
    return self._own_rows(k, self.frontier[t.name])

  def _own_rows(self, k: int, j: int) -> tf.Tensor:
    """Shard k's rows of frontier tensor j, cut once, on shard k's device (a shard whose
    size is a Tensor may hold a borrowed row while empty): its tower and every tower
    that gathers the columns read this one cut."""
    key = ('own rows', j)
    if key not in self._rows[k]:
      part = self.per_shard[k][j]
      if isinstance(self.sizes[k], int):
        self._rows[k][key] = part
      else:
        with tf.device(part.op.device), tf.name_scope(f'row_wise_head/tower_{k}/own_rows/'):
          self._rows[k][key] = part[:tf.cast(self.sizes[k], tf.int32)]
    return self._rows[k][key]

  def _batch_range(self, op: tf.Operation) -> bool:
    """Is `op` tf.range(B), B the whole batch's size read from a tensor of one row per example?"""
    start, delta = (tf.get_static_value(op.inputs[i]) for i in (0, 2))
    limit = op.inputs[1]
    while limit.op.type == 'Cast':
      limit = limit.op.inputs[0]
    if start != 0 or delta != 1 or limit.op.type != 'StridedSlice':
      return False
    shape = limit.op.inputs[0]
    source = self.found.kind(shape.op.inputs[0]) if shape.op.inputs else None
    begin, end, strides = (tf.get_static_value(limit.op.inputs[i]) for i in (1, 2, 3))
    return (shape.name in self.shapes and source is not None and source.blocks == 1
            and _listed(begin) == [0] and _listed(end) == [1] and _listed(strides) == [1]
            and limit.op.get_attr('shrink_axis_mask') == 1)

  def _worker_rows(self) -> None:
    """The index of this worker's first row and the whole batch's row count, once."""
    if self._offset is not None:
      return
    count = sum(self.sizes) if all(isinstance(s, int) for s in self.sizes) else tf.add_n(
        [tf.cast(s, tf.int32) for s in self.sizes])
    self._offset, self._total = 0, count
    if self.across is not None:
      across = self.across
      with tf.device(across.device):
        (counts,) = across.sum([tf.one_hot(across.rank, across.size, dtype=tf.int32)
                                * tf.cast(count, tf.int32)])
        self._offset = tf.reduce_sum(counts[:across.rank])
        self._total = tf.reduce_sum(counts)

  def total(self) -> Any:
    """The whole batch's row count (every worker's), from the shards' sizes alone."""
    self._worker_rows()
    return self._total

  def offset_of(self, k: int) -> Any:
    """The whole batch's index of tower k's first row (the worker's rows come first)."""
    self._worker_rows()
    earlier = list(self.sizes[:k])
    if all(isinstance(s, int) for s in earlier) and isinstance(self._offset, int):
      return self._offset + sum(earlier)
    return tf.add_n([tf.cast(s, tf.int32) for s in earlier + [self._offset]])


def _keeps_rows(op: tf.Operation) -> bool:
  """A Reshape that is the identity: a vector to a vector, or a matrix x to [-1, x's columns].

  (`tf.compat.v1.losses.softmax_cross_entropy` reshapes its logits and labels so.)
  """
  x, shape = op.inputs
  if x.shape.rank == 1 and op.outputs[0].shape.rank == 1:
    return True
  if x.shape.rank != 2 or shape.op.type != 'ConcatV2' or len(shape.op.inputs) != 3:
    return False
  first, columns, axis = shape.op.inputs
  if _listed(tf.get_static_value(first)) != [-1] or _listed(tf.get_static_value(axis)) != [0]:
    return False
  if columns.op.type != 'Slice' or columns.op.inputs[0].op.type != 'Shape':
    return False
  begin, size = columns.op.inputs[1:]
  return (columns.op.inputs[0].op.inputs[0].name == x.name and _last_axis(begin, x)
          and _listed(tf.get_static_value(size)) == [1])


def _last_axis(begin: tf.Tensor, x: tf.Tensor) -> bool:
  """Is `begin` [1], or [rank(x) - 1] for a matrix x?"""
  if _listed(tf.get_static_value(begin)) == [1]:
    return True
  if begin.op.type != 'Pack' or len(begin.op.inputs) != 1:
    return False
  sub = begin.op.inputs[0].op
  if sub.type != 'Sub' or _listed(tf.get_static_value(sub.inputs[1])) != [1]:
    return False
  rank = sub.inputs[0]   # tf.rank(x): a constant where x's rank is known
  return (_listed(tf.get_static_value(rank)) == [2] if rank.op.type == 'Const' else
          rank.op.type == 'Rank' and rank.op.inputs[0].name == x.name)


def _per_row(t: tf.Tensor) -> bool:
  """A vector of one value per row (or [B, 1, ...]): what the tail gathers."""
  return t.shape.rank is not None and t.shape.rank >= 1 and all(d == 1 for d in t.shape[1:])


def _swaps(op: tf.Operation) -> bool:
  return _listed(tf.get_static_value(op.inputs[1])) == [1, 0]


def _axes(op: tf.Operation, axes: tf.Tensor, x: tf.Tensor | None = None) -> set:
  """The axes `op` reduces or concatenates along, made non-negative ({0}: unknown)."""
  value = tf.get_static_value(axes)
  rank = (x if x is not None else op.inputs[0]).shape.rank
  if value is None or rank is None:
    return {0}
  return {int(a) % max(rank, 1) for a in _listed(value)}


def _listed(value: Any) -> list | None:
  if value is None:
    return None
  return [int(v) for v in np.ravel(value)]
