"""The whole-batch gradient: what the model_fn gets when it asks for gradients.

In TRAIN, the primary tower (tower 0) runs the user's model_fn in the model_fn's
own flow, on its shard. When it asks for gradients with respect to variables
(`tf.gradients`, `Optimizer.compute_gradients` / `minimize`, Keras legacy
`get_gradients` / `minimize`, or anything built on them), the request is
answered with the gradient of the global-batch loss instead:

    sum_k  w_k * loss_k      (w_k = n_k / B for a mean-reduced loss, 1 for a sum)

over the towers' matching losses. The other towers are made at that moment
(copied from tower 0's ops by `tower_copies` where they can be, else built
in a clean context), each on its own device, and each is stopped at its own
matching request, where its loss is recorded: they have their forward pass
and nothing else, so none of their updates exists. The gradient is one
backward pass over every tower's loss (`grad_ys = w_k`; for copied towers,
tower 0's pass and a copy of it per tower), each tower's part colocated with
its forward ops, so it runs on that tower's device; the
contributions to a variable meet on the variable's device. Everything the
model_fn then does with the gradients (clipping, loss scaling, summaries, its
own optimizer's `apply_gradients`, a manual `global_step` update, a Saver) runs
once, exactly as on one device.

The loss's rule comes from `loss_algebra`: a mean weighs tower k by its share
of the examples (w_k = n_k / B), a sum by 1, and any other loss of the batch's
statistics (sum(xent * w) / sum(w) over padded tokens, BERT's two terms, a
ratio plus a regulariser) is rebuilt on the whole batch's statistics and
differentiated as one loss. With micro-batches each shard gets a backward
pass of its own, seeded with its weight or with its numerators' coefficients.
`seeds` says what each shard's backward pass starts from, `backward_passes`
builds the passes and `gradient_sync` is where a variable's parts meet
(between devices and, in a cluster, between workers).

The rule that tells requests apart: a request made while a tower's graph is
built (not inside a `tf.function`) whose `xs` include a `tf.Variable` is a
*whole-batch* request. Any other request (with respect to inputs or
activations, as in a gradient penalty) keeps its per-tower meaning and is
passed to TensorFlow untouched. A model_fn that asks several times (a GAN's two
optimizers, double back-prop) gets a whole-batch answer each time; for request
r the other towers are rebuilt up to their r-th request, earlier ones answered
with the earlier whole-batch gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.gradients import backward_passes
from estimator_towers.gradients.request import pack
from estimator_towers.gradients.request import parse
from estimator_towers.gradients.request import Request
from estimator_towers.heads import batch_mixing
from estimator_towers.loss import loss_algebra
from estimator_towers.loss import request_seeds
from estimator_towers.loss import seeds as seeds_lib
from estimator_towers.towers import builder as builder_lib
from estimator_towers.towers import counterparts


class DivergentTowersError(ValueError):
  """Towers asked for different gradients."""


def _identity(grad: Any) -> Any:
  """`grad` through an Identity made in the caller's control dependencies.

  The Identity is colocated with the gradient (on its variable's device), so
  that it adds no transfer between devices.
  """
  if grad is None:
    return None
  if isinstance(grad, tf.IndexedSlices):
    with tf.compat.v1.get_default_graph().colocate_with(grad.values.op):
      return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices),
                              grad.dense_shape)
  with tf.compat.v1.get_default_graph().colocate_with(grad.op):
    return tf.identity(grad)


@dataclasses.dataclass
class _Progress:
  """A non-primary tower's build: the request it stops at and what it made."""
  stop_at: int | None
  count: int = 0
  captured: Request | None = None


class WholeBatchGradients:
  """Answers the gradient requests made while the towers of one graph are built.

  Args:
    graph: the graph being built.
    towers: indices of the towers that are built; the first is the primary.
    sizes: per-tower shard sizes (Python ints or scalar Tensors), by tower index.
    batch: the global batch size (Python int or scalar Tensor; the cluster's
      across workers).
    loss_reduction: 'auto', 'mean' or 'sum'.
    build_tower: `build_tower(k, stop_at)` builds tower k, stopping at its
      `stop_at`-th whole-batch request (None: at the end of its model_fn).
    passes: builds the backward passes (`backward_passes.BackwardPasses`).
    primary: maps a tower's copy of a variable to the variable itself.
    variable_count: the number of variables created so far.
    creation_spans: (first, end) positions in the graph's op list of the ops
      made to create variables (left out when towers' ops are matched).
    inputs: the primary tower's shard tensors, flattened (for `loss_algebra`).
    nonempty: per tower index, whether its shard is not empty (bool or Tensor).
    ungated: with micro-batches, `ungated(k)` is shard k's flattened inputs
      before its micro-batch gates (aligned with `inputs`).
    gates: with micro-batches, per shard, the Identity ops its inputs pass
      through (a loss that mixes rows orders them after its head's gradient).
    cross_example: the plan's ('refuse': a head run once on the whole batch
      is an error).
  """

  def __init__(self, graph: tf.Graph, towers: Sequence[int], sizes: Sequence, batch: Any,
               loss_reduction: str, build_tower: Callable[[int, int | None], Any],
               passes: backward_passes.BackwardPasses,
               primary: Callable[[tf.Variable], tf.Variable],
               variable_count: Callable[[], int],
               creation_spans: Sequence[tuple[int, int]] = (),
               inputs: Sequence[tf.Tensor] = (), nonempty: Any = None,
               ungated: Callable[[int], list] | None = None, gates: dict | None = None,
               cross_example: str = 'auto'):
    self._graph = graph
    self.towers = list(towers)
    self._sizes = sizes
    self._batch = batch
    self._loss_reduction = loss_reduction
    self._build_tower = build_tower
    self._passes = passes
    self._primary = primary
    self._variable_count = variable_count
    self._inputs = list(inputs)
    self._nonempty = nonempty if nonempty is not None else {k: True for k in towers}
    self._ungated = ungated
    self._gates = gates or {}
    self._cross_example = cross_example
    self.requests: list[Request] = []   # the primary's whole-batch requests
    self.variables_at: list[int] = []   # variables created before each request
    self.answers: list[list] = []       # the whole-batch gradients, per request
    self.others: dict[int, dict[int, Request]] = {k: {} for k in self.towers[1:]}
    self._building: list[int] = []
    self._progress: dict[int, _Progress] = {}
    self._segments = counterparts.Segments(graph, creation_spans)
    self._whole_losses: dict = {}  # a ratio loss's ref -> the whole-batch loss differentiated

  # -- Which tower is being built ---------------------------------------------

  def building(self, tower: int, stop_at: int | None = None) -> '_Building':
    return _Building(self, tower, stop_at)

  def handle(self, kind: str, original: Callable, args: tuple, kwargs: dict) -> Any:
    """The interception handler (see `interception.gradient_requests`)."""
    if (not self._building or tf.compat.v1.get_default_graph() is not self._graph):
      return original(*args, **kwargs)
    request = parse(kind, args, kwargs)
    if not request.wants_variables:  # a gradient that is part of the model
      return original(*args, **kwargs)
    tower = self._building[-1]
    if tower == self.towers[0]:
      return pack(request, self._answer_primary(request))
    return pack(request, self._answer_other(tower, request))

  # -- The primary's requests -------------------------------------------------

  def _answer_primary(self, request: Request) -> list:
    r = len(self.requests)
    self.requests.append(request)
    self.variables_at.append(self._variable_count())
    if r == 0:
      self._segments.close(self.towers[0])
    # Built without the model_fn's control dependencies (an edge from each
    # to every op of every tower's backward pass), which are put back on the
    # gradients handed over, so that what the model_fn does with them still
    # waits for its control inputs.
    with interception.control_dependencies_set_aside(self._graph) as controlled:
      tower_requests = [request]
      for k in self.towers[1:]:
        # A later request whose tensors tower k already built (before its first
        # request) reuses them; otherwise tower k is rebuilt up to request r.
        mapped = self._mapped(k, request) if r else None
        if mapped is None:
          self._build_tower(k, r)
          mapped = self.others[k][r]
        self.others[k][r] = mapped
        tower_requests.append(mapped)
      answer = self._passes.answer(self.towers, tower_requests,
                                   self._seeds(tower_requests), ordered=r == 0)
    if controlled:
      answer = [_identity(g) for g in answer]
    self.answers.append(answer)
    return answer

  def _seeds(self, tower_requests: Sequence[Request]) -> seeds_lib.Seeds:
    """What each shard's backward pass starts from, by the loss's rule (`seeds`)."""
    primary = tower_requests[0]
    per_shard = self._passes.per_shard
    cut = False
    if not per_shard and self._ungated is not None:  # micro-batches refuse mixing
      cut = batch_mixing.cut(batch_mixing.Shards(
          [q.ys for q in tower_requests], [self._ungated(k) for k in self.towers],
          [self._sizes[k] for k in self.towers], [self._nonempty[k] for k in self.towers],
          self._passes.sync.across, lambda i, pairs: self._passes.adopt(self.towers[i], pairs)),
          loss_algebra.is_declared)
    found = request_seeds.for_request(
        self._graph, self._loss_reduction, self._inputs,
        [x for x in primary.xs if isinstance(x, tf.Variable)],
        [q.ys for q in tower_requests], [q.grad_ys for q in tower_requests],
        [self._nonempty[k] for k in self.towers], [self._sizes[k] for k in self.towers],
        self._batch,
        ungated=(lambda i: self._ungated(self.towers[i])) if per_shard else None,
        gates=lambda i: self._gates.get(self.towers[i], []) if len(self.requests) == 1 else [],
        across=self._passes.sync.across, per_shard=self._passes.copied_towers,
        cross_example=self._cross_example)
    if cut == batch_mixing.JOINED:  # every tower's rows meet in a cut: one backward pass
      found = dataclasses.replace(found, one_pass=True)
    if found.loss is not None and len(primary.ys) == 1:   # several: their sum's loss
      self._whole_losses.setdefault(primary.ys[0].ref(), found.loss)
    return found

  def whole_batch_loss(self, loss: tf.Tensor) -> tf.Tensor | None:
    """The whole-batch loss differentiated for tower 0's ratio loss `loss`, or None."""
    return self._whole_losses.get(loss.ref()) if isinstance(loss, tf.Tensor) else None

  # -- The other towers' requests ---------------------------------------------

  def _start(self, tower: int, stop_at: int | None) -> None:
    self._progress[tower] = _Progress(stop_at)

  def _answer_other(self, tower: int, request: Request) -> list:
    progress = self._progress[tower]
    i = progress.count
    progress.count += 1
    if i >= len(self.requests):
      raise DivergentTowersError(
          f'Tower {tower} asked for gradients with respect to variables more '
          f'often than tower 0 ({i + 1} times, tower 0: {len(self.requests)}). '
          f'Every tower runs the same model_fn and must make the same gradient '
          f'requests; do not branch on the shard or device around them.')
    self._check_same_variables(tower, i, request)
    if progress.stop_at is not None and i == progress.stop_at:
      progress.captured = request
      self.others[tower][i] = request
      if i == 0:
        self._segments.close(tower)
      raise builder_lib.TowerStop()
    return self.answers[i]

  def _check_same_variables(self, tower: int, i: int, request: Request) -> None:
    reference = self.requests[i].xs
    mine = [self._primary(x) if isinstance(x, tf.Variable) else x for x in request.xs]
    if len(mine) != len(reference) or any(a is not b for a, b in zip(mine, reference)):
      raise DivergentTowersError(
          f'Gradient request #{i} of tower {tower} is with respect to '
          f'{_names(request.xs)} but the same request of tower 0 is with '
          f'respect to {_names(reference)}. Every tower runs the same model_fn '
          f'and must ask for the same gradients.')

  def primary_segment(self) -> list[tf.Operation]:
    """The primary's ops from its model_fn's start to its first request (variables' left out)."""
    return self._segments.ops(self.towers[0])

  def adopt_copy(self, tower: int, counterpart: Callable[[tf.Tensor], tf.Tensor | None]
                 ) -> bool:
    """Tower `tower` is a copy of the primary up to its first request (`tower_copies`).

    `counterpart` maps the primary's segment and shard to the copy's. False
    (and nothing recorded) if the first request cannot be mapped.
    """
    self._segments.copied(tower, counterpart)
    mapped = self._mapped(tower, self.requests[0])
    if mapped is None:
      self._segments.copied(tower, None)
      return False
    self.others[tower][0] = mapped
    return True

  def stopped_at_expected_request(self, tower: int) -> bool:
    progress = self._progress[tower]
    return progress.stop_at is None or progress.captured is not None

  # -- Tower k's counterpart of a tensor of tower 0 ---------------------------

  def counterpart(self, tower: int, tensor: tf.Tensor) -> tf.Tensor | None:
    """Tower `tower`'s tensor matching `tensor` of the primary tower, or None.

    Found (1) for tensors from which a whole-batch request was derived (the
    loss, the logits), along the path from the request's ys; or (2) for any
    tensor the primary built before its first request, by its position in
    the tower's build (`counterparts`).
    """
    if not isinstance(tensor, tf.Tensor):
      return None
    for r, request in enumerate(self.requests):
      theirs = self.others[tower].get(r)
      found = None if theirs is None else counterparts.along(request.ys, theirs.ys, tensor)
      if found is not None:
        return found
    return self._segments.match(self.towers[0], tower, tensor)

  def all_counterparts(self, tensor: tf.Tensor) -> list[tf.Tensor] | None:
    """`tensor` and every other tower's counterpart, or None if one is unknown."""
    found = [tensor] + [self.counterpart(k, tensor) for k in self.towers[1:]]
    return None if any(t is None for t in found) else found

  def _mapped(self, tower: int, request: Request) -> Request | None:
    """Tower `tower`'s counterpart of a primary request, from what it built."""
    def each(tensors):
      found = [None if t is None else self.counterpart(tower, t) for t in tensors]
      return None if any(f is None and t is not None for f, t in zip(found, tensors)) else found
    ys, grad_ys, stops = each(request.ys), each(request.grad_ys), each(request.stops)
    if ys is None or grad_ys is None or stops is None:
      return None
    options = dict(request.options, stop_gradients=stops or None)
    return dataclasses.replace(request, ys=ys, grad_ys=grad_ys, options=options)


class _Building:
  """Marks a tower as being built (for `WholeBatchGradients.handle`)."""

  def __init__(self, broker: WholeBatchGradients, tower: int, stop_at: int | None):
    self._broker, self._tower, self._stop_at = broker, tower, stop_at

  def __enter__(self):
    broker = self._broker
    if self._tower != broker.towers[0]:
      broker._start(self._tower, self._stop_at)  # pylint: disable=protected-access
    broker._segments.start(self._tower)  # pylint: disable=protected-access
    broker._building.append(self._tower)  # pylint: disable=protected-access
    return self

  def __exit__(self, *exc):
    self._broker._building.pop()  # pylint: disable=protected-access
    return False


def _names(xs: Sequence) -> list[str]:
  return [getattr(x, 'name', repr(x)) for x in xs]
