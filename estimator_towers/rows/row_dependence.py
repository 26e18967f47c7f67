"""Row dependence: how each tensor's rows relate to the shard's examples.

The rule. A towered model_fn is exact for free where every example's values
are computed from that example alone: then a shard's rows are the whole
batch's rows of its examples, and what is left between the shards is the
loss's statistics (`loss_algebra`) and the batch norms' (`batch_norm_sync`).
This module reads tower 0's graph, from the shard's input tensors to a
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
  rows, `tf.where`'s indices); sums of it are still statistics.
- **statistic**: a reduction over the batch axis of rows (a sum, a mean, a
  max, a batch norm's moments), and arithmetic on such values: what the
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
- **mixed**: a row depends on other examples of the batch. The first op that
  makes a mixed tensor out of none is a *mixing op*: a matrix product of two
  batch operands, a transpose, top-k, reverse, gather or slice across the
  batch axis, a concat on the batch axis of rows with other values, rows
  combined with a statistic that is not a batch norm's or with a batch-size
  value, and any op this module does not know (a function call, a
  `py_func`, a functional `If`/`While`) fed by the batch: an op that cannot
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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence
import weakref

import numpy as np
import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.base import spelling

ROWS, FLAT, COLS, STAT, SIZE, SHAPE, UNIQUE, SPLITS, MIXED = (
    'rows', 'flat', 'columns', 'statistic', 'batch size', 'shape', 'distinct values',
    'row splits', 'mixed')
_SEARCH_LIMIT = 200000
_cut_rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {tensor name}


def add_rows(tensors: Sequence[tf.Tensor]) -> None:
  """`tensors` are rows of their tower's examples, whatever computes them.

  `batch_mixing` cuts the towers at the input stage's mixing ops: each tower
  reads its rows of the whole batch's value, made from every tower's inputs.
  """
  for t in tensors:
    _cut_rows.setdefault(t.graph, set()).add(t.name)


def cut_rows(graph: tf.Graph) -> frozenset:
  """The names of the tensors `add_rows` made rows in `graph`."""
  return frozenset(_cut_rows.get(graph, ()))


@dataclasses.dataclass(frozen=True)
class Kind:
  """A tensor's rows: `tag` one of the kinds above.

  `blocks`: for rows, how many copies of the shard's examples are stacked on
  axis 0 (1: one row per example). `norm`: for a statistic, a batch norm's.
  """
  tag: str
  blocks: int = 1
  norm: bool = False


_ROWS, _FLAT, _COLS = Kind(ROWS), Kind(FLAT), Kind(COLS)
_SIZE, _SHAPE, _UNIQUE, _MIXED = Kind(SIZE), Kind(SHAPE), Kind(UNIQUE), Kind(MIXED)
_SPLITS = Kind(SPLITS)
_STAT, _NORM = Kind(STAT), Kind(STAT, norm=True)

# Elementwise arithmetic (with broadcasting): each output element from the
# same position of the inputs, so a copy onto other values of the same
# layout (the whole batch's, a tower's rows) is the same op on them
# (`loss_algebra` and `row_wise_head` rebuild these).
ARITHMETIC = frozenset((
    'Identity', 'StopGradient', 'Cast', 'AddV2', 'Add', 'AddN', 'Sub', 'Mul', 'MulNoNan',
    'RealDiv', 'Div', 'DivNoNan', 'Maximum', 'Minimum', 'Neg', 'Square', 'Sqrt', 'Rsqrt',
    'Exp', 'Log', 'Log1p', 'Pow', 'Abs', 'Reciprocal', 'Inv', 'Tanh', 'Sigmoid', 'Softplus',
    'SquaredDifference', 'Select', 'SelectV2', 'Floor', 'Ceil', 'Round', 'Relu',
    'ClipByValue', 'Equal', 'NotEqual', 'Less', 'LessEqual', 'Greater', 'GreaterEqual',
    'LogicalAnd', 'LogicalOr', 'LogicalNot'))
# Ops applied elementwise (with broadcasting) or within each row.
_ELEMENTWISE = ARITHMETIC | frozenset((
    'PreventGradient', 'CheckNumerics', 'EnsureShape', 'Snapshot', 'Bitcast', 'FloorDiv',
    'FloorMod', 'Mod', 'TruncateDiv', 'Expm1', 'Sign', 'Softsign', 'Rint', 'Relu6', 'Elu',
    'Selu', 'LeakyRelu', 'Gelu', 'IsNan', 'IsInf', 'IsFinite', 'Erf', 'Erfc', 'Sin', 'Cos',
    'Atan2', 'Xlogy', 'Xdivy', 'Sinh', 'Cosh', 'Atan', 'Asin', 'Acos', 'Tan', 'Lgamma',
    'Digamma', 'Softmax', 'LogSoftmax', 'BiasAdd', 'BiasAddV1',
    'SoftmaxCrossEntropyWithLogits', 'SparseSoftmaxCrossEntropyWithLogits', 'InTopKV2',
    'ZerosLike', 'OnesLike', 'IdentityN', 'L2Normalize', 'ApproximateEqual', 'BitwiseAnd',
    'BitwiseOr', 'BitwiseXor', 'Invert', 'LeftShift', 'RightShift', 'Real', 'Imag', 'Complex',
    'ComplexAbs', 'Conj', 'BroadcastGradientArgs', 'StringToHashBucketFast', 'AsString',
    'OneHot', 'Bucketize', 'Betainc', 'Igamma', 'Igammac', 'Zeta', 'SigmoidGrad', 'TanhGrad',
    'ReluGrad', 'SoftplusGrad', 'RsqrtGrad', 'SqrtGrad', 'StringLength', 'StringToNumber',
    'StringToHashBucket', 'StringToHashBucketStrong', 'StringLower', 'StringUpper',
    'StringStrip', 'RegexFullMatch', 'StaticRegexFullMatch', 'RegexReplace',
    'StaticRegexReplace', 'Substr'))
_SEGMENT_SUMS = frozenset(('UnsortedSegmentSum', 'UnsortedSegmentMax', 'UnsortedSegmentMin',
                           'UnsortedSegmentProd', 'SegmentSum', 'SegmentMean', 'SegmentMax',
                           'SegmentMin', 'SegmentProd'))
# Layers: input 0 is rows, the others (filters, pooling sizes) must not depend on the batch.
_LAYERS = frozenset((
    'Conv2D', 'Conv3D', 'Conv1D', 'DepthwiseConv2dNative', 'MaxPool', 'MaxPoolV2', 'AvgPool',
    'MaxPool3D', 'AvgPool3D', 'LRN', 'Conv2DBackpropInput', 'ResizeBilinear',
    'ResizeNearestNeighbor', 'ResizeBicubic', 'SpaceToDepth', 'DepthToSpace',
    'ExtractImagePatches', 'Dilation2D', 'NearestNeighbors'))
# Sparse segment reductions: (data, indices, segment_ids[, num_segments]).
_SEGMENTS = frozenset(('SparseSegmentSum', 'SparseSegmentMean', 'SparseSegmentSqrtN',
                       'SparseSegmentSumWithNumSegments', 'SparseSegmentMeanWithNumSegments',
                       'SparseSegmentSqrtNWithNumSegments'))
_FUSED_BATCH_NORMS = frozenset(('FusedBatchNorm', 'FusedBatchNormV2', 'FusedBatchNormV3'))
_REDUCTIONS = frozenset(('Sum', 'Mean', 'Max', 'Min', 'Prod', 'All', 'Any', 'EuclideanNorm'))
# The size of the shard's rows (a shape op reads the rows' shape, not their values).
_SHAPES = frozenset(('Shape', 'ShapeN'))
# Ops whose `shape` input (index) makes their output's rows.
_SHAPED = {'Fill': 0, 'RandomUniform': 0, 'RandomStandardNormal': 0, 'TruncatedNormal': 0,
           'RandomUniformInt': 0, 'StatelessRandomUniformV2': 0, 'StatelessRandomNormalV2': 0,
           'StatelessRandomUniform': 0, 'StatelessRandomNormal': 0,
           'StatelessTruncatedNormal': 0, 'StatelessTruncatedNormalV2': 0,
           'StatelessRandomUniformIntV2': 0, 'BroadcastTo': 1, 'Zeros': 0}
_FUNCTIONS = frozenset(('PartitionedCall', 'StatefulPartitionedCall', 'If', 'StatelessIf',
                        'While', 'StatelessWhile', 'Case', 'StatelessCase', 'PyFunc',
                        'PyFuncStateless', 'EagerPyFunc'))


@dataclasses.dataclass
class Mixing:
  """An op that makes rows depend on other examples of the batch."""
  op: tf.Operation
  why: str

  def describe(self) -> str:
    return f'{self.op.type} op {self.op.name!r} ({self.why})'


@dataclasses.dataclass
class RowDependence:
  """What `classify` found on tower 0's graph.

  Attributes:
    kinds: tensor name -> Kind, for every tensor between the inputs and the
      targets that depends on the shard.
    mixing: the mixing ops, in graph order (empty: every row per-example).
    frontier: the per-example tensors (rows or flat) that mixing ops read.
  """
  kinds: dict
  mixing: list
  frontier: list

  def kind(self, tensor: tf.Tensor) -> Kind | None:
    return self.kinds.get(tensor.name)


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
  kinds = _input_kinds(inputs)
  kinds.update((name, _ROWS) for name in _cut_rows.get(targets[0].graph, ()))
  reader = _read(targets, kinds, _static_examples(inputs), declared)
  for t in targets:
    if reader.kind(t) is not None and reader.kind(t).tag == UNIQUE:
      reader.mixing.append(Mixing(t.op, 'a value of the batch\'s distinct ids, which no '
                                        'sum over shards gives'))
  return RowDependence(reader.kinds, reader.mixing, reader.frontier)


def _read(targets: Sequence[tf.Tensor], input_kinds: dict, examples: int | None,
          declared: Callable[[tf.Tensor], bool]) -> '_Reader':
  """The reader after visiting, in graph order, the ops between the inputs and `targets`."""
  graph = targets[0].graph
  declared_stats = {}
  ops, seen, pending = [], set(), [t.op for t in targets if not declared(t)]
  while pending and len(seen) < _SEARCH_LIMIT:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    ops.append(op)
    for t in op.inputs:
      if t.name in input_kinds:
        continue
      if declared(t):   # a declared statistic: what computes it is not read
        declared_stats[t.name] = _STAT
        continue
      if t.op.name.startswith('shard_inputs'):
        continue   # another shard's inputs (a row borrowed from this one): not this shard's
      pending.append(t.op)
  order = {op.name: i for i, op in enumerate(graph.get_operations())}
  ops.sort(key=lambda op: order.get(op.name, -1))
  reader = _Reader(examples, declared)
  reader.kinds.update(input_kinds)
  reader.kinds.update(declared_stats)
  reader.kinds.update({t.name: _STAT for t in targets if declared(t)})
  for op in ops:
    reader.visit(op)
  return reader


def _input_kinds(inputs: Sequence[tf.Tensor]) -> dict:
  """Rows; a SparseTensor's (indices, values, dense_shape), as flattened: flat, flat, shape."""
  kinds, i = {}, 0
  while i < len(inputs):
    window = inputs[i:i + 3]
    if len(window) == 3 and _sparse(*window):
      kinds.update({window[0].name: _FLAT, window[1].name: _FLAT, window[2].name: _SHAPE})
      i += 3
      continue
    if len(window) >= 2 and _ragged(*window[:2]):
      kinds.update({window[0].name: _FLAT, window[1].name: _SPLITS})
      i += 2
      continue
    kinds[inputs[i].name] = _ROWS
    i += 1
  return kinds


def _ragged(values: tf.Tensor, splits: tf.Tensor) -> bool:
  """A RaggedTensor of one ragged dimension, as flattened: (flat_values, row_splits)."""
  return (splits.dtype in (tf.int32, tf.int64) and splits.shape.rank == 1
          and 'Ragged' in splits.op.name and 'Ragged' in values.op.name)


def _sparse(indices: tf.Tensor, values: tf.Tensor, shape: tf.Tensor) -> bool:
  rank = indices.shape[1] if indices.shape.rank == 2 else None
  return (indices.dtype == tf.int64 and indices.shape.rank == 2 and values.shape.rank == 1
          and (indices.op is values.op or (indices.op.name.endswith('indices')
                                            and values.op.name.endswith('values')))
          and shape.dtype == tf.int64 and shape.shape.rank == 1
          and (rank is None or shape.shape[0] is None or shape.shape[0] == rank))


def _static_examples(inputs: Sequence[tf.Tensor]) -> int | None:
  for t in inputs:
    if t.shape.rank and t.shape[0] is not None:
      return int(t.shape[0])
  return None


_FOLDED = {'Sub': np.subtract, 'AddV2': np.add, 'Add': np.add, 'Mul': np.multiply,
           'Neg': np.negative, 'FloorDiv': np.floor_divide, 'Identity': lambda a: a}


def _value(t: tf.Tensor, depth: int = 0):
  """`t`'s value if known when the graph is built (a small constant folder)."""
  value = tf.get_static_value(t)
  if value is None and depth < 8:
    op = t.op
    if op.type == 'Rank' and op.inputs[0].shape.rank is not None:
      return np.asarray(op.inputs[0].shape.rank, np.int32)
    if op.type in _FOLDED:
      args = [_value(i, depth + 1) for i in op.inputs]
      if all(a is not None for a in args):
        return np.asarray(_FOLDED[op.type](*args))
    if (op.type == 'StridedSlice' and op.inputs[0].op.type == 'Shape'
        and op.get_attr('shrink_axis_mask') == 1 and op.inputs[0].op.inputs[0].shape.rank):
      begin, dims = _value(op.inputs[1], depth + 1), op.inputs[0].op.inputs[0].shape
      if begin is not None and -dims.rank <= int(begin[0]) < dims.rank and dims[int(begin[0])]:
        return np.asarray(dims[int(begin[0])], np.int32)
    if op.type in ('Prod', 'Sum') and op.inputs[0].shape.is_fully_defined() and (
        op.inputs[0].shape.num_elements() == 0):
      return np.asarray(1 if op.type == 'Prod' else 0, op.outputs[0].dtype.as_numpy_dtype)
    if op.type == 'Pack':
      args = [_value(i, depth + 1) for i in op.inputs]
      if all(a is not None for a in args):
        return np.stack(args, axis=op.get_attr('axis'))
    if op.type == 'ConcatV2':
      args = [_value(i, depth + 1) for i in op.inputs]
      if all(a is not None and a.ndim for a in args[:-1]) and args[-1] is not None:
        return np.concatenate(args[:-1], axis=int(args[-1]))
    if op.type == 'Slice' and op.inputs[0].op.type == 'Shape':
      return _shape_slice(op, depth)
  return None if value is None else np.asarray(value)


def _shape_slice(op: tf.Operation, depth: int):
  """The value of Slice(Shape(x), begin, size) where those sizes of x are static."""
  dims = op.inputs[0].op.inputs[0].shape
  begin, size = _value(op.inputs[1], depth + 1), _value(op.inputs[2], depth + 1)
  if dims.rank is None or begin is None or size is None or begin.size != 1 or size.size != 1:
    return None
  start = int(begin[0])
  end = dims.rank if int(size[0]) < 0 else start + int(size[0])
  picked = dims.as_list()[start:end]
  if start < 0 or any(d is None for d in picked):
    return None
  return np.asarray(picked, op.outputs[0].dtype.as_numpy_dtype)


class _Reader:
  """Visits ops in graph order, each after its inputs; fills `kinds`."""

  def __init__(self, examples: int | None, declared: Callable[[tf.Tensor], bool]):
    self.examples = examples
    self.declared = declared
    self.kinds: dict = {}
    self.mixing: list = []
    self.frontier: list = []
    self._frontier_names: set = set()

  def kind(self, t: tf.Tensor) -> Kind | None:
    return self.kinds.get(t.name)

  def visit(self, op: tf.Operation) -> None:
    if not op.outputs or all(o.name in self.kinds for o in op.outputs):
      return
    kinds = [self.kind(t) for t in op.inputs]
    if all(k is None for k in kinds):
      return   # depends on no input of the shard
    if any(k is not None and k.tag == MIXED for k in kinds):
      self._set(op, _MIXED)
      return
    if any(self.declared(o) for o in op.outputs):
      self._set(op, _STAT)
      return
    found = self._rule(op, kinds)
    if isinstance(found, str):   # a mixing op: why
      self.mixing.append(Mixing(op, found))
      for t, k in zip(op.inputs, kinds):
        while k is not None and k.tag == COLS and t.op.type in ('Transpose', 'Reshape'):
          t = t.op.inputs[0]   # the rows a transpose made columns of
          k = self.kind(t)
        if k is not None and k.tag in (ROWS, FLAT) and t.name not in self._frontier_names:
          self._frontier_names.add(t.name)
          self.frontier.append(t)
      self._set(op, _MIXED)
    elif isinstance(found, list):
      for o, k in zip(op.outputs, found):
        self.kinds[o.name] = k
    else:
      self._set(op, found)

  def _set(self, op: tf.Operation, kind: Kind) -> None:
    for o in op.outputs:
      self.kinds[o.name] = kind

  # -- The rules: a Kind, a list of Kinds (per output), or a str (mixing: why) --

  def _rule(self, op: tf.Operation, kinds: list):
    t = op.type
    present = [k for k in kinds if k is not None]
    if 'RaggedSplitsToSegmentIds/' in op.name and all(k.tag != MIXED for k in present):
      return _FLAT   # which example each entry of a RaggedTensor belongs to
    if any(k.tag == SPLITS for k in present):
      return self._splits(op, kinds)
    if t.startswith('Collective') or t in ('ScatterNd', 'TensorScatterUpdate',
                                           'TensorScatterAdd'):
      # across workers: a total or a table of statistics (cross_worker, sync batch norm)
      if present and all(k.tag in (STAT, SIZE, SHAPE) for k in present):
        return _stat_of(present) if any(k.tag == STAT for k in present) else _SIZE
      return f'an op across workers or a scatter of the batch\'s rows ({t})'
    if t in _SEGMENT_SUMS:
      data, ids = kinds[0], kinds[1]
      if data is not None and data.tag in (ROWS, FLAT) and ids is not None and (
          ids.tag == FLAT and 'RaggedSplitsToSegmentIds' in op.inputs[1].op.name) and all(
              k is None or k.tag in (SIZE, SHAPE) for k in kinds[2:]):
        return _ROWS   # each example's entries reduced (a ragged row's sum)
      return 'a segment reduction across the batch\'s rows'
    if present and all(k.tag == UNIQUE for k in present) and t not in _SEGMENTS and (
        t not in ('GatherV2', 'Gather', 'ResourceGather') or kinds[0] is not None):
      return _UNIQUE   # values per distinct id, whatever computes them
    if t in _SHAPES:
      return [self._shape_of(k) for k in kinds[:len(op.outputs)]]
    if t == 'Size':
      return self._size_of(kinds[0])
    if t == 'Rank':
      return None   # the rank does not depend on the batch
    if t in _ELEMENTWISE:
      if t == 'IdentityN':
        return [k if k is not None else _MIXED for k in kinds]
      return self._elementwise(op, kinds)
    if t in _FUSED_BATCH_NORMS and kinds[0] is not None and kinds[0].tag == COLS and (
        op.get_attr('data_format') in (b'NCHW', 'NCHW')) and all(
            k is None or k.tag in (SIZE, SHAPE, ROWS) for k in kinds[1:]):
      return [_COLS] + [_ROWS] * (len(op.outputs) - 1)   # statistics per example: layer norm
    if t in _FUSED_BATCH_NORMS and (kinds[0] is None or kinds[0].tag == STAT) and all(
        k is None or k.tag == STAT for k in kinds[1:]) and not any(kinds[1:3]):
      return _NORM   # another tower's rows on the global statistics (sync batch norm)
    if t in _FUSED_BATCH_NORMS:
      if any(k is not None for k in kinds[1:3]) or kinds[0] is None:
        return 'a batch norm whose scale or offset depends on the batch'
      if any(k is not None and k.tag != STAT for k in kinds[3:]):
        return 'a batch norm whose statistics are not the batch\'s statistics'
      if kinds[0].tag != ROWS:
        return 'a batch norm of values that are not one row per example'
      return [kinds[0]] + [_NORM] * (len(op.outputs) - 1)
    if t in _LAYERS:
      if any(k is not None for k in kinds[1:]):
        return 'a layer whose weights depend on the batch'
      return kinds[0] if kinds[0].tag in (ROWS, FLAT) else self._not_rows(op, kinds[0])
    if t in _REDUCTIONS:
      return self._reduction(op, kinds[0], kinds[1])
    if t in _SEGMENTS:
      return self._segments(op, kinds)
    if t == 'SparseReshape':
      if [k and k.tag for k in kinds] == [FLAT, SHAPE, SHAPE]:
        return [_FLAT, _SHAPE]
      return 'a sparse reshape of the batch axis'
    if t == 'SparseFillEmptyRows':
      if [k and k.tag for k in kinds[:3]] == [FLAT, FLAT, SHAPE] and kinds[3] is None:
        return [_FLAT, _FLAT, _ROWS, _FLAT]
      return 'a sparse op on values that are not the batch\'s entries'
    if t in ('SparseReduceSum', 'SparseReduceMax'):
      if [k and k.tag for k in kinds] != [FLAT, FLAT, SHAPE, None]:
        return 'a sparse reduction of values that are not the batch\'s entries'
      axes = self._axes(op, op.inputs[3], op.inputs[2].shape[0] if op.inputs[2].shape.rank
                        else None)
      if axes is None:
        return 'a sparse reduction over axes unknown when the graph is built'
      return _STAT if 0 in axes or not axes else _ROWS
    if t == 'SparseToDense':
      if [k and k.tag for k in kinds[:3]] in ([FLAT, SHAPE, FLAT], [FLAT, SHAPE, None]) and (
          kinds[3] is None):
        return _ROWS
      return 'a sparse op on values that are not the batch\'s entries'
    if t == 'SparseTensorDenseMatMul':
      if [k and k.tag for k in kinds] == [FLAT, FLAT, SHAPE, None] and not op.get_attr(
          'adjoint_a'):
        return _ROWS
      return 'a sparse matrix product across the batch axis'
    if t == 'DynamicPartition':   # embedding_lookup of a partitioned table, by id
      if kinds[0] is not None and kinds[0].tag == UNIQUE and kinds[1] is not None and (
          kinds[1].tag == UNIQUE):
        return _UNIQUE
      return 'a partition of the batch\'s rows by value'
    if t == 'DynamicStitch' or t == 'ParallelDynamicStitch':
      if all(k is None or k.tag == UNIQUE for k in kinds):
        return _UNIQUE
      return 'a stitch of the batch\'s rows by index'
    if t in ('Unique', 'UniqueV2'):
      return [_UNIQUE, _FLAT] if kinds[0].tag == FLAT or kinds[0].tag == ROWS and (
          op.inputs[0].shape.rank == 1) else 'the distinct values of the batch\'s rows'
    if t in ('ArgMax', 'ArgMin'):
      return self._reduction(op, kinds[0], kinds[1])
    if t == 'L2Loss':
      return self._statistic(op, kinds[0])
    if t in ('MatMul', 'BatchMatMul', 'BatchMatMulV2', 'BatchMatMulV3'):
      return self._matmul(op, kinds)
    if t == 'Reshape':
      return self._reshape(op, kinds)
    if t in _SHAPED:
      return self._shaped(op, kinds)
    if t == 'Tile':
      return self._tile(op, kinds)
    if t == 'Transpose':
      return self._transpose(op, kinds)
    if t == 'ExpandDims':
      return self._expand_dims(op, kinds)
    if t == 'Squeeze':
      return self._squeeze(op, kinds)
    if t == 'ConcatV2':
      return self._concat(op, kinds[:-1], kinds[-1], op.inputs[-1])
    if t == 'Pack':
      return self._pack(op, kinds)
    if t == 'Unpack':
      return self._unpack(op, kinds[0])
    if t == 'Split':
      return self._split(op, kinds[1], op.inputs[0], op.get_attr('num_split'))
    if t == 'SplitV':
      return self._split(op, kinds[0], op.inputs[2], None, kinds[1])
    if t == 'StridedSlice':
      return self._strided_slice(op, kinds)
    if t == 'Slice':
      return self._slice(op, kinds)
    if t in ('Pad', 'PadV2', 'MirrorPad'):
      return self._pad(op, kinds)
    if t in ('GatherV2', 'Gather', 'ResourceGather'):
      return self._gather(op, kinds)
    if t == 'GatherNd':
      return self._gather_nd(op, kinds)
    if t == 'Where' and len(op.inputs) == 1:
      return _FLAT if kinds[0].tag in (ROWS, FLAT) else self._not_rows(op, kinds[0])
    if t == 'TopKV2':
      return self._last_axis(op, kinds, 'a top-k across the batch axis')
    if t in ('ReverseV2',):
      return self._reverse(op, kinds)
    if t in ('Cumsum', 'Cumprod', 'CumulativeLogsumexp'):
      return self._along_axis(op, kinds[0], op.inputs[1], 'a cumulative sum across the batch axis')
    if t in ('Range',):
      return self._batch_size_value(op, kinds)
    if t in ('MatrixDiag', 'MatrixDiagV2', 'MatrixDiagV3', 'MatrixSetDiag',
             'MatrixSetDiagV2', 'MatrixSetDiagV3', 'MatrixBandPart', 'MatrixDiagPart',
             'MatrixDiagPartV2', 'MatrixDiagPartV3', 'Eye'):
      return self._batch_size_value(op, kinds)
    if t in ('If', 'StatelessIf'):
      return self._cond(op, kinds)
    if t in _FUNCTIONS:
      return (f'a {"function call" if "Call" in t else "Python function" if "Py" in t else "functional control flow op"}'
              f' the library cannot see inside, fed by the batch\'s rows')
    return f'an op the library does not know how it treats the batch\'s rows ({t})'

  # -- helpers -----------------------------------------------------------------

  def _splits(self, op, kinds):
    """A RaggedTensor's row_splits: its slices, their differences, its segment ids."""
    tags = {k.tag for k in kinds if k is not None}
    if op.type == 'StridedSlice' and kinds[0] is not None and tags == {SPLITS}:
      return _SPLITS   # splits[1:], splits[:-1]
    if op.type in ('Sub',) and tags == {SPLITS}:
      return _ROWS   # row lengths
    if op.type in ('Shape', 'Size') and tags == {SPLITS}:
      return _SHAPE if op.type == 'Shape' else _SIZE
    if op.type in ('Identity', 'Cast') and tags == {SPLITS}:
      return _SPLITS
    return 'an op on a RaggedTensor\'s row splits'

  def _cond(self, op, kinds):
    """A functional tf.cond: its branches read like the rest, when the choice is not the batch's."""
    if kinds[0] is not None:
      return 'a tf.cond whose branch is chosen by a value of the batch'
    graphs = interception.branch_graphs(op)
    if graphs is None:
      return 'a functional control flow op the library cannot see inside, fed by the batch\'s rows'
    results = []
    for graph in graphs:
      inner = {t.name: k for t, k in zip(graph.inputs, kinds[1:]) if k is not None}
      outputs = [t for t in graph.outputs if t is not None]
      if len(outputs) != len(op.outputs):
        return 'a tf.cond whose branches the library cannot read'
      reader = _read(outputs, inner, self.examples, self.declared) if outputs else None
      if reader is not None and reader.mixing:
        return f'a tf.cond whose branch has {reader.mixing[0].describe()}'
      results.append([None if reader is None else reader.kind(t) for t in outputs])
    found = []
    for a, b in zip(*results):
      if a is None or b is None or a == b:
        found.append(a if b is None else b)
      else:
        return 'a tf.cond whose branches give rows of different kinds'
    return found


  def _not_rows(self, op, kind):
    if kind.tag in (STAT, SIZE, SHAPE):
      return kind if kind.tag != SHAPE else _SIZE
    return f'an op on values that are not one row per example ({kind.tag})'

  def _shape_of(self, kind):
    if kind is None:
      return None
    if kind.tag in (ROWS, FLAT, SIZE, SHAPE):
      return _SHAPE
    return kind   # a statistic's shape does not depend on the batch (or is mixed)

  def _size_of(self, kind):
    if kind is None:
      return None
    return _SIZE if kind.tag in (ROWS, FLAT, SIZE, SHAPE) else kind   # a set's size: the set's

  def _elementwise(self, op, kinds):
    present = [k for k in kinds if k is not None]
    tags = {k.tag for k in present}
    if COLS in tags:
      return _COLS if tags == {COLS} else 'values with the batch on axis 1 combined with rows'
    if UNIQUE in tags:
      return _UNIQUE if tags == {UNIQUE} else 'the batch\'s distinct values combined with rows'
    if tags <= {ROWS}:
      blocks = {k.blocks for k in present}
      if len(blocks) > 1:
        return 'rows of different stacked layouts combined'
      return self._rows_with_constants(op, kinds, present[0])
    if tags <= {FLAT}:
      return _FLAT
    if tags <= {STAT}:
      return _NORM if all(k.norm for k in present) else _STAT
    if tags == {SHAPE}:
      return _SHAPE   # still the batch size first
    if tags <= {SIZE, SHAPE}:
      return _SIZE
    if tags <= {STAT, SIZE, SHAPE}:
      return _stat_of(present)
    rows = [k for k in present if k.tag in (ROWS, FLAT)]
    others = [k for k in present if k.tag not in (ROWS, FLAT)]
    if {k.tag for k in rows} == {ROWS, FLAT}:
      return 'rows combined with values of another row layout'
    if all(k.tag == STAT and k.norm for k in others):
      return rows[0]   # a batch norm: sync_batch_norm's
    if any(k.tag == STAT for k in others):
      return 'rows combined with a statistic of the batch'
    return 'rows combined with a value of the batch size'

  def _rows_with_constants(self, op, kinds, kind):
    """Rows and values independent of the shard; a constant as long as a static batch is a batch-size value."""
    if self.examples is not None and self.examples > 1 and op.type != 'IdentityN':
      for t, k in zip(op.inputs, kinds):
        rank = t.shape.rank
        if (k is None and rank and t.op.type == 'Const' and t.shape[0] == self.examples * kind.blocks
            and any(i.shape.rank == rank for i, j in zip(op.inputs, kinds) if j is not None)):
          return ('rows combined with a constant as long as the batch (a static batch '
                  'size made it a constant)')
    return kind

  def _statistic(self, op, kind):
    if kind.tag in (ROWS, FLAT):
      return _NORM if _in_moments(op) else _STAT
    return kind if kind.tag != SHAPE else _SIZE

  def _axes(self, op, axes_tensor, rank):
    value = _value(axes_tensor)
    if value is None and axes_tensor.op.type == 'Range' and (
        axes_tensor.op.inputs[1].op.type == 'Rank' and _value(axes_tensor.op.inputs[0]) == 0):
      return list(range(64))   # range(rank(x)): every axis
    if value is None:
      return None
    axes = [int(a) for a in np.reshape(value, [-1])]
    if any(a < 0 for a in axes):
      if rank is None:
        return None
      axes = [a + rank if a < 0 else a for a in axes]
    return axes

  def _reduction(self, op, kind, axes_kind):
    if axes_kind is not None:
      return 'a reduction over axes that depend on the batch'
    if kind.tag in (STAT, SIZE, SHAPE):
      return kind if kind.tag == STAT else _SIZE
    axes = self._axes(op, op.inputs[1], op.inputs[0].shape.rank)
    if axes is None:
      return 'a reduction over axes unknown when the graph is built'
    if kind.tag == COLS:
      return _STAT if 1 in axes or not axes else kind
    if 0 in axes or kind.tag == FLAT and not axes:
      return self._statistic(op, kind)
    return kind

  def _matmul(self, op, kinds):
    a, b = kinds[0], kinds[1]
    batched = op.type != 'MatMul'
    ranks = [t.shape.rank for t in op.inputs[:2]]
    if batched and all(r is not None and r >= 3 for r in ranks if r is not None):
      if a is not None and b is not None and a.tag == b.tag == ROWS and a.blocks == b.blocks:
        return a   # one product per example
      if (a is not None and a.tag == ROWS and b is None and ranks[1] and ranks[1] <= 2) or (
          b is not None and b.tag == ROWS and a is None and ranks[0] and ranks[0] <= 2):
        return a if a is not None else b   # the same weights for every example
      if ranks[0] and ranks[0] >= 3 and ranks[1] and ranks[1] >= 3:
        return 'a batched matrix product of the batch with other values'
    flips = (op.get_attr('adj_x'), op.get_attr('adj_y')) if batched else (
        op.get_attr('transpose_a'), op.get_attr('transpose_b'))
    # Where each operand's batch axis goes: 'free' (a result axis) or 'summed'.
    places = []
    for i, k in enumerate((a, b)):
      axis = _batch_axis(k)
      if axis is None or (ranks[i] is not None and ranks[i] != 2):
        places.append(None if k is None or k.tag in (STAT, SIZE) else 'unknown')
        continue
      if flips[i]:
        axis = 1 - axis
      free = axis == 0 if i == 0 else axis == 1
      places.append('free' if free else 'summed')
    if 'unknown' in places:
      return 'a matrix product of values with the batch on an unknown axis'
    if places == ['summed', 'summed']:
      return _STAT   # a sum over the examples (x^T y, a count by a dot product)
    if places[0] is not None and places[1] is not None:
      return 'a matrix product of two operands that depend on the batch'
    other = b if places[0] is not None else a
    place = places[0] if places[0] is not None else places[1]
    if place is None:   # statistics and batch-size values only
      return _stat_of([a, b]) if any(k is not None and k.tag == STAT for k in (a, b)) else _SIZE
    if other is not None:   # the batch's rows against a statistic
      if other.tag == STAT and other.norm and place == 'free':
        return a if places[0] is not None else _COLS
      return ('a matrix product of the batch\'s rows with a statistic of the batch'
              if other.tag == STAT else 'a matrix product of the batch\'s rows with a value '
              'of the batch size')
    if place == 'summed':
      return _STAT
    if places[0] is not None:
      return Kind(a.tag, a.blocks) if a.tag != COLS else _ROWS
    return _COLS

  def _reshape(self, op, kinds):
    x, shape = kinds
    if x is None:
      return ('a reshape of a constant to the batch\'s size' if shape is not None
              else None)
    if x.tag in (STAT, SIZE, SHAPE):
      return x if x.tag == STAT else _SIZE
    if shape is not None and shape.tag == SHAPE:
      return Kind(ROWS, x.blocks) if x.tag == ROWS else _ROWS
    out, in_shape = op.outputs[0].shape, op.inputs[0].shape
    value = _value(op.inputs[1]) if shape is None else None
    if value is not None and value.ndim == 1 and out.rank == len(value):
      out = out.merge_with([None if d < 0 else int(d) for d in value])
    if shape is not None and op.inputs[1].op.type == 'Pack' and x.tag in (ROWS, FLAT) and (
        [self.kind(e) is not None for e in op.inputs[1].op.inputs][:2] == [False, True]) and (
            _value(op.inputs[1].op.inputs[0]) == 1):
      return _COLS   # [1, n * ..., ...]: layer norm's fused batch norm over the examples
    if shape is not None and op.inputs[1].op.type == 'Pack':   # [n, -1], [1, n], ...
      elements = op.inputs[1].op.inputs
      sized = [i for i, e in enumerate(elements) if self.kind(e) is not None]
      first = _value(elements[0]) if len(elements) > 1 else None
      if sized == [0] and all(self.kind(e) is None or self.kind(e).tag == SIZE
                              for e in elements):
        return Kind(ROWS, x.blocks) if x.tag == ROWS else _ROWS
      if sized == [1] and len(elements) == 2 and first is not None and first == 1 and (
          in_shape.rank == 1):
        return _COLS
      if sized == [0] and len(elements) == 2 and _value(elements[1]) is not None and (
          _value(elements[1]) == 1) and in_shape.rank == 1:
        return x
    if x.tag == COLS:
      if shape is not None and in_shape.rank and in_shape[0] == 1 and (
          op.inputs[1].op.type == 'Shape' or shape.tag == SHAPE):
        return _ROWS   # [1, n, ...] back to the rows' shape
      return 'a reshape of values with the batch on axis 1'
    if out.rank == 0:
      return 'a reshape of the batch to one value'
    if out.rank is None:
      return 'a reshape to an unknown rank'
    if in_shape.rank == 1 and out.rank == 2 and out[0] == 1:
      return _COLS   # [n] -> [1, n]
    if self.examples is not None and out[0] == self.examples * x.blocks and x.tag == ROWS:
      return Kind(ROWS, x.blocks)
    inner_in = _product(in_shape[1:]) if in_shape.rank else None
    inner_out = _product(out[1:])
    if inner_in is not None and inner_out is not None:
      if inner_in == inner_out and x.tag == ROWS:
        return x
      if inner_out and inner_in % inner_out == 0:
        return _FLAT   # the batch axis merged with the next ones
      return 'a reshape that moves values between the batch\'s rows'
    if out.rank == 1:
      return _FLAT
    return 'a reshape whose rows cannot be told from the graph'

  def _shaped(self, op, kinds):
    index = _SHAPED[op.type]
    shape = kinds[index]
    rest = [k for i, k in enumerate(kinds) if i != index and k is not None]
    if shape is None:
      if rest and all(k.tag in (ROWS,) for k in rest) and op.type == 'BroadcastTo':
        return 'a broadcast of rows to a shape that does not depend on the batch'
      return rest[0] if rest and rest[0].tag in (STAT, SIZE) else 'an op on the batch\'s rows'
    if shape.tag != SHAPE:
      return _SIZE if shape.tag == SIZE and not rest else 'an op shaped by a value of the batch'
    if any(k.tag not in (ROWS, STAT) for k in rest):
      return 'an op shaped by the batch, of values that are not rows'
    if any(k.tag == STAT and not k.norm for k in rest):
      return 'rows made from a statistic of the batch'
    return _ROWS

  def _tile(self, op, kinds):
    x, multiples = kinds
    value = _value(op.inputs[1])
    if multiples is None and x is not None and x.tag in (ROWS, FLAT) and value is not None and (
        value[0] == 1):
      return x
    if multiples is None and x is not None and x.tag == COLS and value is not None and (
        len(value) == 2 and value[1] == 1):
      return x   # more rows of the same columns (tf.metrics.auc's thresholds)
    elements = op.inputs[1].op.inputs if op.inputs[1].op.type == 'Pack' else ()
    sized = [i for i, e in enumerate(elements) if self.kind(e) is not None]
    if x is None and multiples is not None and op.inputs[0].shape.rank == len(elements):
      if sized == [0] and op.inputs[0].shape[0] == 1:
        return _ROWS
      if sized == [1] and len(elements) == 2 and op.inputs[0].shape[1] == 1:
        return _COLS   # a constant column repeated for every example
    if multiples is not None and multiples.tag == SHAPE and (x is None) and (
        op.inputs[0].shape.rank and op.inputs[0].shape[0] == 1):
      return _ROWS
    if x is not None and x.tag in (STAT, SIZE) and multiples is None:
      return x
    return 'a tile of the batch axis'

  def _transpose(self, op, kinds):
    x, perm = kinds
    value = _value(op.inputs[1])
    if perm is None and x.tag in (STAT, SIZE):
      return x
    if perm is None and value is not None and (len(value) == 0 or value[0] == 0):
      return x if x.tag != SHAPE else _SIZE
    if perm is None and value is not None and list(value) == [1, 0] and x.tag in (ROWS, COLS):
      return _COLS if x.tag == ROWS else _ROWS
    return 'a transpose that moves the batch axis'

  def _expand_dims(self, op, kinds):
    x, axis = kinds
    value = _value(op.inputs[1])
    if axis is None and x.tag in (STAT, SIZE):
      return x
    if axis is None and value is not None:
      a = int(np.reshape(value, [-1])[0])
      rank = op.inputs[0].shape.rank
      if a > 0 or (a < 0 and rank is not None and a + rank + 1 > 0):
        return x if x.tag != SHAPE else _SIZE
      if x.tag == SHAPE or x.tag == SIZE:
        return _SIZE
    return 'a new axis before the batch axis'

  def _squeeze(self, op, kinds):
    x = kinds[0]
    if x.tag in (STAT, SIZE):
      return x
    dims = list(op.get_attr('squeeze_dims'))
    rank = op.inputs[0].shape.rank
    dims = [d + rank if d < 0 and rank is not None else d for d in dims]
    if (dims and 0 not in dims and (rank is None or all(d >= 0 for d in dims))) or (
        not dims and op.inputs[0].shape.rank and op.inputs[0].shape[0] != 1):
      return x if x.tag != SHAPE else _SIZE
    return 'a squeeze of the batch axis'

  def _concat(self, op, kinds, axis_kind, axis_tensor):
    if axis_kind is not None:
      return 'a concat along an axis computed from the batch'
    rank = op.outputs[0].shape.rank
    axes = self._axes(op, axis_tensor, rank)
    if axes is None:
      return 'a concat along an axis unknown when the graph is built'
    present = [k for k in kinds if k is not None]
    if axes[0] != 0:
      return self._elementwise(op, kinds[:])
    tags = {k.tag for k in present}
    if tags == {ROWS} and len(present) == len(kinds):
      return Kind(ROWS, sum(k.blocks for k in present))
    if tags == {FLAT} and len(present) == len(kinds):
      return _FLAT
    if kinds[0] is not None and kinds[0].tag == SHAPE and tags == {SHAPE}:
      return _SHAPE
    if kinds[0] is not None and kinds[0].tag == SHAPE and len(present) == 1:
      return _SHAPE   # the batch size first, then sizes that do not depend on it
    if tags <= {STAT, SIZE, SHAPE}:
      return _stat_of(present) if STAT in tags else _SIZE
    return 'a concat on the batch axis of rows with other values'

  def _pack(self, op, kinds):
    axis = op.get_attr('axis')
    present = [k for k in kinds if k is not None]
    tags = {k.tag for k in present}
    if axis != 0 and (axis > 0 or op.outputs[0].shape.rank is not None) and (
        axis > 0 or axis + op.outputs[0].shape.rank > 0):
      return self._elementwise(op, kinds)
    if tags <= {SIZE} and kinds[0] is not None and all(
        t.shape.rank == 0 for t in op.inputs):
      return _SHAPE
    if tags <= {STAT, SIZE}:
      return _stat_of(present) if STAT in tags else _SIZE
    if tags == {ROWS} and len(present) == len(kinds) and len({k.blocks for k in present}) == 1:
      return _COLS   # [n] values stacked: the batch on axis 1
    return 'a stack of rows on a new axis before the batch axis'

  def _unpack(self, op, kind):
    axis = op.get_attr('axis')
    if kind.tag == SHAPE and axis == 0:
      return [_SIZE] + [None] * (len(op.outputs) - 1)
    if kind.tag in (STAT, SIZE):
      return [kind] * len(op.outputs)
    rank = op.inputs[0].shape.rank
    if axis > 0 or (axis < 0 and rank is not None and axis + rank > 0):
      return [kind] * len(op.outputs)
    return 'an unstack of the batch axis'

  def _split(self, op, kind, axis_tensor, num_split, sizes_kind=None):
    if kind is not None and kind.tag in (STAT, SIZE) and (
        sizes_kind is None or sizes_kind.tag in (STAT, SIZE, SHAPE)):
      return [kind] * len(op.outputs)
    if sizes_kind is not None:
      return 'a split whose sizes depend on the batch'
    axes = self._axes(op, axis_tensor, op.outputs[0].shape.rank)
    if axes is None:
      return 'a split along an axis unknown when the graph is built'
    if kind.tag in (STAT, SIZE):
      return [kind] * len(op.outputs)
    if axes[0] != 0:
      return [kind] * len(op.outputs)
    count = len(op.outputs)
    if kind.tag == ROWS and num_split is not None and kind.blocks % count == 0:
      return [Kind(ROWS, kind.blocks // count)] * count
    return 'a split of the batch axis'

  def _strided_slice(self, op, kinds):
    x = kinds[0]
    if any(k is not None for k in kinds[1:]):
      return self._slice_by_batch(op, x)
    begin, end, strides = (_value(t) for t in op.inputs[1:4])
    begin_mask, end_mask = op.get_attr('begin_mask'), op.get_attr('end_mask')
    ellipsis, new_axis = op.get_attr('ellipsis_mask'), op.get_attr('new_axis_mask')
    shrink = op.get_attr('shrink_axis_mask')
    if x.tag == SHAPE:
      if begin is None:
        return _SIZE
      if ellipsis & 1 or new_axis & 1:
        return _SIZE
      length = op.inputs[0].shape[0] if op.inputs[0].shape.rank else None
      start = 0 if begin_mask & 1 else int(begin[0])
      if start < 0:
        start = start + length if length is not None else -1
      if start < 0:
        return _SIZE
      if shrink & 1:
        return _SIZE if start == 0 else None
      return _SHAPE if start == 0 else None
    if x.tag in (STAT, SIZE):
      return x
    if ellipsis & 1:
      return x
    if new_axis & 1 or shrink & 1:
      return 'a slice that picks rows of the batch'
    whole = (begin_mask & 1 or (begin is not None and begin[0] == 0)) and (end_mask & 1) and (
        strides is not None and strides[0] == 1)
    return x if whole else 'a slice of the batch axis'

  def _slice_by_batch(self, op, x):
    if x.tag in (ROWS, FLAT):
      return 'a slice of the batch axis at positions computed from the batch'
    return _SIZE if x.tag in (SIZE, SHAPE) else x

  def _slice(self, op, kinds):
    x = kinds[0]
    if any(k is not None for k in kinds[1:]):
      return self._slice_by_batch(op, x)
    begin, size = _value(op.inputs[1]), _value(op.inputs[2])
    if x.tag in (STAT, SIZE):
      return x
    if x.tag == SHAPE:
      if begin is not None and begin[0] > 0 and _value(op.outputs[0]) is not None:
        return None   # static sizes after the batch's: the same on every shard
      return _SHAPE if begin is not None and begin[0] == 0 else _SIZE
    if begin is not None and size is not None and begin[0] == 0 and size[0] == -1:
      return x
    return 'a slice of the batch axis'

  def _pad(self, op, kinds):
    x = kinds[0]
    if any(k is not None for k in kinds[1:]):
      return 'padding computed from the batch'
    paddings = _value(op.inputs[1])
    if x.tag in (STAT, SIZE):
      return x
    if paddings is not None and not np.any(paddings[0]):
      return x
    return 'padding of the batch axis'

  def _segments(self, op, kinds):
    data, indices, segment_ids = kinds[:3]
    if (data is None or data.tag in (UNIQUE, FLAT)) and indices is not None and (
        indices.tag == FLAT) and segment_ids is not None and segment_ids.tag == FLAT and all(
            k is None or k.tag in (SIZE, SHAPE) for k in kinds[3:]):
      return _ROWS   # one sum per example of its entries
    return 'a segment reduction across the batch\'s rows'

  def _gather(self, op, kinds):
    params, indices = kinds[0], kinds[1]
    axis = 0
    if op.type == 'GatherV2':
      if kinds[2] is not None:
        return 'a gather along an axis computed from the batch'
      value = _value(op.inputs[2])
      if value is None:
        return 'a gather along an axis unknown when the graph is built'
      axis = int(value)
      if axis < 0:
        rank = op.inputs[0].shape.rank
        axis = axis + rank if rank is not None else -1
    if op.type == 'ResourceGather':
      params = None if params is None or params.tag != MIXED else params
    if params is None:   # a table looked up by ids: the ids' rows
      if indices.tag in (ROWS, FLAT, UNIQUE):
        return indices
      return indices if indices.tag in (STAT,) else 'a gather of the batch size\'s values'
    if params.tag in (STAT, SIZE, SHAPE) and indices is None:
      if params.tag == SHAPE:
        value = _value(op.inputs[1])
        if value is not None and value.size == 0:
          return None
        if value is not None and np.reshape(value, [-1])[0] == 0:
          return _SHAPE if value.ndim else _SIZE
        return _SIZE if value is None or 0 in np.reshape(value, [-1]) else None
      return params
    if params.tag in (ROWS, FLAT) and axis > 0 and indices is None:
      return params
    if params.tag in (ROWS, FLAT) and axis == 0 and indices is not None and indices.tag in (ROWS, FLAT):
      return _FLAT   # rows picked by the rows' own values (tf.boolean_mask)
    if params.tag in (STAT, SIZE) and indices is not None and indices.tag in (STAT, SIZE):
      return _stat_of(kinds)
    return 'a gather across the batch axis'

  def _gather_nd(self, op, kinds):
    params, indices = kinds
    if params is None:
      return indices if indices.tag in (ROWS, FLAT, STAT) else 'a gather of the batch size\'s values'
    if indices is not None and indices.tag in (ROWS, FLAT) and params.tag in (ROWS, FLAT):
      return _FLAT
    if params.tag in (STAT,) and indices is None:
      return params
    return 'a gather across the batch axis'

  def _last_axis(self, op, kinds, why):
    x = kinds[0]
    rank = op.inputs[0].shape.rank
    if x.tag not in (STAT, SIZE) and not (x.tag == ROWS and rank is not None and rank >= 2):
      return why
    if any(k is not None for k in kinds[1:]):
      return 'an op whose size depends on the batch'
    return [x] * len(op.outputs)

  def _reverse(self, op, kinds):
    x = kinds[0]
    if kinds[1] is not None:
      return 'a reverse along axes computed from the batch'
    if x.tag in (STAT, SIZE):
      return x
    axes = self._axes(op, op.inputs[1], op.inputs[0].shape.rank)
    if axes is not None and 0 not in axes:
      return x
    return 'a reverse across the batch axis'

  def _along_axis(self, op, x, axis_tensor, why):
    if x.tag in (STAT, SIZE):
      return x
    axes = self._axes(op, axis_tensor, op.inputs[0].shape.rank)
    if axes is not None and 0 not in axes:
      return x
    return why

  def _batch_size_value(self, op, kinds):
    present = [k for k in kinds if k is not None]
    if all(k.tag == UNIQUE for k in present):
      return _UNIQUE   # positions in the batch's distinct values
    if all(k.tag in (SIZE, SHAPE) for k in present):
      return _SIZE
    if all(k.tag in (SIZE, SHAPE, STAT) for k in present):
      return _stat_of(present)
    return f'a {op.type} of the batch\'s rows'


def _stat_of(kinds: Sequence) -> Kind:
  """A statistic made from `kinds`: a batch norm's if every statistic among them is."""
  stats = [k for k in kinds if k is not None and k.tag == STAT]
  return _NORM if stats and all(k.norm for k in stats) else _STAT


def _in_moments(op: tf.Operation) -> bool:
  """True for a reduction that `tf.nn.moments` (or sync batch norm) made: a batch norm's."""
  return any('moments' in part or part.startswith('SyncBatchNorm')
             for part in op.name.split('/')[:-1])


def _batch_axis(kind: Kind | None) -> int | None:
  if kind is None:
    return None
  return {ROWS: 0, FLAT: 0, COLS: 1}.get(kind.tag)


def _product(dims) -> int | None:
  total = 1
  for d in dims:
    if d is None:
      return None
    total *= int(d)
  return total


_ASSIGNS = frozenset(('AssignAddVariableOp', 'AssignSubVariableOp', 'AssignVariableOp',
                      'AssignAdd', 'AssignSub', 'Assign', 'ResourceScatterAdd', 'ScatterAdd',
                      'ResourceScatterUpdate', 'ScatterUpdate'))


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
    if op.type in _ASSIGNS and op.inputs[0].op.name in metric_variables:
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
    _report([t for t in targets if isinstance(t, tf.Tensor)], found, loss_reduction,
            micro_batches, note)
  return found


def _report(targets: list, found: RowDependence, loss_reduction: str,
            micro_batches: bool, note: str | None = None) -> None:
  first = found.mixing[0]
  what = (f'the loss {targets[0].name}' if len(targets) == 1
          else 'the tensors ' + ', '.join(t.name for t in targets))
  more = len(found.mixing) - 1
  others = (f' (and {more} more such op{"s" if more > 1 else ""}, first '
            f'{", ".join(repr(m.op.name) for m in found.mixing[1:4])}'
            f'{", ..." if more > 3 else ""})' if more else '')
  may = 'may make' if first.op.type in _FUNCTIONS or 'does not know' in first.why else 'makes'
  mixes = (f'{what} depends on {first.describe()}{others}, which {may} a row depend on '
           f'other examples of the batch')
  if micro_batches:
    raise ValueError(
        f'{spelling.name("micro_batches")} > 1 cannot train this model_fn: {mixes}, and '
        f'micro-batches, which run one after another, never hold the whole batch\'s '
        f'rows at once, so such a loss trains only through its head on the whole batch, '
        f'which cannot be built here: {note or "the loss is not computed on the whole batch"}'
        f'. Use {spelling.setting("micro_batches", 1)} (see docs/cross_example.md).')
  where = (f'the whole batch\'s head cannot be built here: {note}' if note else
           'the library does not compute this loss on the whole batch here')
  message = (
      f'estimator_towers: {mixes}. Towers compute it on each shard\'s rows only, so the '
      f'result differs from the single-device model_fn\'s on the whole batch (an '
      f'in-batch softmax sees fewer negatives, a batch top-k picks other examples): '
      f'{where} (see docs/cross_example.md). Run this model_fn on one device for the '
      f'single-device result.')
  if loss_reduction == 'exact':
    raise ValueError(message + " loss_reduction='exact' makes this an error; use "
                     "loss_reduction='auto' to train with each shard's rows.")
  logs.warning_once(message + " Pass loss_reduction='exact' to make this an error.",
                    key=f'row_dependence:{first.op.name}')
