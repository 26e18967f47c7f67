"""A head made of rows, with micro-batches: computed in row chunks, one at a time per device.

The rule. With micro-batches the head of a loss that mixes the rows runs on
the rows of a first pass over the micro-batches (`cached_gradients`). Where
that head is made of rows (`row_wise_head`: an in-batch softmax, CLIP's two
terms), it is computed in *chunks* of rows, so that a device never holds
more than one chunk's `r x B` matrices (the logits, their softmax, their
gradient), never the `B x B` one:

- each micro-batch's first-pass rows are cut into as many chunks as its
  device runs micro-batches (`r` about `B / (N k^2)` rows for N devices and
  k micro-batches each, so `r x B <= (B / k)^2`); a chunk is a "tower" of
  `row_wise_head`'s split: its own rows against the gathered columns (the
  first pass's rows of the whole batch, gathered once per device,
  all-gathered across workers);
- forward: a device's chunks run one after another (each chunk's first ops
  wait for the previous chunk's per-row values) and keep nothing but their
  per-row values (a vector of r numbers); the tail (the mean over the rows,
  sums of terms) runs once on the first device, and its gradient with
  respect to each chunk's per-row values is taken there;
- backward: each chunk's rows are computed again (GradCache applied to the
  head itself: the tail's gradient needs every chunk's forward, so no
  chunk's matrices are kept for its backward) and differentiated at once,
  seeded with the tail's gradient, one chunk after another per device (the
  first after the tail's gradient). Each chunk's gradient with respect to
  the gathered columns adds into one `B x D` buffer per device; its
  gradient with respect to its own rows is its own.
- the cached gradient of a micro-batch's frontier rows is its own rows'
  gradients plus its rows of the columns' buffers (one backward pass
  through the gather: one all-reduce across workers); values of no shard
  the head reads (a trained temperature) are seeded in the first
  micro-batch's backward pass with the chunks' and the tail's gradients
  (the tail's on the first worker only).

The head's ops before the per-row values run twice; they are functions of
their inputs (`row_wise_head` knows no stateful op). A head that is not made
of rows (a stacked layout's blocks, a batch top-k) runs once, whole, on the
first device (`whole_batch_head`).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import fixed_sums
from estimator_towers.heads import row_wise_head as rwh
from estimator_towers.heads import whole_batch_head as wbh
from estimator_towers.rows import row_dependence as rd


def build(found: rd.RowDependence, loss: tf.Tensor, grad_y: Any, find: Callable,
          frontier: list, shapes: list, values: list, sizes: Sequence, nonempty: Sequence,
          batch: Any, across: Any, own: list, cached: Callable
          ) -> tuple[tf.Tensor, list, list, str] | str:
  """The head in row chunks (see the module doc), or a sentence saying why not.

  Args: as `row_wise_head.build`, with `values` the first pass's frontier
    rows per micro-batch (the head's inputs), `own` the micro-batches'
    own frontier tensors (what their backward passes are seeded at) and
    `cached(i, t)` micro-batch i's first-pass value of tower 0's `t`.

  Returns:
    (whole-batch loss, per micro-batch (ys, initial gradients), [], where).
  """
  devices = [shard[0].device if shard else '' for shard in values]
  chunks, chunk_sizes = _chunks(values, sizes, devices)
  shared: dict = {}
  args = (found, find, frontier, shapes, chunks, chunk_sizes, [True] * len(chunks), batch,
          across, loss.op.device)
  forward = _Chunks(*args, whole_rows=(values, sizes, nonempty, cached), shared=shared,
                    name='forward')
  try:
    whole = forward.whole(loss)
  except rwh.NotRowWise as why:
    return str(why)
  if not forward.tail:
    return 'no per-row values'
  tail = _tail_gradients(forward, whole, grad_y, values)
  if isinstance(tail, str):
    return tail
  backward = _Chunks(*args, whole_rows=(values, sizes, nonempty, cached), shared=shared,
                     name='backward')
  backward._offset = forward._offset   # pylint: disable=protected-access
  own_grads, columns, outside = _chunk_gradients(forward, backward, tail)
  seeds = _seeds(backward, own_grads, columns, values, own)
  _seed_outside(seeds, outside, tail, forward, across)
  where = (f'in row chunks ({len(chunks)}: each micro-batch\'s rows in as many chunks as '
           f'its device runs micro-batches) against the gathered columns, one chunk at a '
           f'time per device, each chunk computed again for its backward pass, the mean '
           f'over the rows on {forward.device or "the first device"}')
  return whole, seeds, [], where


def _chunks(values: list, sizes: Sequence, devices: list) -> tuple[list, list]:
  """Each micro-batch's rows cut into as many chunks as its device runs micro-batches
  (on the fixed shard grid: one chunk per shard, whatever the devices)."""
  keys = list(range(len(devices))) if fixed_sums.active() else devices
  count = collections.Counter(keys)
  chunks, chunk_sizes = [], []
  for i, (shard, n) in enumerate(zip(values, sizes)):
    c = count[keys[i]]
    with tf.device(devices[i]), tf.name_scope('chunked_head/rows/'):
      if isinstance(n, int):
        bounds = [n * m // c for m in range(c + 1)]
      else:
        n = tf.cast(n, tf.int32)
        bounds = [0] + [n * m // c for m in range(1, c)] + [n]
      for m in range(c):
        chunks.append([v[bounds[m]:bounds[m + 1]] for v in shard])
        chunk_sizes.append(bounds[m + 1] - bounds[m])
  return chunks, chunk_sizes


class _Chunks(rwh.Split):
  """`row_wise_head`'s split with chunks as its towers, built in order per device.

  `shared` holds the gathered columns, one per device (and frontier tensor),
  for both the forward and the backward builds; `entries[k]` the tensors a
  chunk's own rows enter by (what its gradient is taken with respect to).
  """

  def __init__(self, *args, whole_rows: tuple, shared: dict, name: str):
    super().__init__(*args)
    self.whole_rows, self.shared, self.name = whole_rows, shared, name
    self.sources: list = []   # the tail's inputs (tower 0's tensors), in order
    self.entries: list = [{} for _ in self.per_shard]
    self.last: dict = {}      # device -> what its next chunk waits for

  def device_of(self, k: int) -> str:
    return self.per_shard[k][0].device if self.per_shard[k] else self.device

  def whole(self, t: tf.Tensor) -> tf.Tensor:
    with tf.control_dependencies(None):   # whole values belong to no chunk
      return super().whole(t)

  def rows(self, k: int, t: tf.Tensor, transposed: bool = False) -> tf.Tensor:
    key = (t.name, transposed)
    if key not in self._rows[k]:
      self._local += 1
      tower, self._tower = self._tower, k
      try:
        with tf.device(self.device_of(k)), \
            tf.name_scope(f'chunked_head/{self.name}/chunk_{k}/'):
          self._rows[k][key] = (self._transposed(k, t) if transposed else self._rows_of(k, t))
      finally:
        self._local -= 1
        self._tower = tower
    return self._rows[k][key]

  def chunk(self, k: int, sources: list) -> list:
    """Chunk k's rows of `sources`, after what the device's previous chunk left."""
    with tf.control_dependencies(self.last.get(self.device_of(k), [])):
      return [self.rows(k, s) for s in sources]

  def _gather_rows(self, t: tf.Tensor) -> tf.Tensor:
    self.sources.append(t)
    parts = []
    for k in range(len(self.per_shard)):
      (part,) = self.chunk(k, [t])
      self.last[self.device_of(k)] = [part]
      parts.append(part)
    self.tail.append(parts)
    value = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
    if self.across is not None:
      value = wbh.across_workers(value, rd.Kind(rd.ROWS), self.across)
    return value

  def _whole_of(self, t: tf.Tensor) -> None:
    if t.name in self.shapes:   # of the first pass's rows: the second pass waits for the head
      x = self.whole_rows[3](0, t.op.inputs[0])
      self._whole[t.name] = (wbh.whole_shape(t, self.found.kind(t.op.inputs[0]), self.batch, x),
                             set())
    else:
      super()._whole_of(t)

  def _own(self, k: int, t: tf.Tensor) -> tf.Tensor:
    entry = tf.identity(super()._own(k, t))
    self.entries[k][self.frontier[t.name]] = entry
    return entry

  def _outside(self, t: tf.Tensor) -> tf.Tensor:
    """A value of no shard: tower 0's, seeded in the first micro-batch's backward pass."""
    if not t.dtype.is_floating or tf.get_static_value(t) is not None:
      return t
    self.outside.setdefault(t.name, (0, t))
    return t

  def _columns_on(self, k: int, t: tf.Tensor) -> tf.Tensor:
    if fixed_sums.active():  # one buffer of the columns' gradient, summed in the fixed order
      return self._shared_columns(t, self.device)
    return self._shared_columns(t, self.device_of(k))

  def _columns(self, t: tf.Tensor, kind: rd.Kind) -> tf.Tensor:
    return self._shared_columns(t, self.device)

  def _shared_columns(self, t: tf.Tensor, device: str) -> tf.Tensor:
    """The micro-batches' first-pass rows of `t` gathered on `device` (once per device)."""
    key = (t.name, device)
    if key not in self.shared:
      values, sizes, nonempty, _ = self.whole_rows
      j, kind = self.frontier[t.name], self.found.kind(t)
      with tf.control_dependencies(None), tf.device(device), \
          tf.name_scope('chunked_head/columns/'):
        value = wbh.gathered([v[j] for v in values], kind, sizes, nonempty)
        if self.across is not None:
          value = wbh.across_workers(value, kind, self.across, summed=True)
      self.shared[key] = value
    return self.shared[key]


def _tail_gradients(forward: _Chunks, whole: tf.Tensor, grad_y: Any, values: list
                    ) -> dict | str:
  """The tail's gradient w.r.t. each chunk's per-row values and the outside values."""
  got = forward.tail_gradients(whole, grad_y, [v for shard in values for v in shard],
                               'chunked_head/tail_gradients')
  if isinstance(got, str):
    return got
  rows, outside = got
  chunks = len(forward.per_shard)
  per_row = [rows[p * chunks:(p + 1) * chunks] for p in range(len(forward.tail))]
  return {'rows': per_row, 'outside': dict(zip(
      (t.name for _, t in forward.outside.values()), outside))}


def _chunk_gradients(forward: _Chunks, backward: _Chunks, tail: dict
                     ) -> tuple[list, dict, dict]:
  """Each chunk again and its backward pass, one after another per device.

  Returns (per chunk, frontier index -> its own rows' gradient; per columns
  tensor's key, the sum of the chunks' gradients; per outside value's name,
  the sum of the chunks' gradients).
  """
  waits = [g for grads in tail['rows'] for g in grads if g is not None]
  backward.last = {backward.device_of(k): waits for k in range(len(backward.per_shard))}
  own_grads, columns, outside = [], {}, {}
  fixed = fixed_sums.active()
  parts: dict = {}   # on the fixed shard grid: per columns key, each chunk's gradient
  for k in range(len(backward.per_shard)):
    rows = backward.chunk(k, forward.sources)
    seeded = [(r, grads[k]) for r, grads in zip(rows, tail['rows']) if grads[k] is not None]
    entries = sorted(backward.entries[k].items())
    keys = sorted(backward.shared)
    names = sorted(backward.outside)
    xs = ([e for _, e in entries] + [backward.shared[key] for key in keys]
          + [backward.outside[n][1] for n in names])
    with tf.device(backward.device_of(k)), \
        tf.name_scope(f'chunked_head/backward/chunk_{k}_gradients'):
      grads = tf.compat.v1.gradients([r for r, _ in seeded], xs,
                                     grad_ys=[g for _, g in seeded],
                                     stop_gradients=xs, colocate_gradients_with_ops=True)
    mine = {j: g for (j, _), g in zip(entries, grads) if g is not None}
    own_grads.append(mine)
    done = list(mine.values())
    for key, g in zip(keys, grads[len(entries):]):
      if g is not None:
        with tf.device(key[1]), tf.name_scope('chunked_head/columns_gradient'):
          g = tf.convert_to_tensor(g)
          if fixed:
            parts.setdefault(key, {})[k] = g
          else:
            columns[key] = g if key not in columns else columns[key] + g
        done.append(g if fixed else columns[key])
    for name, g in zip(names, grads[len(entries) + len(keys):]):
      if g is not None:
        outside[name] = g if name not in outside else outside[name] + g
    backward.last[backward.device_of(k)] = done or backward.last[backward.device_of(k)]
  for key, by_chunk in parts.items():
    with tf.device(key[1]), tf.name_scope('chunked_head/columns_gradient'):
      columns[key] = fixed_sums.sum_in_order([by_chunk.get(k)
                                              for k in range(len(backward.per_shard))])
  return own_grads, columns, outside


def _seeds(backward: _Chunks, own_grads: list, columns: dict, values: list, own: list
           ) -> list:
  """Per micro-batch, its frontier tensors and their rows of the head's gradient."""
  ys, grad_ys = [], []
  for k, mine in enumerate(own_grads):
    for j, g in mine.items():
      ys.append(backward.entries[k][j])
      grad_ys.append(g)
  for key, g in columns.items():
    ys.append(backward.shared[key])
    grad_ys.append(g)
  everything = [v for shard in values for v in shard]
  with tf.name_scope('chunked_head/cached_gradient'):
    grads = wbh.gradients_of(ys, everything, grad_ys, colocate_gradients_with_ops=True,
                             **fixed_sums.aggregation())
  return wbh.shard_seeds(own, values, grads)


def _seed_outside(seeds: list, outside: dict, tail: dict, forward: _Chunks, across: Any
                  ) -> None:
  """Values of no shard (a temperature): the chunks' gradients and the tail's, in shard 0."""
  rwh.seed_outside(seeds, [(0, t, outside.get(name), tail['outside'].get(name))
                           for name, (_, t) in forward.outside.items()], across)
