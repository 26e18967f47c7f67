"""The loss's own normaliser: whole-batch losses that divide by something other than B.

Many losses are a ratio `numerator / d` where `d` is not the number of
examples: sum(xent * w) / sum(w) over padded tokens (Transformer), BERT's
masked-LM sum(w * l) / (sum(w) + 1e-5), `tf.compat.v1.losses.*` with weights
(`SUM_BY_NONZERO_WEIGHTS` divides by the count of non-zero weights, `MEAN` by
the sum of weights, both through a `DivNoNan`), Keras losses with
`sample_weight` (`SUM_OVER_BATCH_SIZE` divides by the element count). The plain
model_fn's loss on the whole batch is then `sum(numerators) / D`, where D is
the denominator computed on the whole batch: tower k's weight is its share of
D, not of the examples.

Recognised at graph construction, on tower 0's loss: a chain of Identity, Cast
and Mul by tensors that neither depend on the shard nor read a
trained variable, down to a RealDiv / Div / DivNoNan whose numerator is a
`Sum` (the library's reduce_sum) and whose denominator d is made of *additive
leaves* joined by elementwise scalar ops (`+ 1e-5`, `tf.maximum(., 1)`,
casts). A leaf is a value that adds up across shards: a scalar `Sum` or a
`Size` of something that depends on the shard, `tf.shape(x)[0]`, or a tensor
the model_fn declared with `loss_denominator`. D is d rebuilt with each leaf replaced by
the sum of the towers' leaves, so `sum(w) + 1e-5` becomes
sum_k sum(w_k) + 1e-5: exactly the plain denominator (the constant counts
once, not once per tower). A denominator that depends on nothing in the shard
is a leaf itself if the towers' values differ (a static shard size folded
into a constant); if they are equal it is not handled here: a
hyperparameter (tf.reduce_sum(l) / params['batch_size'], a summed loss) and
an equal static shard size (a mean) look the same, and the library's other
rules (the recorded reduction, `loss_reduction`) decide. Nor is a
denominator that is one element count (`tf.size`, `tf.shape(x)[0]`: Keras'
SUM_OVER_BATCH_SIZE, unweighted `tf.compat.v1.losses`): it is proportional
to the shard's examples, so the example-count rule is already exact.

The whole-batch loss is then built, and differentiated, as

    chain(sum_k numerator_k  (/) D)

with the ratio's own division ((/): divide_no_nan for a DivNoNan), rather than
as sum_k w_k * loss_k with w_k = d_k / D. The two are equal in value, but a
shard whose weights are all zero has loss_k = 0 / 0 = NaN (RealDiv), and
w_k * NaN is NaN, in value and in gradient (0 times a NaN gradient is NaN).
Here no tower's own ratio is in the differentiated graph: each numerator gets
the gradient chain' / D, and a leaf that depends on a variable gets its
gradient through D, as in the plain graph.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Sequence
import weakref

from absl import logging
import tensorflow as tf

from estimator_towers import tower_context

_RATIOS = ('RealDiv', 'Div', 'DivNoNan')
_CHAIN = ('Identity', 'Cast', 'Mul')
_ELEMENTWISE = {
    'Identity': lambda op, a: tf.identity(a[0]),
    'StopGradient': lambda op, a: tf.stop_gradient(a[0]),
    'Cast': lambda op, a: tf.cast(a[0], op.outputs[0].dtype),
    'AddV2': lambda op, a: a[0] + a[1],
    'Add': lambda op, a: a[0] + a[1],
    'Sub': lambda op, a: a[0] - a[1],
    'Mul': lambda op, a: a[0] * a[1],
    'RealDiv': lambda op, a: a[0] / a[1],
    'Maximum': lambda op, a: tf.maximum(a[0], a[1]),
    'Minimum': lambda op, a: tf.minimum(a[0], a[1]),
    'Neg': lambda op, a: -a[0],
}
_LEAVES = ('Sum', 'Size')
_SHAPES = ('Shape', 'ShapeN', 'Size', 'Rank')
_SEARCH_LIMIT = 20000

_lock = threading.Lock()
_declared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {tensor name}


def loss_denominator(denominator: tf.Tensor) -> tf.Tensor:
  """Declares what the model_fn's loss divides by, where it cannot be recognised.

  Write the loss as `numerator / estimator_towers.loss_denominator(d)` (or
  `tf.math.divide_no_nan(numerator, loss_denominator(d))`, or with `d` inside
  an expression such as `tf.maximum(loss_denominator(d), 1.0)`), with
  `numerator` a sum over the shard's examples and `d` a value that adds up
  across shards (a count of tokens, a sum of weights), however it is
  computed. The towers' whole-batch loss then divides the sum of their
  numerators by the sum of their `d`, exactly as the plain model_fn divides
  the whole batch's numerator by the whole batch's `d`. Needed only when the
  library does not recognise `d` itself (a `tf.reduce_sum`, `tf.size` or a
  `tf.compat.v1.losses` / Keras weighted reduction are recognised).

  Outside a towered model_fn (a plain model_fn, one tower) it does nothing.

  Args:
    denominator: a scalar Tensor, this shard's value.

  Returns:
    `denominator` itself.

  Raises:
    ValueError: if `denominator` is not a scalar Tensor.
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


@dataclasses.dataclass
class _Ratio:
  """Tower 0's loss as chain(numerator (/) denominator)."""
  chain: list          # (op, index of the input leading to the ratio), from the loss down
  ratio: tf.Operation
  leaves: list         # the additive tensors D is made of (tower 0's)
  declared: bool       # a leaf was declared with loss_denominator


def ratio_op(loss: Any) -> tf.Operation | None:
  """The ratio op the loss is a chain of Identity / Cast / Mul away from, or None."""
  if not isinstance(loss, tf.Tensor):
    return None
  op = loss.op
  for _ in range(64):
    if op.type in _RATIOS and len(op.inputs) == 2:
      return op
    if op.type not in _CHAIN or not op.inputs:
      return None
    op = op.inputs[0].op if op.type != 'Mul' else _mul_side(op).op
  return None


def divides_by_shard(loss: Any) -> bool:
  """True if `loss` is a ratio whose denominator is not a constant (cheap check)."""
  op = ratio_op(loss)
  if op is None:
    return False
  denominator = op.inputs[1].op
  while denominator.type in ('Identity', 'Cast') and denominator.inputs:
    denominator = denominator.inputs[0].op
  return denominator.type != 'Const'


def _mul_side(op: tf.Operation) -> tf.Tensor:
  """The input of a Mul that leads to the ratio (the other is a factor)."""
  a, b = op.inputs
  return b if ratio_op(b) is not None and ratio_op(a) is None else a


class _Dependence:
  """Which tensors depend on the shard's inputs or read given variables."""

  def __init__(self, inputs: Sequence[tf.Tensor], variables: Sequence[Any] = ()):
    self._inputs = {t.op.name for t in inputs if isinstance(t, tf.Tensor)}
    self._variables = set()
    for v in variables:
      handle = getattr(v, 'handle', None)
      self._variables.add((handle if handle is not None else v).op.name)
    self._memo: dict[str, tuple[bool, bool]] = {}

  def of(self, tensor: tf.Tensor, values: bool = False) -> tuple[bool, bool]:
    """(depends on the shard, reads a trained variable), over the ancestors.

    With `values`, only through the shard's values: a path through a Shape,
    Size or Rank (the shard's shape) does not count.
    """
    key = (tensor.op.name, values)
    if key in self._memo:
      return self._memo[key]
    shard = variable = False
    pending, seen = [tensor.op], set()
    while pending and len(seen) < _SEARCH_LIMIT and not (shard and variable):
      op = pending.pop()
      if op.name in seen:
        continue
      seen.add(op.name)
      shard = shard or op.name in self._inputs
      variable = variable or op.name in self._variables
      if not (values and op.type in _SHAPES):
        pending.extend(t.op for t in op.inputs)
      pending.extend(op.control_inputs)
    self._memo[key] = (shard, variable)
    return shard, variable


def _recognise(loss: tf.Tensor, dependence: _Dependence, auto: bool) -> _Ratio | None:
  """Tower 0's loss as a _Ratio, or None if it is not one this module handles."""
  ratio = ratio_op(loss)
  if ratio is None or loss.shape.rank != 0:
    return None
  chain, op = [], loss.op
  while op is not ratio:
    side = _mul_side(op) if op.type == 'Mul' else op.inputs[0]
    index = list(op.inputs).index(side)
    for j, other in enumerate(op.inputs):
      if j != index and any(dependence.of(other)):
        return None  # a factor that depends on the shard or on a trained variable
    chain.append((op, index))
    op = side.op
  numerator, denominator = ratio.inputs
  if numerator.shape.rank != 0 or denominator.shape.rank != 0:
    return None
  leaves = []
  if not _leaves(denominator, dependence, leaves):
    return None
  declared = any(_is_declared(t) for t in leaves)
  if not declared and (not auto or not _is_sum(numerator)):
    return None
  return _Ratio(chain, ratio, leaves, declared)


def _counts_examples(ratio: _Ratio, dependence: _Dependence) -> bool:
  """True if the denominator is one count of the shard's elements.

  That is a leaf computed from the shard's shape alone: tf.size,
  tf.shape(x)[0], or the sum of weights broadcast from a constant
  (unweighted tf.compat.v1.losses). It is then proportional to the shard's
  examples (every example of a batch has the same shape), so the
  example-count rule the caller falls back to is exact, and cheaper: it sends
  no numerator and count between devices.
  """
  op = ratio.ratio.inputs[1].op
  while op.type in ('Identity', 'Cast') and op.inputs:
    op = op.inputs[0].op
  return (not ratio.declared and len(ratio.leaves) == 1 and ratio.leaves[0].op is op
          and not dependence.of(ratio.leaves[0], values=True)[0])


def _is_sum(tensor: tf.Tensor) -> bool:
  op = tensor.op
  while op.type in ('Identity', 'Cast') and op.inputs:
    op = op.inputs[0].op
  return op.type == 'Sum'


def _leaves(tensor: tf.Tensor, dependence: _Dependence, found: list) -> bool:
  """Collects the additive leaves of a denominator; False if one part is not."""
  if _is_declared(tensor):
    found.append(tensor)
    return True
  if not dependence.of(tensor)[0]:
    return True  # a constant part (1e-5), or a hyperparameter
  op = tensor.op
  if (op.type in _LEAVES and tensor.shape.rank == 0) or _is_batch_size(tensor):
    found.append(tensor)
    return True
  if op.type not in _ELEMENTWISE:
    return False
  return all(_leaves(t, dependence, found) for t in op.inputs)


def _is_batch_size(tensor: tf.Tensor) -> bool:
  """True for tf.shape(x)[0]: a StridedSlice of element 0 of a Shape."""
  op = tensor.op
  if op.type != 'StridedSlice' or op.inputs[0].op.type != 'Shape' or tensor.shape.rank != 0:
    return False
  begin, end = tf.get_static_value(op.inputs[1]), tf.get_static_value(op.inputs[2])
  return begin is not None and end is not None and list(begin) == [0] and list(end) == [1]


def whole_batch_loss(losses: Sequence[tf.Tensor], counterpart, inputs: Sequence[tf.Tensor],
                     nonempty: Sequence, auto: bool = True,
                     variables: Sequence[Any] = ()) -> tf.Tensor | None:
  """The plain model_fn's loss on the whole batch, from the towers' losses.

  Args:
    losses: each built tower's loss (tower 0 first).
    counterpart: `counterpart(i, tensor)`: the i-th tower's tensor matching
      `tensor` of tower 0 (an ancestor of losses[0]), or None.
    inputs: tower 0's shard tensors (features and labels, flattened).
    nonempty: per tower, True, False or a boolean scalar Tensor.
    auto: recognise unstated denominators (loss_reduction='auto'); else only
      those declared with `loss_denominator`.
    variables: the trained variables (a chain factor must not read them).

  Returns:
    chain(sum_k numerator_k (/) D) as described in the module docstring, or
    None if the loss is not such a ratio (the caller keeps its own rule).
  """
  if len(losses) < 2:
    return None
  dependence = _Dependence(inputs, variables)
  ratio = _recognise(losses[0], dependence, auto)
  if ratio is None:
    if auto and divides_by_shard(losses[0]):
      _warn_once()
    return None
  if _counts_examples(ratio, dependence):
    return None  # the example-count rule is exact
  numerator, denominator = ratio.ratio.inputs
  parts = {}
  for t in [numerator] + ratio.leaves:
    found = [t] + [counterpart(i, t) for i in range(1, len(losses))]
    if any(f is None for f in found):
      _warn_once()
      return None
    parts[t.name] = found
  if not ratio.leaves:
    # A denominator that depends on nothing in the shard: a per-tower constant
    # (a static shard size) is a leaf when the towers' values differ; when
    # they are equal a hyperparameter cannot be told from an equal shard
    # size, so the caller's rule (the recorded reduction, loss_reduction) holds.
    found = [denominator] + [counterpart(i, denominator) for i in range(1, len(losses))]
    static = [None if f is None else tf.get_static_value(f) for f in found]
    if any(v is None for v in static) or all(v == static[0] for v in static):
      return None
    parts[denominator.name] = found
  with tf.device(None), tf.name_scope('whole_batch_loss'):
    total = {name: _masked_sum(found, nonempty) for name, found in parts.items()}
    whole_denominator = _rebuild(denominator, total)
    whole = _divide(ratio.ratio.type, total[numerator.name], whole_denominator)
    for op, index in reversed(ratio.chain):
      operands = list(op.inputs)
      operands[index] = whole
      whole = _ELEMENTWISE[op.type](op, operands)
    return whole


def _masked_sum(found: Sequence[tf.Tensor], nonempty: Sequence) -> tf.Tensor:
  """sum_k found[k] over the towers whose shard is not empty."""
  terms = []
  for t, ne in zip(found, nonempty):
    if ne is False:
      continue
    terms.append(t if ne is True else tf.where(ne, t, tf.zeros_like(t)))
  return tf.add_n(terms)


def _rebuild(tensor: tf.Tensor, total: dict) -> tf.Tensor:
  """`tensor` (tower 0's denominator) with each leaf replaced by its total."""
  if tensor.name in total:
    return total[tensor.name]
  if not _contains(tensor, total):
    return tensor
  return _ELEMENTWISE[tensor.op.type](tensor.op, [_rebuild(t, total) for t in tensor.op.inputs])


def _contains(tensor: tf.Tensor, total: dict) -> bool:
  if tensor.name in total:
    return True
  if tensor.op.type not in _ELEMENTWISE:
    return False
  return any(_contains(t, total) for t in tensor.op.inputs)


def _divide(kind: str, numerator: tf.Tensor, denominator: tf.Tensor) -> tf.Tensor:
  if kind == 'DivNoNan':
    return tf.math.divide_no_nan(numerator, denominator)
  return numerator / denominator


_warned = []


def _warn_once() -> None:
  if not _warned:
    _warned.append(True)
    logging.warning(
        'estimator_towers: the loss is a ratio whose denominator is not '
        'recognised as a sum over the shard (a tf.reduce_sum, a tf.size, a '
        'count of non-zero weights), so towers are weighted by their share of '
        'the batch\'s examples, which is exact only if the denominator is '
        'proportional to the example count. Declare the denominator: loss = '
        'numerator / estimator_towers.loss_denominator(d); or, if it is a '
        'constant (a sum divided by a batch size), pass loss_reduction=\'sum\'.')
