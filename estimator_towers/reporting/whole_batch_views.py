"""What hooks and summaries read: the whole batch's values, as on one device.

Rule. A model_fn builds its hooks and summaries on tower 0, so they read
tower 0's tensors: its shard's loss, its shard's accuracy, its shard's rows.
Once every tower is built, each tensor a summary op reads, and each tensor a
training or evaluation hook fetches, is the whole batch's where the library
can build it: the spec's loss is the reported loss; a scalar the loss algebra
reads (a mean, a sum, a ratio of sums) or a max or min over the batch is
rebuilt from every tower's counterpart (`loss.reported.whole_batch_value`);
a tensor of the batch's rows (a histogram's values, images) is every tower's
rows joined in example order. A value that does not depend on the shard (a
learning rate) is left alone. Any other keeps tower 0's value, with one
WARNING per name at graph construction. A summary op reads its new input in
place (`interception.replace_input`); a hook runs inside `Rebound`, which
fetches the whole batch's tensor wherever the hook asks for tower 0's (the
tensors a LoggingTensorHook logs or a NanTensorHook checks are known when the
graph is built; any other hook gets the loss). Across workers a scalar's view
is the cluster's (its all-reduces run in every step on every task, `in_step`: a
summary only the chief runs could not meet the others' alone); a view of rows
is this task's, with one WARNING (the cluster's rows would cross the network in
every step).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.inputs import sharding
from estimator_towers.loss import loss_algebra
from estimator_towers.loss import reported
from estimator_towers.rows import row_dependence

__all__ = ['Rebound', 'WholeBatchViews']

# A reduction over every axis of the batch's rows: on the whole batch's rows.
_REDUCTIONS = {'Max': tf.reduce_max, 'Min': tf.reduce_min, 'Sum': tf.reduce_sum,
               'Mean': tf.reduce_mean, 'Prod': tf.reduce_prod}
# Summary ops (tf.compat.v1.summary) and the index of the value they read.
_SUMMARIES = {'ScalarSummary': 1, 'HistogramSummary': 1, 'ImageSummary': 1,
              'AudioSummaryV2': 1, 'TensorSummaryV2': 1, 'TensorSummary': 0}


class WholeBatchViews:
  """Tower 0's tensors -> the whole batch's, built once each.

  Args:
    loss: tower 0's loss and the whole batch's: (tower 0's, reported).
    counterparts: tower 0's tensor -> every built tower's (None if unknown).
    shards: the towers' shards.
    graph: the graph.
    batch: the global batch's size (across workers the cluster's; on one machine the
      shards' is used); across: the cluster's
      all-reduces, if any: a scalar's view is the cluster's, its all-reduces run
      in every step (`in_step`); a view of rows is this task's.
  """

  def __init__(self, loss: tuple, counterparts: Callable[[tf.Tensor], Sequence | None],
               shards: Any, graph: tf.Graph, batch: Any = None, across: Any = None):
    self._counterparts, self._shards, self._graph = counterparts, shards, graph
    self._batch, self._across = (shards.batch if across is None else batch), across
    self._inputs = shards.flat(shards.active[0])
    self._views = {loss[0].name: loss[1]}
    self._dependence = loss_algebra.Dependence(self._inputs)
    # Across workers: the cluster's views, whose all-reduces every task must run in every
    # step (only the chief's summaries and hooks read them: alone, they would wait for the
    # others forever); the views of this task's rows.
    self._cluster_views: list[tf.Tensor] = []
    self._task_rows: set[str] = set()

  def in_step(self, train_op: Any) -> Any:
    """`train_op`, running the cluster's views' all-reduces too (every task, every step)."""
    if not self._cluster_views:
      return train_op
    return tf.group(train_op, *self._cluster_views, name='train_op_with_whole_batch_views')

  def whole(self, tensor: tf.Tensor, name: str) -> tf.Tensor:
    """The whole batch's `tensor` (tower 0's), or `tensor` itself, warned once by `name`."""
    if tensor.name in self._views:
      return self._views[tensor.name]
    view = self._build(tensor)
    if view is None:
      logs.warning_once(
          f'estimator_towers: {name} reads {tensor.name}, tower 0\'s value for its shard '
          f'of the batch, which the library cannot rebuild for the whole batch (a '
          f'mean, sum, ratio of sums, max or min over the batch, or the batch\'s '
          f'rows): on towers it shows tower 0\'s value, not one device\'s.',
          key=f'whole_batch_views:{name}')
      view = tensor
    elif tensor.name in self._task_rows:
      logs.warning_once(
          f'estimator_towers: across workers, {name} reads {tensor.name}, rows of the '
          f'batch: it shows this task\'s rows (its towers\'), not the whole cluster\'s, '
          f'which would cross the network in every step. Scalars (means, sums, ratios, '
          f'maxima, minima over the batch) are the whole cluster\'s.',
          key='whole_batch_views:workers')
    elif self._across is not None and view is not tensor:
      self._cluster_views.append(view)
    self._views[tensor.name] = view
    return view

  def _build(self, tensor: tf.Tensor) -> tf.Tensor | None:
    if not self._dependence.shard(tensor):   # not of the shard: the same on every tower
      return tensor
    with tf.name_scope('whole_batch_views'):
      if self._is_rows(tensor):
        if self._across is not None:
          self._task_rows.add(tensor.name)
        return self._joined(tensor)
      if tensor.shape.num_elements() != 1:
        return None
      reduce = _REDUCTIONS.get(tensor.op.type)
      if reduce is not None and self._is_rows(tensor.op.inputs[0]):   # over the batch
        rows = self._joined(tensor.op.inputs[0])
        if rows is not None:
          total = (reduce(rows) if self._across is None
                   else _across_workers(self._across, tensor.op.type, rows))
          return None if total is None else tf.reshape(total, tf.shape(tensor))
      values = self._counterparts(tensor)
      if values is None or len(values) != len(self._shards.active):
        return None
      return reported.whole_batch_value(list(values), self._shards, self._graph,
                                        self._batch, self._across)

  def _is_rows(self, tensor: tf.Tensor) -> bool:
    kind = row_dependence.classify([tensor], self._inputs).kind(tensor)
    return kind is not None and kind == row_dependence.Kind(row_dependence.ROWS)

  def _joined(self, rows: tf.Tensor) -> tf.Tensor | None:
    """Every tower's rows of tower 0's `rows`, in example order (this task's)."""
    values = self._counterparts(rows)
    if values is None:
      return None
    return sharding.concat([v for v, ne in zip(values, self._shards.nonempty) if ne is not False])

  def rebind_summaries(self, summaries: Sequence[tf.Tensor]) -> None:
    """Every summary op among `summaries` reads the whole batch's value."""
    for summary in summaries:
      op = getattr(summary, 'op', None)
      index = _SUMMARIES.get(getattr(op, 'type', None))
      if index is None:
        continue
      value = op.inputs[index]
      whole = self.whole(value, f'the summary {op.name}')
      if whole is not value:   # of any shape (a static shard's rows are fewer)
        interception.replace_input(op, index, tf.compat.v1.placeholder_with_default(
            whole, shape=None))

  def rebind_hooks(self, hooks: Sequence[Any]) -> tuple:
    """`hooks`, each fetching the whole batch's tensors (`Rebound`)."""
    rebound = []
    for hook in hooks:
      if isinstance(hook, tf.compat.v1.train.CheckpointSaverHook):
        rebound.append(hook)   # Estimator looks for it by its type; it fetches no tensor
        continue
      for tensor in interception.hook_tensors(hook):
        if isinstance(tensor, str):
          # A name made later (global_mean's, once every tower is built) is the
          # whole batch's value already; the hook finds it at begin().
          tensor = _existing(self._graph, tensor)
        if isinstance(tensor, tf.Tensor):
          self.whole(tensor, f'the hook {type(hook).__name__}')
      rebound.append(Rebound(hook, dict(self._views)))
    return tuple(rebound)


def _across_workers(across: Any, reduction: str, rows: tf.Tensor) -> tf.Tensor | None:
  """A reduction over every axis of the cluster's rows, from this task's `rows`: a sum
  or a mean by an all-reduce, a max or a min over the tasks' own (a task whose input has
  ended counts none); None for another (a product)."""
  live = across.has_data
  if reduction in ('Sum', 'Mean'):
    if reduction == 'Mean' and not rows.dtype.is_floating:
      return None
    total = tf.reduce_sum(rows)
    parts = [tf.where(live, total, tf.zeros_like(total))]
    if reduction == 'Mean':
      parts.append(tf.where(live, tf.cast(tf.size(rows), rows.dtype), tf.zeros([], rows.dtype)))
    sums = across.sum(parts)
    return sums[0] if reduction == 'Sum' else sums[0] / tf.maximum(sums[1], 1)
  if reduction not in ('Max', 'Min'):
    return None
  reduce = tf.reduce_max if reduction == 'Max' else tf.reduce_min
  bound = rows.dtype.min if reduction == 'Max' else rows.dtype.max
  mine = tf.where(live, reduce(rows), tf.constant(bound, rows.dtype))
  return reduce(across.gather(mine[None]))


def _existing(graph: tf.Graph, name: str) -> Any:
  """The graph element `name` names, or None while the graph has none of that name."""
  try:
    return graph.as_graph_element(name)
  except (KeyError, ValueError):
    return None


class Rebound(tf.compat.v1.train.SessionRunHook):
  """`hook`, its fetches of tower 0's tensors turned into the whole batch's (`views`:
  tensor name -> tensor)."""

  def __init__(self, hook: tf.compat.v1.train.SessionRunHook, views: dict):
    self.hook, self._views = hook, views

  def begin(self):
    self.hook.begin()

  def after_create_session(self, session, coord):
    self.hook.after_create_session(session, coord)

  def before_run(self, run_context):
    args = self.hook.before_run(run_context)
    if args is None or args.fetches is None:
      return args
    fetches = tf.nest.map_structure(self._view, args.fetches)
    return tf.compat.v1.train.SessionRunArgs(fetches, args.feed_dict, args.options)

  def _view(self, fetch: Any) -> Any:
    name = fetch if isinstance(fetch, str) else getattr(fetch, 'name', None)
    return self._views.get(name, fetch) if isinstance(name, str) else fetch

  def after_run(self, run_context, run_values):
    self.hook.after_run(run_context, run_values)

  def end(self, session):
    self.hook.end(session)
