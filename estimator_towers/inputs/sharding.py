"""Splitting a global batch into per-tower shards, and joining results back.

The rule (used by the towered model_fn and by the staged input pipeline alike):
a batch of B examples over N towers gives tower k the examples
[offset_k, offset_k + size_k), where size_k = B // N + (1 if k < B % N else 0).
Shard sizes differ by at most one, the first towers take the extra examples,
tower 0 always holds the largest shard (so it is empty only when the whole batch
is), and a batch smaller than N leaves the last towers with empty shards.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from estimator_towers.base import shapes

Structure = Any  # A Tensor, SparseTensor, RaggedTensor or nested dict/list/tuple of them.


def flatten_with_paths(structure: Structure, prefix: str = '') -> list[tuple[str, Any]]:
  """Flattens a nested dict/list/tuple into (path, leaf) pairs, in tf.nest order."""
  if isinstance(structure, dict):
    items = []
    for key in sorted(structure):
      items.extend(flatten_with_paths(structure[key], f'{prefix}/{key}' if prefix else str(key)))
    return items
  if isinstance(structure, (list, tuple)):
    items = []
    for i, value in enumerate(structure):
      items.extend(flatten_with_paths(value, f'{prefix}/{i}' if prefix else str(i)))
    return items
  return [(prefix or '<tensor>', structure)]


def static_rows(t: Any) -> int | None:
  """The batch (first) dimension of a leaf, when known statically."""
  return shapes.dim(t)


def rows(t: Any) -> tf.Tensor:
  """The batch (first) dimension of a leaf, as an int32 scalar Tensor."""
  if isinstance(t, tf.SparseTensor):
    return tf.cast(t.dense_shape[0], tf.int32)
  if isinstance(t, tf.RaggedTensor):
    return tf.cast(t.nrows(), tf.int32)
  return tf.shape(t, out_type=tf.int32)[0]


def _check_leaf(path: str, t: Any, what: str) -> None:
  if isinstance(t, (tf.SparseTensor, tf.RaggedTensor)):
    rank = t.shape.rank
  elif isinstance(t, tf.Tensor):
    rank = t.shape.rank
  else:
    raise TypeError(
        f'{what} {path!r} is a {type(t).__name__}; towers can only split '
        f'Tensor, SparseTensor and RaggedTensor values (or nested dicts, '
        f'lists and tuples of them). Convert it with tf.convert_to_tensor '
        f'in your input_fn.')
  if rank == 0:
    raise ValueError(
        f'{what} {path!r} has shape {t.shape} and no batch dimension: every '
        f'feature and label is split along axis 0 across towers, so each must '
        f'have the batch as its first dimension. Give it shape [batch, ...] '
        f'in your input_fn (e.g. tf.fill([batch_size], value)), or build it '
        f'inside the model_fn instead.')


def batch_size(features: Structure, labels: Structure | None) -> tf.Tensor | int:
  """The global batch size, after checking every leaf has the same one.

  Returns:
    A Python int when the batch size is known statically, else an int32 scalar
    Tensor (carrying run-time checks that every leaf agrees).

  Raises:
    ValueError: at graph construction, for a leaf without a batch dimension or
      leaves whose static batch sizes differ.
  """
  leaves = [('feature', p, t) for p, t in flatten_with_paths(features)]
  if labels is not None:
    leaves += [('label', p, t) for p, t in flatten_with_paths(labels)]
  if not leaves:
    raise ValueError('features is empty: towers need at least one feature '
                     'tensor to know the batch size.')
  for what, path, t in leaves:
    _check_leaf(path, t, what)

  known = [(what, path, t, static_rows(t)) for what, path, t in leaves]
  known_sizes = [(what, path, t, n) for what, path, t, n in known if n is not None]
  for what, path, t, n in known_sizes[1:]:
    w0, p0, t0, n0 = known_sizes[0]
    if n != n0:
      raise ValueError(
          f'All features and labels must have the same batch size (their '
          f'first dimension), but {w0} {p0!r} has {n0} rows and {what} '
          f'{path!r} has {n}. Batch them together in your input_fn.')
  if len(known_sizes) == len(known):
    return int(known_sizes[0][3])

  reference = rows(leaves[0][2])
  checks = []
  for what, path, t in leaves[1:]:
    checks.append(tf.debugging.assert_equal(
        rows(t), reference,
        message=(f'All features and labels must have the same batch size, '
                 f'but {what} {path!r} differs from {leaves[0][0]} '
                 f'{leaves[0][1]!r}. Batch them together in your input_fn.')))
  if checks:
    with tf.control_dependencies(checks):
      reference = tf.identity(reference)
  return reference


def shard_sizes(batch: tf.Tensor | int, num_shards: int) -> list:
  """Shard sizes for `num_shards` towers (Python ints when `batch` is static)."""
  if isinstance(batch, int):
    q, r = divmod(batch, num_shards)
    return [q + (1 if k < r else 0) for k in range(num_shards)]
  if num_shards == 1:
    return [batch]
  # As one vector, unstacked: a few ops for all the shards (not a few per shard).
  extra = tf.cast(tf.constant(list(range(num_shards)), tf.int32) < batch % num_shards,
                  tf.int32)
  return tf.unstack(batch // num_shards + extra, num=num_shards)


def _offsets(sizes: Sequence) -> list:
  offsets, total = [], 0
  for s in sizes:
    offsets.append(total)
    total = total + s
  return offsets


class _Rows:
  """Rows [start, start + size) of a batch (ints or int32 scalar Tensors); `bounds`: the
  strided slice's begin, end and strides, if made already."""

  def __init__(self, start: Any, size: Any, bounds: tuple | None = None):
    self.start, self.size = start, size
    self._bounds = bounds

  def take(self, t: Any) -> Any:
    """These rows of a leaf (None stays None)."""
    if t is None:
      return None
    if isinstance(t, tf.SparseTensor):
      rest = t.dense_shape[1:]
      start = tf.cast(self.start, tf.int64)
      # As many rows as a dense slice has: the shard's size within the batch
      # (none for an empty batch's borrowed row 0, as Tensors and RaggedTensors).
      size = tf.clip_by_value(t.dense_shape[0] - start, 0, tf.cast(self.size, tf.int64))
      begin = tf.concat([tf.reshape(start, [1]), tf.zeros_like(rest)], 0)
      extent = tf.concat([tf.reshape(size, [1]), rest], 0)
      piece = tf.sparse.slice(t, begin, extent)
      # sparse.slice clips the shape to the last stored row; restore the
      # shard's true shape so that empty trailing rows are kept.
      return tf.SparseTensor(piece.indices, piece.values, extent)
    if isinstance(t, tf.RaggedTensor):
      return t[self.start:self.start + self.size]
    if self._bounds is None:  # made once, shared by the leaves
      self._bounds = (tf.reshape(self.start, [1]), tf.reshape(self.start + self.size, [1]),
                      tf.ones([1], tf.int32))
    # Leading rows: the slice shares the batch's buffer (no copy when aligned).
    return tf.strided_slice(t, *self._bounds)


def _split_leaf(t: Any, sizes: Sequence, offsets: Sequence) -> list:
  if t is None or isinstance(t, (tf.SparseTensor, tf.RaggedTensor)):
    return [_Rows(off, size).take(t) for off, size in zip(offsets, sizes)]
  if all(isinstance(s, int) for s in sizes):
    return tf.split(t, sizes, axis=0, num=len(sizes))
  return tf.split(t, tf.stack(sizes), axis=0, num=len(sizes))


def split(structure: Structure | None, sizes: Sequence, fill_empty: bool = False) -> list:
  """Splits every leaf of `structure` along axis 0 into len(sizes) shards.

  Args:
    structure: the batch (None leaves, such as absent labels, stay None).
    sizes: shard sizes (Python ints or int32 scalar Tensors).
    fill_empty: for training: a shard after the first whose size is known
      only at run time, and turns out to be 0, holds the batch's first
      example instead (as `fill_empty` does). These shards are slices of the
      batch, taken without a `tf.cond`.
  """
  if structure is None:
    return [None] * len(sizes)
  flat = tf.nest.flatten(structure)
  if fill_empty and not any(isinstance(s, int) for s in sizes):
    rows = _borrowing_rows(sizes)
    pieces = [[r.take(t) for r in rows] for t in flat]
  elif fill_empty and not all(isinstance(s, int) for s in sizes):
    offsets = _offsets(sizes)
    rows = [_Rows(offsets[0], sizes[0])] + [
        _Rows(off, size) if isinstance(size, int) else _borrowing(off, size)
        for off, size in zip(offsets[1:], sizes[1:])]
    pieces = [[r.take(t) for r in rows] for t in flat]
  else:
    offsets = _offsets(sizes)
    pieces = [_split_leaf(t, sizes, offsets) for t in flat]
  return [tf.nest.pack_sequence_as(structure, [p[k] for p in pieces])
          for k in range(len(sizes))]


def _borrowing_rows(sizes: Sequence[tf.Tensor]) -> list:
  """Every shard's rows (`_borrowing`'s, but the first shard's own), from sizes all known
  at run time only: computed as vectors over the shards and unstacked, a few ops for all
  the shards (the same integers as `_offsets` and `_borrowing` give one by one)."""
  n = len(sizes)
  sizes_v = tf.stack(sizes)
  offsets = tf.cumsum(sizes_v, exclusive=True)
  starts = tf.where(sizes_v > 0, offsets, tf.zeros_like(offsets))
  counts = tf.maximum(sizes_v, tf.constant([0] + [1] * (n - 1), tf.int32))
  column = tf.constant([n, 1], tf.int32)
  begins = tf.unstack(tf.reshape(starts, column), num=n)
  ends = tf.unstack(tf.reshape(starts + counts, column), num=n)
  strides = tf.ones([1], tf.int32)
  return [_Rows(start, count, (begin, end, strides)) for start, count, begin, end in zip(
      tf.unstack(starts, num=n), tf.unstack(counts, num=n), begins, ends)]


def _borrowing(offset: Any, size: tf.Tensor) -> _Rows:
  """A shard's rows: its own, or row 0 alone when it has none."""
  return _Rows(tf.where(size > 0, offset, 0), tf.maximum(size, 1))


def _first_row(t: Any) -> Any:
  """Row 0 of a leaf, or no rows when it has none (as `t[:1]`)."""
  if isinstance(t, tf.SparseTensor):
    rest = t.dense_shape[1:]
    extent = tf.concat([tf.minimum(t.dense_shape[:1], 1), rest], 0)
    piece = tf.sparse.slice(t, tf.zeros_like(t.dense_shape), extent)
    return tf.SparseTensor(piece.indices, piece.values, extent)
  return t[:1]  # Tensors and RaggedTensors


def fill_empty(shard: Structure | None, size: tf.Tensor, donor: Structure | None) -> Structure:
  """`shard`, or the first example of `donor` when `shard` has no rows.

  For shards that are not slices of one batch (staged input; `split` fills
  slices without a `tf.cond`). For training only: a tower whose shard turns
  out empty at run time (a last batch smaller than the number of towers)
  computes its loss on one borrowed example instead, with weight zero. Its
  contribution to the gradient is then exactly zero, where an empty batch
  could give NaN (batch normalisation's statistics of no rows).
  """
  if shard is None:
    return None
  return tf.cond(size > 0, lambda: shard,
                 lambda: tf.nest.map_structure(_first_row, donor))


def _concat_leaf(parts: Sequence) -> Any:
  if isinstance(parts[0], tf.SparseTensor):
    return tf.sparse.concat(0, list(parts), expand_nonconcat_dims=True)
  return tf.concat(list(parts), axis=0)  # Tensors and RaggedTensors


def concat(shards: Sequence[Structure]) -> Structure:
  """Joins per-tower structures back into one, in tower (= input) order."""
  if shards[0] is None:
    return None
  flat = [tf.nest.flatten(s) for s in shards]
  joined = [_concat_leaf([f[i] for f in flat]) for i in range(len(flat[0]))]
  return tf.nest.pack_sequence_as(shards[0], joined)
