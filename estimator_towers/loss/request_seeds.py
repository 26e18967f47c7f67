"""A gradient request's seeds: which rule gives what each shard's backward pass starts from.

`loss_algebra` gives the rule for a loss; the seeds follow from it
(`for_request` picks the rule; each rule's module makes the `seeds.Seeds`):

- 'mean' / 'sum' (the example-count rule): each shard's own loss, with the
  initial gradient w_k (n_k / B for a mean, 1 for a sum, 0 for a shard
  empty at run time) times the requested one (`statistics.tower_weights`,
  `seeds.weighted`).
- 'rebuild', towers: the whole batch's loss itself, f on the sums of the
  shards' statistics (`statistics.whole_batch_loss`), with the requested
  initial gradient: one backward pass through it reaches every shard. Across
  workers, each shard's statistics seeded with the loss's coefficients at
  the cluster's totals, so that a task's pass gives its own part only
  (`seeds.rebuilt`).
- 'rebuild', micro-batches (`micro_batch_seeds`): a micro-batch's backward
  pass runs before the later micro-batches' forward passes; its numerators
  are seeded with the loss's coefficients as known before it, and a loss
  whose coefficients depend on a numerator is refused at graph construction.
- a loss that mixes the batch's rows (`row_dependence`): its head on the
  whole batch (`whole_batch_head`); each shard's frontier tensors are seeded
  with their rows of the head's gradient (those of no float dtype, the
  comparison a `reduce_any` reads, seed nothing). With micro-batches the head
  reads the rows of a first pass over the micro-batches (`cached_gradients`).

A request of several tensors y_i (initial gradients g_i, ones where None) is
the request of one scalar per shard, sum_i <g_i, y_i> with the g_i held
constant: the same gradient, and one loss for the rules above.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import logs
from estimator_towers.base import spelling
from estimator_towers.heads import cached_gradients
from estimator_towers.heads import row_wise_head
from estimator_towers.heads import whole_batch_head
from estimator_towers.loss import loss_algebra
from estimator_towers.loss import micro_batch_seeds
from estimator_towers.loss import seeds as seeds_lib
from estimator_towers.loss import statistics as statistics_lib
from estimator_towers.rows import row_dependence
from estimator_towers.towers import counterparts


def for_request(graph: tf.Graph, loss_reduction: str, inputs: Sequence[tf.Tensor],
                variables: Sequence, ys: Sequence[list], grad_ys: Sequence[list],
                nonempty: Sequence, sizes: Sequence, batch: Any,
                ungated: Callable | None, across: Any = None, per_shard: bool = False,
                gates: Callable | None = None, cross_example: str = 'auto') -> seeds_lib.Seeds:
  """The seeds of one gradient request, per shard (shard 0 the primary).

  Args:
    graph: the graph (for the reduction a TensorFlow loss function recorded).
    loss_reduction: the plan's.
    inputs: the primary's shard tensors, flattened.
    variables: the trained variables the request is with respect to.
    ys, grad_ys: per shard, the request's tensors and initial gradients.
    nonempty, sizes: per shard, whether it has examples and how many.
    batch: the global batch's number of examples.
    ungated: with micro-batches, `ungated(i)`: shard i's inputs before its
      gates; None for towers.
    across: a `cross_worker.CrossWorker` when the batch spans workers (the
      totals are the cluster's; `batch` is the cluster's), else None.
    per_shard: a rebuilt loss's seeds per shard even for towers alone (each
      tower's backward pass its own: `tower_copies`).
    gates: with micro-batches, `gates(i)`: the Identity ops shard i's inputs
      pass through.
    cross_example: the plan's ('refuse': a head that runs once, on the whole
      batch, on one device is an error).

  Raises:
    ValueError: with cross_example='refuse', for a loss whose head runs once
      on the whole batch.
  """
  if len(ys[0]) > 1:   # several tensors: the request's gradient is one scalar's
    combined = _one_target(ys, grad_ys, inputs)
    if combined is not None:
      ys, grad_ys = [[c] for c in combined], [[None] for _ in combined]
  loss = ys[0][0] if len(ys[0]) == 1 else None
  find = counterparts.in_losses([y[0] for y in ys]) if loss is not None else None
  head = _whole_batch_head(loss, ys[0], inputs, grad_ys, find, nonempty, sizes, batch,
                           None if ungated is None else (ungated, gates or (lambda i: [])),
                           across, cross_example)
  if isinstance(head, seeds_lib.Seeds):
    return head
  analysis = loss_algebra.analyse(loss, inputs, variables, loss_reduction,
                                  lambda: statistics_lib.fallback_reduction(graph, loss),
                                  static_count=statistics_lib.static_counts(graph, find, sizes),
                                  targets=ys[0], micro_batches=ungated is not None,
                                  note=head)
  found = None
  if analysis.rule == 'rebuild':
    if ungated is None:
      found = seeds_lib.rebuilt(analysis.expression, find, nonempty, grad_ys[0][0], across,
                                per_shard)
    else:
      found = micro_batch_seeds.micro_batch(analysis.expression, find, ungated, nonempty,
                                            sizes, batch, grad_ys[0][0], across)
  if found is not None:
    return found
  rule = analysis.rule if analysis.rule != 'rebuild' else 'mean'
  return seeds_lib.weighted(ys, grad_ys,
                            statistics_lib.tower_weights(rule, sizes, batch, range(len(sizes))))


def _one_target(ys: Sequence[list], grad_ys: Sequence[list], inputs: Sequence[tf.Tensor]
                ) -> list | None:
  """Per shard, the scalar sum_i <g_i, y_i> of a request of several tensors, or None.

  Its gradient is the request's (the initial gradients g_i, ones where None,
  are constants of the backward pass), so a request of several losses, one
  of them mixing the batch's rows, is one loss: its head on the whole batch,
  or rebuilt by the loss algebra. None (each y seeded by the example-count
  rule) where an initial gradient depends on the shard, the shards' requests
  differ in form, or the ys differ in dtype.
  """
  given = [g for g in grad_ys[0] if isinstance(g, tf.Tensor)]
  if given and row_dependence.classify(given, inputs).kinds.keys() & {g.name for g in given}:
    return None
  kept = [i for i, y in enumerate(ys[0]) if isinstance(y, tf.Tensor) and y.dtype.is_floating]
  if not kept or len({ys[0][i].dtype for i in kept}) != 1 or any(
      len(y) != len(ys[0]) or [g is None for g in gs] != [g is None for g in grad_ys[0]]
      for y, gs in zip(ys, grad_ys)):
    return None
  combined = []
  for k, (shard_ys, shard_grads) in enumerate(zip(ys, grad_ys)):
    with tf.device(shard_ys[kept[0]].device), tf.name_scope(f'request_targets_{k}'):
      terms = [tf.reduce_sum(shard_ys[i] if shard_grads[i] is None else
                             shard_ys[i] * tf.stop_gradient(shard_grads[i])) for i in kept]
      combined.append(tf.add_n(terms) if len(terms) > 1 else terms[0])
  return combined


def _whole_batch_head(loss: Any, ys: Sequence, inputs: Sequence[tf.Tensor],
                      grad_ys: Sequence[list], find: Callable | None, nonempty: Sequence,
                      sizes: Sequence, batch: Any, micro: tuple | None, across: Any = None,
                      cross_example: str = 'auto') -> seeds_lib.Seeds | str | None:
  """A loss that mixes the batch's rows, its head on the whole batch (`whole_batch_head`).

  Each shard's backward pass starts from its frontier tensors' rows of the
  head's gradient; the head's own variables get theirs from the head's
  backward pass stopped at the frontier (`stops`). With micro-batches
  (`micro`: their `ungated` and `gates`), the head reads a first pass's rows
  (`cached_gradients`). None where no op mixes rows; a sentence saying why
  the head cannot be built (for `row_dependence`'s warning) where one does.
  """
  found = row_dependence.classify(ys, inputs, loss_algebra.is_declared)
  if not found.mixing:
    return None
  if not isinstance(loss, tf.Tensor):
    return ('the gradient request is of several tensors whose initial gradients depend on '
            'the batch, and the head takes one loss')
  if micro is None:
    built = whole_batch_head.build(found, loss, grad_ys[0][0], find, sizes, nonempty, batch,
                                   across, split=row_wise_head.build)
  else:
    built = cached_gradients.build(found, loss, grad_ys[0][0], find, inputs, *micro, sizes,
                                   nonempty, batch, across)
  if isinstance(built, str):
    return built
  whole, shards, stops, where = built
  if cross_example == 'refuse' and whole_batch_head.runs_once(where):
    _refuse(loss, found, where)
  shards = [_differentiable(ys, grads) for ys, grads in shards]
  logs.info_once_per_graph(
      f'estimator_towers: the loss {loss.name} depends on {found.mixing[0].describe()}, '
      f'which mixes the batch\'s rows: its head ({len(found.frontier)} gathered tensor(s) '
      f'to the loss) runs on the whole batch {where}'
      f'{", on the rows of a first pass over the micro-batches" if micro else ""}.')
  return seeds_lib.Seeds(shards, whole, stops)


def _differentiable(ys: list, grad_ys: list) -> tuple[list, list]:
  """A shard's frontier tensors and seeds, but those no gradient flows through.

  A frontier tensor of booleans or integers (`tf.reduce_any(xent > c)`'s
  comparison, `tf.reduce_max(labels)`'s labels) is read by the head but has
  no gradient: it seeds nothing.
  """
  kept = [(y, g) for y, g in zip(ys, grad_ys)
          if y.dtype.is_floating or y.dtype.is_complex]
  return [y for y, _ in kept], [g for _, g in kept]


def _refuse(loss: tf.Tensor, found: Any, where: str) -> None:
  """cross_example='refuse': a head built once on the whole batch is an error (see `for_request`)."""
  raise ValueError(
      f'{spelling.setting("cross_example", "refuse")}: the loss {loss.name} depends on '
      f'{found.mixing[0].describe()}, which mixes the batch\'s rows (as far as the library '
      f'can tell), and everything from it to the loss cannot be split per tower: it would '
      f'run once, on the whole batch, {where}, while the other devices wait. Keep each '
      f'example\'s rows apart up to the ops that must see the whole batch (the ops the row '
      f'reader knows: docs/cross_example.md), or pass '
      f'{spelling.setting("cross_example", "auto")} to train it that way (exact, not '
      f'data-parallel).')
