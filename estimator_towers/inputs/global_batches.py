"""Global batches for the workers of a cluster: one sequence, each worker its rows.

Rule: across W workers (`variable_strategy='collective'`) the global batch is
the workers' batches in rank order. For one input position to describe every
worker, and to hold on another number of workers, every worker reads the same
dataset of global batches, `global_batches(dataset, global_batch_size)`, and
the library takes worker r's rows of each (`worker_rows`): the towers' rule
(`sharding.shard_sizes`), B // W rows each and one more for the first B % W
workers, in rank order. Every worker's iterator is then at the same place of
the same sequence, so the chief's position is every worker's, and a run
resumes on any number of workers (one included) with the same global batches.

The cost: each worker reads every global batch, so the input's work is done W
times; transformations after `global_batches` (a vectorized parse in a `map`)
run on whole batches too. A dataset read on one machine needs no helper.
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

# Per graph: the names of the ops `global_batches` made.
_made: 'weakref.WeakKeyDictionary[tf.Graph, set]' = weakref.WeakKeyDictionary()


def global_batches(dataset: tf.data.Dataset, global_batch_size: int,
                   drop_remainder: bool = False) -> tf.data.Dataset:
  """Batches of `global_batch_size` examples that every worker reads alike.

  Use it in the input_fn of a training across workers
  (`variable_strategy='collective'`) instead of batching each worker's own
  shard of the data: every worker builds the same dataset (no
  `dataset.shard`), and the library gives each worker its rows of every
  global batch. The input's position is then saved in the chief's
  checkpoints and restored on every worker, on any number of workers.

  Args:
    dataset: a dataset of single examples, the same on every worker (its
      order seeded: `shuffle(n, seed=...)`).
    global_batch_size: examples per global batch, over all workers.
    drop_remainder: as `Dataset.batch`'s.

  Returns:
    `dataset.batch(global_batch_size, drop_remainder)`. Element-wise
    transformations (map, prefetch) may follow; none that changes the rows.

  Raises:
    TypeError: if `dataset` is not a tf.data.Dataset.
    ValueError: if `global_batch_size` is not a positive int.

  Example:
      ```python
      def input_fn():
        examples = tf.data.TFRecordDataset(files).shuffle(10000, seed=1).repeat()
        return estimator_towers.global_batches(examples, 256).map(parse_batch)
      ```
  """
  if not isinstance(dataset, tf.data.Dataset):
    raise TypeError(f'global_batches needs a tf.data.Dataset of single examples, got '
                    f'{type(dataset).__name__}.')
  if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or (
      global_batch_size < 1):
    raise ValueError(f'global_batch_size must be a positive int (the examples of one '
                     f'step over all workers), got {global_batch_size!r}.')
  batched = dataset.batch(global_batch_size, drop_remainder=drop_remainder)
  variant = tf.data.experimental.to_variant(batched)
  _made.setdefault(variant.graph, set()).add(variant.op.name)
  return batched


def is_global(variant: tf.Tensor) -> bool:
  """Whether the dataset of `variant` reads through `global_batches`."""
  made = _made.get(variant.graph, set())
  pending, seen = [variant.op], set()
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.name in made:
      return True
    pending.extend(t.op for t in op.inputs if t.dtype == tf.variant)
  return False


def worker_rows(element: Any, rank: int, count: int) -> Any:
  """Worker `rank`'s rows of a global batch (every leaf dense, rows first)."""
  leaves = tf.nest.flatten(element)
  batch = tf.shape(leaves[0], out_type=tf.int64)[0]
  share, extra = batch // count, batch % count
  start = rank * share + tf.minimum(tf.constant(rank, tf.int64), extra)
  size = share + tf.cast(rank < extra, tf.int64)
  return tf.nest.map_structure(lambda t: t[start:start + size], element)
