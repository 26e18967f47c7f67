"""Synchronised batch norm: batch statistics of the global batch, in every tower.

With `sync_batch_norm` on (the default with one micro-batch), each batch
normalisation a TRAIN model_fn builds
normalises its tower's shard with the mean and variance of the whole global
batch, so that a towered step equals the plain step for models whose only
cross-example operation is batch norm. A batch statistic is a sync point of
the towers, like a gradient request:

- Which computations: `tf.compat.v1.nn.fused_batch_norm(..., is_training=True)`
  (what Keras `BatchNormalization` and `tf.compat.v1.layers` use when fused,
  and tf_slim-style code calls directly) and `tf.nn.moments(x, axes)` with the
  batch axis 0 among `axes` (Keras' non-fused path and hand-written batch
  norm). Moments over other axes (layer norm) are per example and stay per
  tower.
- How: each tower's shard statistics (count, per-channel mean and M2; an
  empty shard, which borrows a row in training, counts 0) are joined once per
  sync point, on the device of the first tower to reach it, and combined by
  Chan et al.'s parallel formula (no E[x^2] - E[x]^2); every tower uses the
  result. The exchange is ordinary graph edges between the towers' devices
  (`join`: the towers are built one after another, so the first
  tower's join holds its own statistics in the later towers' slots until
  they are built). The fused path normalises with TensorFlow's fused kernel
  (inference mode, on the global statistics) and has a gradient of its own
  that joins the two per-channel sums sum(dy) and sum(dy * x^) the same way;
  `tf.nn.moments` is differentiated through the join.
- What it returns is what the plain call returns on the whole batch: the
  fused call's batch variance carries Bessel's correction over the global
  count, as TensorFlow's kernel does, so Keras' moving averages (updated once
  per step from tower 0) follow the global statistics.

Across workers (`variable_strategy='collective'`, `across`), a sync point's
table of rows is every worker's, gathered by one all-reduce
(`CrossWorker.gather`), and the backward sums are summed across workers, so
the statistics are the cluster's global batch's and every worker combines
the same table.

On the fixed shard grid (`shards=S`) every sum takes the grid's order: the
table is every shard's row (across workers too, in shard order), a backward
table's rows add over the grid's tree (then across workers in the same
tree), and the `tf.nn.moments` path's gradient is explicit like the fused
path's (`_grid_moments`), so that each shard's backward pass covers its own
rows.

Options whose result cannot equal the plain batch norm on the whole batch
(`renorm`, `virtual_batch_size`, `adjustment` of a Keras layer) are errors when
sync is on, and so are towers sharing a device, when a batch norm is built.

This module intercepts the calls and builds their sync points
(`BatchNormSync`; `unsynced.Unsynced` when sync is off, which says what the
batch norms then get). Which calls are batch norms is `batch_norm_calls`'s;
the arithmetic of the towers' moments (Chan's combination) is in `moments`;
TensorFlow's fused kernels and the registered gradient are in
`batch_norm_kernels`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import numpy as np
import tensorflow as tf

from estimator_towers.base import fixed_sums
from estimator_towers.base import interception
from estimator_towers.base import tower_parts
from estimator_towers.sync_points import batch_norm_calls as calls
from estimator_towers.sync_points import batch_norm_kernels as kernels
from estimator_towers.sync_points import join as sync_points
from estimator_towers.sync_points import moments as moments_lib
from estimator_towers.sync_points import unsynced
from estimator_towers.towers import tower_context

BatchNormSyncError = calls.BatchNormSyncError


class BatchNormSync:
  """The sync points of one towered TRAIN graph.

  Args:
    graph: the graph being built.
    devices: by tower index, the device of every tower that is built.
    present: by tower index, 1.0 (a Python float) or a float32 scalar Tensor
      that is 0 when the tower's shard is empty at run time.
    across: the all-reduces across workers (a `cross_worker.CrossWorker`), or None.
    shared_devices: towers may share a device (the fixed shard grid's towers,
      each a shard: their statistics are joined in the graph all the same).
  """

  def __init__(self, graph: tf.Graph, devices: dict[int, str], present: dict[int, Any],
               across: Any = None, shared_devices: bool = False):
    self._graph = graph
    self._shared_devices = shared_devices
    self._devices = devices
    self._present = present
    self._across = across
    self._points: list[sync_points.SyncPoint] = []   # by index: the towers' i-th sync point
    self._calls: dict[int, int] = {}      # per tower: sync points made so far
    self._arithmetics: dict[int, moments_lib.Arithmetic] = {}  # per tower
    self._builds: dict[int, int] = {}     # per tower: the build that made them
    self._presents_column = None
    self._moments_used = False
    self._fixed = fixed_sums.active(graph)  # the shard grid: its order of sums (`_rows_sum`)

  @contextlib.contextmanager
  def syncing(self) -> Iterator[None]:
    """While active, batch statistics built by a tower are global."""
    with interception.batch_norm_calls(self._fused, self._moments):
      yield

  def check_complete(self) -> None:
    """Raises if the towers did not all reach the same sync points; a join's slot that
    no tower filled gets a placeholder (`sync_points.Exchange.finish`)."""
    for point in self._points:
      point.finish()
    counts = {k: self._calls.get(k, 0) for k in self._devices}
    if len(set(counts.values())) > 1:
      raise BatchNormSyncError(
          f'With sync_batch_norm on (the default) every tower must build the same batch '
          f'norms, but the towers built {counts} (tower: count). Do not branch '
          f'on the tower or shard around batch normalisation.')

  # -- Towers copied from the first (`tower_copies`) ---------------------------

  def copy_reason(self) -> str | None:
    """Why the towers' forward passes cannot be copied, or None."""
    if self._moments_used:
      return ('sync_batch_norm synchronises a tf.nn.moments (differentiated through '
              'its join)')
    return None

  def shared_ops(self) -> set:
    """The ops of every join built so far (shared by the towers, never copied)."""
    shared = set()
    for point in self._points:
      for exchange in [point.forward] + point.backward_exchanges:
        shared.update(exchange.made)
    return shared

  def joined_by(self, primary: int, tower: int) -> dict:
    """Per tensor `primary`'s backward joins returned it (by `ref()`), tower `tower`'s."""
    found = {}
    for point in self._points:
      for exchange in point.backward_exchanges:
        mine, theirs = exchange.result(primary), exchange.result(tower)
        if mine is not None and exchange.value(primary) is not None:
          found.update((a.ref(), b) for a, b in zip(tf.nest.flatten(mine), tf.nest.flatten(theirs))
                       if a is not b)
    return found

  def copied_pass(self, primary: int, tower: int, counterpart: Callable, ops: set) -> None:
    """Tower `tower`'s copy of `primary`'s backward pass (made `ops`) joins its exchanges."""
    for point in self._points:
      for exchange in point.backward_exchanges:
        value = exchange.value(primary)
        if value is not None and value.op in ops and exchange.value(tower) is None:
          point.backward(tower)  # counts the tower's use, as its gradient would
          exchange.join(tower, counterpart(value), None)

  def copied(self, primary: int, tower: int, counterpart: Callable) -> None:
    """Tower `tower` is a copy of `primary`'s forward pass: it joins its sync points.

    Its statistics (the copies of the primary's) join each sync point the
    primary joined, and each copied normalisation gets the gradient of its own
    tower (`_fused_normalise`).
    """
    points = self._points[:self._calls.get(primary, 0)]
    for point in points:
      point.forward.join(tower, counterpart(point.forward.value(primary)), None)
    self._calls[tower] = len(points)
    pending = kernels.pending_gradients.get(self._graph, {})
    for name, grad in list(pending.items()):
      if grad.keywords['tower'] != primary:
        continue
      copy = counterpart(self._graph.get_operation_by_name(name).outputs[0])
      if copy is None:
        continue
      theirs = {key: value if not isinstance(value, tf.Tensor) or counterpart(value) is None
                else counterpart(value) for key, value in grad.keywords.items()}
      pending[copy.op.name] = functools.partial(grad.func, **dict(theirs, tower=tower))

  # -- The intercepted calls ---------------------------------------------------

  def _tower(self) -> int | None:
    """The tower being built in this graph, or None (nothing to sync)."""
    if tf.compat.v1.get_default_graph() is not self._graph:
      return None
    context, build = tower_context.peek()
    return context.index if context.index in self._devices and build else None

  def _fused(self, original, x, scale, offset, mean, variance, epsilon=0.0001,
             exponential_avg_factor=1, data_format='NHWC', is_training=True,
             name=None):
    tower = self._tower() if is_training else None
    if tower is None or not calls.is_batch_norm(calls.calling_layer()):
      return original(x, scale, offset, mean, variance, epsilon=epsilon,
                      exponential_avg_factor=exponential_avg_factor,
                      data_format=data_format, is_training=is_training, name=name)
    with tf.name_scope(name or 'SyncBatchNorm'):
      kernel = kernels.FusedKernel(original, epsilon, data_format)
      point = self._sync_point(tower)
      arithmetic = self._arithmetic(tower, original)
      moments, corrected, total = point.forward.join(
          tower, arithmetic.local_statistics(x, scale, epsilon, data_format),
          lambda table: self._fused_statistics(arithmetic, table, x.shape.rank,
                                               kernels.channel_axis(x, data_format)))
      batch_mean, batch_var = tf.unstack(moments)  # on this tower's device: one transfer
      new_mean, new_variance = batch_mean, corrected
      if exponential_avg_factor not in (None, 1, 1.0):
        f = float(exponential_avg_factor)
        new_mean = (1.0 - f) * mean + f * batch_mean
        new_variance = (1.0 - f) * variance + f * corrected
      y = self._fused_normalise(kernel, tower, point, x, scale, offset, batch_mean, batch_var,
                                total)
      return y, new_mean, new_variance, new_mean, new_variance, new_variance

  def _fused_statistics(self, arithmetic: 'moments_lib.Arithmetic', table: tf.Tensor,
                        rank: int, axis: int):
    """The global statistics from the towers' rows (shape, mean, variance), once per sync point.

    An empty shard's borrowed row counts 0 (its presence factor); its mean
    and variance are then weighted by 0 in Chan's combination. Across
    workers, every worker's towers are combined to one row first, and the
    workers' rows (rank order) combined the same way.
    """
    statistics = arithmetic.counted(tf.stop_gradient(table), rank, axis, self._presents())
    if self._across is not None and self._fixed:  # every shard's row, in shard order
      statistics = arithmetic.split_table(self._across.gather(tf.concat(statistics, 1)))
    elif self._across is not None:
      row = moments_lib.fused_row(arithmetic.combined(*statistics))
      statistics = arithmetic.split_table(self._across.gather(row[None]))
    return arithmetic.global_statistics(*statistics)

  def _fused_normalise(self, kernel: 'kernels.FusedKernel', tower: int,
                       point: sync_points.SyncPoint, x, scale, offset, mean, variance, count):
    """TensorFlow's fused kernel on the global statistics; the global batch's gradient.

    Forward, the inference kernel normalises the shard with the global mean
    and variance. Backward, with s = sqrt(variance + epsilon), n the global
    count and x^ = (x - mean) / s, plain batch norm's input gradient is

        dx = scale / s * (dy - sum(dy) / n - x^ * sum(dy * x^) / n)

    with the sums over the global batch. The inference kernel's gradient gives
    scale / s * dy and the shard's sum(dy * x^) and sum(dy), which are the
    shard's share of the scale's and offset's gradients (the towers' backward
    passes add the shares up on the variables); one exchange of those 2C
    floats gives the global sums, and the inference kernel applied to x with
    scale / (s n) * (sum(dy * x^), sum(dy)) as its scale and offset gives the
    last two terms. An empty shard's borrowed row is not in the statistics:
    its gradient is scale / s * dy alone.

    The gradient is attached to an IdentityN of (y, x, scale, offset) whose
    gradient is this function's (`kernels.register_gradient`), not by
    `tf.custom_gradient`, which scans the graph's variables and the ops
    between its inputs and outputs on every call.
    """
    x, scale, offset = (tf.convert_to_tensor(t) for t in (x, scale, offset))
    y, reserve = kernel.apply(x, scale, offset, mean, variance)
    kernels.register_gradient()
    with self._graph.gradient_override_map({'IdentityN': kernels.GRADIENT}):
      outputs = tf.raw_ops.IdentityN(input=[y, x, scale, offset])
    pending = kernels.pending_gradients.setdefault(self._graph, {})
    pending[outputs[0].op.name] = functools.partial(
        self._gradient, tower=tower, kernel=kernel, point=point, x=x, scale=scale, mean=mean,
        variance=variance, count=count, reserve=reserve)
    return outputs[0]

  def _gradient(self, dy, *unused, tower: int, kernel: 'kernels.FusedKernel',
                point: sync_points.SyncPoint, x, scale, mean, variance, count, reserve
                ) -> list:
    """`_fused_normalise`'s gradient for tower `tower` (its tensors `x` and `reserve`)."""
    del unused  # the gradients of the IdentityN's other outputs (unused: None)
    dx, dscale, doffset = kernel.gradient(dy, x, scale, mean, variance, reserve)
    coefficients = point.backward(tower).join(
        tower, tf.stack([dscale, doffset]),
        lambda sums: self._correction_scales(
            self._arithmetic(tower), sums, scale, variance, count, kernel.epsilon),
        per_tower=True)
    correction_scale, correction_offset = tf.unstack(coefficients)  # one transfer
    correction, _ = kernel.apply(x, correction_scale, correction_offset, mean, variance)
    return None, dx - correction, dscale, doffset

  def _correction_scales(self, arithmetic: 'moments_lib.Arithmetic', sums: tf.Tensor, scale,
                         variance, count, epsilon: float) -> list:
    """Per tower, the correction kernel's [scale, offset], from the towers' [dscale, doffset]
    (`sums`, stacked).

    scale / (s n) * (sum(dy * x^), sum(dy)) over the global batch; zero for
    a tower whose shard is empty (its borrowed row is not in the statistics).
    Only the sums wait for the backward pass: the factor scale / (s n) is
    the forward's, so after the last tower's sums the join is a sum and a
    product (and the presence factors).
    """
    factor = arithmetic.correction_factor(scale, variance, count, epsilon)
    presents = self._presents(rank=3)
    if presents is None:
      return [self._total(self._rows_sum(sums)) * factor] * len(self._devices)
    totals = self._total(self._rows_sum(sums * presents))
    return tf.unstack(presents * (totals * factor))

  def _presents(self, rank: int = 2):
    """The towers' presence factors as a [towers, 1] (or [towers, 1, 1]) column, or None
    when all are 1."""
    if all(isinstance(p, float) and p == 1.0 for p in self._present.values()):
      return None
    if self._presents_column is None:
      with self._graph.control_dependencies(None), tf.name_scope('sync_batch_norm_presents'):
        column = tf.stack([tf.cast(self._present[k], tf.float32) for k in sorted(self._devices)])
        self._presents_column = {2: tf.reshape(column, [-1, 1]), 3: tf.reshape(column, [-1, 1, 1])}
    return self._presents_column[rank]

  def _moments(self, original, x, axes, shift=None, name=None, keep_dims=None,
               keepdims=None):
    keep = bool(keep_dims if keepdims is None else keepdims)
    tower = self._tower()
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    if tower is None or not calls.over_batch_axis(x, axes):
      return original(x, axes, shift=shift, name=name, keep_dims=keep)
    calls.is_batch_norm(calls.calling_layer())  # options that cannot be synchronised
    self._moments_used = True
    with tf.name_scope(name or 'sync_moments'):
      y = tf.cast(x, tf.float32) if x.dtype == tf.float16 else x
      axes = sorted(int(a) % rank for a in np.ravel(axes))
      point = self._sync_point(tower)
      if self._fixed:  # the grid: no gradient through the join (`_grid_moments`)
        mean, squares, count = self._grid_moments(tower, point, y, axes)
      else:
        mean, squares, count = self._combine(tower, point, *moments_lib.local_moments(y, axes))
      variance = squares / tf.maximum(count, 1.0)
      shape = moments_lib.dims(y, [a for a in range(rank) if keep or a not in axes], ones=axes)
      mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
      if x.dtype == tf.float16:
        return tf.cast(mean, tf.float16), tf.cast(variance, tf.float16)
      return mean, variance

  # -- The statistics ----------------------------------------------------------

  def _grid_moments(self, tower: int, point: sync_points.SyncPoint, y: tf.Tensor, axes):
    """`_combine` on the fixed shard grid: the global mean, M2 and count, whose gradient
    with respect to `y` is explicit.

    Differentiated through the join, shard k's backward pass (the grid has one
    per shard) would reach every shard's rows (S passes over every shard), and
    across workers other workers' rows. Instead, like the fused path, each
    tower's gradients of the global mean and M2 meet at a backward exchange,
    summed over the shards in the grid's order (`_rows_sum`, then across
    workers), and each tower computes its own rows' gradient from the sums
    (`moments_lib.moments_input_gradient`).
    """
    mean, squares, count = self._combine(
        tower, point, *moments_lib.local_moments(tf.stop_gradient(y), axes))
    kernels.register_gradient()
    with self._graph.gradient_override_map({'IdentityN': kernels.GRADIENT}):
      outputs = tf.raw_ops.IdentityN(input=[mean, squares, y])
    kernels.pending_gradients.setdefault(self._graph, {})[outputs[0].op.name] = functools.partial(
        self._moments_gradient, tower=tower, point=point, y=y, axes=axes, mean=mean,
        count=count)
    return outputs[0], outputs[1], count

  def _moments_gradient(self, mean_grad, m2_grad, *unused, tower: int,
                        point: sync_points.SyncPoint, y, axes, mean, count) -> list:
    """`_grid_moments`' gradient for tower `tower`: None for the statistics, `y`'s."""
    del unused
    grads = [tf.zeros_like(mean) if g is None else g for g in (mean_grad, m2_grad)]

    def totals(table):
      presents = self._presents(rank=3)
      return tf.unstack(self._total(self._rows_sum(
          table if presents is None else table * presents)))
    total_mean, total_m2 = point.backward(tower).join(tower, tf.stack(grads), totals)
    grad = moments_lib.moments_input_gradient(y, axes, mean, count, total_mean, total_m2)
    return [None, None, _times(grad, self._present[tower])]

  def _combine(self, tower: int, point: sync_points.SyncPoint, count, mean: tf.Tensor,
               m2: tf.Tensor):
    """The global batch's mean, M2 and count from every shard's count, mean and M2.

    Differentiable: the gradient flows through the exchange to every tower's
    statistics. An empty shard (its borrowed row) counts 0.
    """
    row = tf.concat([tf.reshape(tf.cast(count, mean.dtype), [1]), mean, m2], 0)
    return point.forward.join(
        tower, _times(row, self._present[tower]),
        lambda table: moments_lib.chan(
            self._table(table, lambda t: moments_lib.chan_row(moments_lib.chan(t)))))

  def _table(self, table: tf.Tensor, combine: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    """The towers' rows; across workers, every worker's towers combined to one row (rank
    order), or on the shard grid every shard's row (shard order)."""
    if self._across is None:
      return table
    return self._across.gather(table if self._fixed else combine(table)[None])

  def _rows_sum(self, table: tf.Tensor) -> tf.Tensor:
    """The sum of the towers' rows of a backward table; on the grid in its order."""
    return moments_lib.rows_sum(table, self._fixed)

  def _total(self, sums: tf.Tensor) -> tf.Tensor:
    """The towers' sums, and across workers the cluster's."""
    return sums if self._across is None else self._across.sum([sums])[0]

  def _arithmetic(self, tower: int, original=None) -> 'moments_lib.Arithmetic':
    if tower not in self._arithmetics:
      self._arithmetics[tower] = moments_lib.Arithmetic(original)
    return self._arithmetics[tower]

  def _sync_point(self, tower: int) -> sync_points.SyncPoint:
    """This tower's next sync point (shared by the towers)."""
    self._check_devices()
    build = tower_context.peek()[1]
    if self._builds.setdefault(tower, build) != build:
      raise BatchNormSyncError(
          f'With sync_batch_norm on (the default) each tower\'s model_fn is built once, '
          f'but tower {tower} was built again (a second gradient request, or '
          f'an EstimatorSpec loss other than the tensor gradients were asked '
          f'of, makes the library rebuild a tower). Return as the spec\'s loss '
          f'the tensor you pass to the optimizer, or pass sync_batch_norm=False '
          f'(--nosync_batch_norm): per-tower statistics.')
    i = self._calls.get(tower, 0)
    self._calls[tower] = i + 1
    while len(self._points) <= i:
      self._points.append(sync_points.SyncPoint(sorted(self._devices)))
    return self._points[i]

  def _check_devices(self) -> None:
    """Towers sharing a device (the CPU fallback) cannot exchange statistics: an error,
    raised when a batch norm is built."""
    devices = self._devices
    if not self._shared_devices and len(set(devices.values())) != len(devices):
      raise BatchNormSyncError(
          f'sync_batch_norm (on by default) needs every tower on its own device '
          f'when the model_fn builds a batch norm, but the towers run on '
          f'{sorted(devices.values())}: statistics are exchanged between the '
          f'towers\' devices. Give distinct devices (on a machine without GPUs, '
          f'replicate_model_fn(devices=[\'/cpu:0\', \'/cpu:1\']) with '
          f'device_count={{\'CPU\': 2}} in the session config, or make_config('
          f'num_cpu_devices=2), instead of allow_cpu_fallback=True), or pass '
          f'sync_batch_norm=False (--nosync_batch_norm): per-tower statistics.')


def _times(t: tf.Tensor, factor) -> tf.Tensor:
  """t * factor, without an op when factor is the Python float 1.0."""
  return t if isinstance(factor, float) and factor == 1.0 else t * tf.cast(factor, t.dtype)


def for_train(setting: bool | None, graph: tf.Graph, shards: Any, tower_devices: Any,
              across: Any = None) -> BatchNormSync | unsynced.Unsynced:
  """The sync points of batch statistics for a TRAIN graph (`sync_batch_norm`).

  True (make_plan's default with one micro-batch): synchronised; make_plan
  refuses it with micro-batches, so a shard is then a device. False: per
  shard, with a warning naming the batch norms. None (unset, with
  micro-batches): a batch norm is an error naming the choice. One shard is
  the global batch: nothing to do. Across workers the statistics are the
  cluster's (`across`), even with one tower.

  Args:
    setting: the plan's `sync_batch_norm`.
    graph: the TRAIN graph.
    shards: the step's `inputs.shards.Shards`.
    tower_devices: the towers' devices, by device index.
    across: the all-reduces across workers, or None.
  """
  micro_batches = shards.layout.micro_batches
  if len(shards.active) < 2 and across is None:
    return unsynced.Unsynced()
  if setting is None:
    return unsynced.Unsynced(graph, shards.active[0], unsynced.REFUSE, micro_batches)
  if not setting:
    return unsynced.Unsynced(graph, shards.active[0], unsynced.OPT_OUT, micro_batches)
  for k in shards.active:   # whose part of a join's table is whose (`base.tower_parts`)
    tower_parts.register_inputs(graph, k, shards.flat(k))
  present = {}
  for k, ne in zip(shards.active, shards.nonempty):
    if isinstance(ne, bool):
      present[k] = 1.0
    else:
      with tf.compat.v1.get_default_graph().colocate_with(ne), tf.name_scope('shard_inputs'):
        present[k] = tf.cast(ne, tf.float32)
  return BatchNormSync(graph, {k: tower_devices[k] for k in shards.active}, present, across,
                       shared_devices=getattr(shards.layout, 'shares_devices', False))
