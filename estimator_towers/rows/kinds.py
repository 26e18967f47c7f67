"""Kinds: what a tensor's rows are, and what `classify` gives back.

The rule. Every tensor between the shard's inputs and a target that depends
on the shard has one `Kind`: its `tag` (rows, flat, columns, statistic,
batch size, shape, distinct values, row splits, positions, offsets,
indices, lifted, mixed: `row_dependence`'s module doc says what each
means), for rows how many copies of the examples are stacked on axis 0, for
a statistic whether it is a batch norm's, for flat rows how many each
example has (`per`), for `tf.where`'s positions, offsets and indices which
rows they index (`index`); for entries lifted onto axis 1 (`[1, n, ...]`,
the pad-removing FFN's `expand_dims(x, 0)`) whether they were rows or flat. A
tensor that depends on no input of the shard has none. The readers return
one of the shared kinds below (`ROWS_KIND`, ...) or a `Kind` they build.
This module owns the kinds and the result types (`Mixing`, `RowDependence`)
and reads no graph.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import tensorflow as tf

ROWS, FLAT, COLS, STAT, SIZE, SHAPE, UNIQUE, SPLITS, OFFSETS, INDICES, MIXED = (
    'rows', 'flat', 'columns', 'statistic', 'batch size', 'shape', 'distinct values',
    'row splits', 'offsets', 'indices', 'mixed')
# `tf.where`'s indices: positions in the shard's rows or flat rows (the shard's layout, not an
# example's values: only a gather or scatter of the same rows by them keeps each example's).
POSITIONS = 'positions'
# Rows or flat rows behind a new leading axis of 1 ([1, n, ...]: the batch on axis 1, each
# entry still its example's), and the shape of such a tensor ([1, n, ...]).
LIFTED, LIFTED_SHAPE = 'lifted', 'lifted shape'
# Loops (`loops`): a TensorList or TensorArray of elements of a kind (`of`, `blocks`, `per`
# the element's); one example's values, read from a list of the batch's examples by a loop's
# step (`index`: the step's index tensor); the batch's longest length (a max over the batch
# of each example's own length, `index` that length's tensor), only as a loop's bound.
LIST, EXAMPLE, BOUND = 'list', 'one example', 'longest length'
# The shape of values with the batch on axis 1 (`COLS`: a time-major [T, n, ...]).
COLS_SHAPE = 'columns shape'


@dataclasses.dataclass(frozen=True)
class Kind:
  """A tensor's rows: `tag` one of the kinds above.

  `blocks`: for rows and flat rows, how many copies of the shard's examples
  are stacked on axis 0 (1: one row per example; flat rows in 2 blocks: a
  reshape of 2 stacked views to [2n * T, d], each view's entries in example
  order). `norm`: for a statistic, a batch norm's.
  `of`: for lifted entries, the tag they had before the new axis (rows or
  flat). `per`: for flat rows (and lifted ones, the shape of flat rows, flat
  indices), how many rows each example has (in each block): an int for a
  reshape that merged static axes into the batch axis, a `(coefficient,
  names)` product of sizes known only when the graph runs, a `'where:<op>'`
  (`'sparse:'`, `'ragged:'`) name for a count only the values decide (a
  `tf.where`'s positions and what gathers by them; a SparseTensor's or
  RaggedTensor's entries): the same name, the same counts; None when unknown
  (a dense tensor's axes of sizes unknown when built merged into the batch
  axis: reshaped back to its rows' shape they are rows again). Only an int or
  a product is a count known for every example (`rows_per_example`).
  `index`: what positions, offsets and indices index. For `tf.where`'s
  positions: `'rows'` (the first column is the example) or the `per` of the
  flat rows whose positions they are (None: unknown). For offsets
  (`range(n) * T`, each example's first row in a flat tensor of T rows per
  example) and indices (rows of that flat tensor each example picks among its
  own): T, that flat tensor's `per` (1: one row per example).
  `layout`: for a shape, indices: FLAT when they are flat rows' (per `per`),
  else (None) rows'.
  """
  tag: str
  blocks: int = 1
  norm: bool = False
  of: str = ''
  per: object = None
  index: object = None
  layout: str | None = None


ROWS_KIND, FLAT_KIND, COLS_KIND = Kind(ROWS), Kind(FLAT), Kind(COLS)
SIZE_KIND, SHAPE_KIND, UNIQUE_KIND, MIXED_KIND = Kind(SIZE), Kind(SHAPE), Kind(UNIQUE), Kind(MIXED)
SPLITS_KIND = Kind(SPLITS)
STAT_KIND, NORM_KIND = Kind(STAT), Kind(STAT, norm=True)
LIFTED_SHAPE_KIND = Kind(LIFTED_SHAPE)
COLS_SHAPE_KIND = Kind(COLS_SHAPE)


def lifted(kind: Kind) -> Kind:
  """Rows or flat rows of `kind` behind a new leading axis of 1."""
  return Kind(LIFTED, kind.blocks, of=kind.tag, per=kind.per)


def unlifted(kind: Kind) -> Kind:
  """Lifted entries of `kind` without their leading axis of 1: rows or flat rows again."""
  return Kind(kind.of, kind.blocks, per=kind.per)


def flat_kind(per=None, blocks: int = 1) -> Kind:
  """Flat rows of `per` rows per example (None: unknown or not the same for each), in `blocks`."""
  return Kind(FLAT, blocks, per=per)


def rows_per_example(kind: Kind | None, blocks: bool = False):
  """How many rows on axis 0 each example has, in example order, in a tensor of `kind`.

  None: unknown, or not in example order (rows stacked in blocks, unless `blocks`:
  then how many rows of axis 0 there are per example).
  """
  if kind is None:
    return None
  if kind.blocks != 1 and not blocks:
    return None
  if kind.tag == ROWS:
    return kind.blocks
  if kind.tag == FLAT and same_for_each(kind.per):
    if kind.blocks == 1:
      return kind.per
    if isinstance(kind.per, int):
      return kind.blocks * kind.per
    return (kind.blocks * kind.per[0], kind.per[1])
  return None


def same_for_each(per) -> bool:
  """Whether `per` is the same count for every example: an int or a `(coefficient, names)`."""
  return isinstance(per, (int, tuple)) and not isinstance(per, bool)


def stat_of(kinds: Sequence) -> Kind:
  """A statistic made from `kinds`: a batch norm's if every statistic among them is."""
  stats = [k for k in kinds if k is not None and k.tag == STAT]
  return NORM_KIND if stats and all(k.norm for k in stats) else STAT_KIND


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
