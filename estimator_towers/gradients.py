"""The whole-batch gradient: what the model_fn gets when it asks for gradients.

In TRAIN, the primary tower (tower 0) runs the user's model_fn in the model_fn's
own flow, on its shard. When it asks for gradients with respect to variables
(`tf.gradients`, `Optimizer.compute_gradients` / `minimize`, Keras legacy
`get_gradients` / `minimize`, or anything built on them), the request is
answered with the gradient of the global-batch loss instead:

    sum_k  w_k * loss_k      (w_k = n_k / B for a mean-reduced loss, 1 for a sum)

over the towers' matching losses. The other towers are built at that moment,
each in a clean context on its own device, and each is stopped at its own
matching request, where its loss is recorded: they build their forward pass
and nothing else, so none of their updates exists. The gradient is one
backward pass over every tower's loss (`grad_ys = w_k`), each tower's part
colocated with its forward ops, so it runs on that tower's device; the
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
import inspect
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers import counterparts
from estimator_towers import interception
from estimator_towers import seeds as seeds_lib


class DivergentTowersError(ValueError):
  """Towers asked for different gradients."""


class TowerStop(BaseException):
  """Raised inside a non-primary tower at the request it was built for.

  A BaseException, so that a model_fn's own `except Exception` cannot swallow
  it.
  """


_GRAPH_SIGNATURE = inspect.signature(interception.graph_gradients)
_TAPE_SIGNATURE = inspect.signature(interception._tape_gradient)  # pylint: disable=protected-access


@dataclasses.dataclass
class Request:
  """One gradient request, flattened.

  Attributes:
    kind: 'graph' (tf.gradients and everything built on it) or 'tape'.
    ys: the tensors differentiated.
    xs: the tensors or variables differentiated with respect to.
    grad_ys: the user's initial gradients per y (None entries: ones).
    options: the remaining arguments of the graph gradients function.
    structure: for 'tape', the nest structure of the sources.
  """
  kind: str
  ys: list
  xs: list
  grad_ys: list
  options: dict
  structure: Any = None

  @property
  def wants_variables(self) -> bool:
    return any(isinstance(x, tf.Variable) for x in self.xs)


def _as_list(value: Any) -> list:
  return list(value) if isinstance(value, (list, tuple)) else [value]


def parse(kind: str, args: tuple, kwargs: dict) -> Request:
  """A Request from the arguments of an intercepted call."""
  if kind == 'graph':
    bound = _GRAPH_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    options = dict(bound.arguments)
    ys, xs = _as_list(options.pop('ys')), _as_list(options.pop('xs'))
    grad_ys = options.pop('grad_ys')
    grad_ys = [None] * len(ys) if grad_ys is None else _as_list(grad_ys)
    return Request(kind, ys, xs, grad_ys, options)
  bound = _TAPE_SIGNATURE.bind(*args, **kwargs)
  bound.apply_defaults()
  arguments = bound.arguments
  ys = tf.nest.flatten(arguments['target'])
  output_gradients = arguments['output_gradients']
  grad_ys = ([None] * len(ys) if output_gradients is None
             else tf.nest.flatten(output_gradients))
  options = {'unconnected_gradients': arguments['unconnected_gradients']}
  return Request(kind, ys, tf.nest.flatten(arguments['sources']), grad_ys, options,
                 structure=arguments['sources'])


def _pack(request: Request, grads: list) -> Any:
  if request.kind == 'tape':
    return tf.nest.pack_sequence_as(request.structure, grads)
  return grads


def _identity(grad: Any) -> Any:
  """`grad` through an Identity made in the caller's control dependencies.

  The Identity is colocated with the gradient (on its variable's device), so
  that it adds no transfer between devices.
  """
  if grad is None:
    return None
  if isinstance(grad, tf.IndexedSlices):
    with tf.compat.v1.colocate_with(grad.values.op):
      return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices),
                              grad.dense_shape)
  with tf.compat.v1.colocate_with(grad.op):
    return tf.identity(grad)


def _options(primary: Request, stops: list, gates: bool = False) -> dict:
  """The primary request's gradient options for one backward pass of ours.

  `gates`: keep the primary's per-op gates (`gate_gradients`, which
  Optimizer's default GATE_OP asks for) instead of dropping them. They only
  order a gradient op's outputs, with the same values, and add an Identity per
  input and a NoOp to every multi-input op, so one backward pass over every
  tower drops them; a micro-batch's backward pass keeps them, because that
  order is plain's: without it the executor may compute an elementwise layer's
  input gradient before reducing its parameter's, which keeps one more
  activation-sized buffer alive (bench/micro_batches_bench.py: the allocator's
  peak 1.20 x plain at B / k without the gates, 1.04 x with them).
  """
  options = dict(primary.options)
  options['stop_gradients'] = stops or None
  options['colocate_gradients_with_ops'] = True
  if not gates:
    options['gate_gradients'] = False
  return options


def _add(grads: Sequence) -> Any:
  """Sum of one variable's gradient parts (Tensors or IndexedSlices; None skipped)."""
  parts = [g for g in grads if g is not None]
  if not parts:
    return None
  if len(parts) == 1:
    return parts[0]
  if all(isinstance(p, tf.IndexedSlices) for p in parts):
    return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                            tf.concat([p.indices for p in parts], 0),
                            parts[0].dense_shape)
  return tf.add_n([tf.convert_to_tensor(p) for p in parts])


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
    batch: the global batch size (Python int or scalar Tensor).
    loss_reduction: 'auto', 'mean' or 'sum'.
    build_tower: `build_tower(k, stop_at)` builds tower k, stopping at its
      `stop_at`-th whole-batch request (None: at the end of its model_fn).
    copy_of: `copy_of(variable, k)` is tower k's own copy of `variable` (the
      'replicated' placement) or None.
    primary: maps a tower's copy of a variable to the variable itself.
    aggregation_device: the device on which a variable's gradient parts meet.
    variable_count: the number of variables created so far.
    creation_spans: (first, end) positions in the graph's op list of the ops
      made to create variables (left out when towers' ops are matched).
    inputs: the primary tower's shard tensors, flattened (for `loss_algebra`).
    nonempty: per tower index, whether its shard is not empty (bool or Tensor).
    ungated: with micro-batches, `ungated(k)` is shard k's flattened inputs
      before its micro-batch gates (aligned with `inputs`).
    device_of: with micro-batches, `device_of(k)` is the device tower
      (shard) k runs on; then each shard gets a backward pass of its own (see
      `_by_micro_batch`). None: one backward pass over every tower.
    after_backward: with micro-batches, `after_backward(k, grads)` is called
      once shard k's backward pass of the first request is built, with its
      gradients (to order the next micro-batch of its device after them).
    combine: `combine(parts)`: a variable's gradient from its parts, one per
      tower device in device order (the 'collective' placement's all-reduce),
      or None where it cannot; None: parts are added.
    across: a `cross_worker.CrossWorker` when the global batch spans the
      workers of a cluster (then `batch` is the cluster's and each answer is
      this worker's part summed over the workers, see `_across`), else None.
  """

  def __init__(self, graph: tf.Graph, towers: Sequence[int], sizes: Sequence, batch: Any,
               loss_reduction: str, build_tower: Callable[[int, int | None], Any],
               copy_of: Callable[[tf.Variable, int], tf.Variable | None],
               primary: Callable[[tf.Variable], tf.Variable],
               aggregation_device: Callable[[tf.Variable], str],
               variable_count: Callable[[], int],
               creation_spans: Sequence[tuple[int, int]] = (),
               inputs: Sequence[tf.Tensor] = (), nonempty: Any = None,
               ungated: Callable[[int], list] | None = None,
               device_of: Callable[[int], str] | None = None,
               after_backward: Callable[[int, list], None] | None = None,
               across: Any = None, combine: Callable[[list], Any] | None = None):
    self._across = across
    self._combine = combine
    self._graph = graph
    self._inputs = list(inputs)
    self._nonempty = nonempty if nonempty is not None else {k: True for k in towers}
    self._ungated = ungated
    self.towers = list(towers)
    self._sizes = sizes
    self._batch = batch
    self._loss_reduction = loss_reduction
    self._build_tower = build_tower
    self._copy_of = copy_of
    self._primary = primary
    self._aggregation_device = aggregation_device
    self._variable_count = variable_count
    self.requests: list[Request] = []   # the primary's whole-batch requests
    self.variables_at: list[int] = []   # variables created before each request
    self.answers: list[list] = []       # the whole-batch gradients, per request
    self.others: dict[int, dict[int, Request]] = {k: {} for k in self.towers[1:]}
    self._building: list[int] = []
    self._progress: dict[int, _Progress] = {}
    self._creation_spans = creation_spans
    self._device_of = device_of
    self._after_backward = after_backward
    self._starts: dict[int, int] = {}  # graph position where a tower's build began
    self._segments: dict[int, list[tf.Operation]] = {}  # ops before request 0
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
      return _pack(request, self._answer_primary(request))
    return _pack(request, self._answer_other(tower, request))

  # -- The primary's requests -------------------------------------------------

  def _answer_primary(self, request: Request) -> list:
    r = len(self.requests)
    self.requests.append(request)
    self.variables_at.append(self._variable_count())
    if r == 0:
      self._segments[self.towers[0]] = self._segment(self.towers[0])
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
      answer = self._answer(tower_requests, ordered=r == 0)
    if controlled:
      answer = [_identity(g) for g in answer]
    self.answers.append(answer)
    return answer

  def _answer(self, tower_requests: Sequence[Request], ordered: bool) -> list:
    """The whole-batch gradient from the rule's seeds: one backward pass, or one per shard."""
    found = self._seeds(tower_requests)
    if self._device_of is None:
      answer = self._whole_batch(tower_requests, found.shards)
      direct = None
      if self._across is not None and found.stops:
        primary = tower_requests[0]
        direct = self._shard_gradients(self.towers, primary, [found.loss],
                                       primary.grad_ys[:1], primary, found.stops)
      return self._sum_across(tower_requests[0], answer, direct)
    return self._by_micro_batch(tower_requests, found, ordered)

  def _sum_across(self, primary: Request, answer: list, direct: list | None,
                  included: bool = True) -> list:
    """Across workers: each variable's gradient summed over the workers.

    `direct` (or None): the part of the gradient that does not come through
    this worker's own statistics (the backward pass of the loss stopped at
    the cluster's totals: a regulariser's gradient), the same on every
    worker; added once after the sum (and, if `included` in `answer`, taken
    out of it before).
    """
    if self._across is None:
      return answer
    direct = direct or [None] * len(answer)
    chosen = [i for i, x in enumerate(primary.xs)
              if isinstance(x, tf.Variable) and answer[i] is not None]
    own = []
    for i in chosen:
      g = tf.convert_to_tensor(answer[i])
      own.append(g if direct[i] is None or not included
                 else g - tf.convert_to_tensor(direct[i]))
    summed = self._across.sum(own)
    answer = list(answer)
    for i, total in zip(chosen, summed):
      if direct[i] is not None:
        with tf.device(self._across.device):
          total = total + tf.convert_to_tensor(direct[i])
      answer[i] = total
    return answer

  def _seeds(self, tower_requests: Sequence[Request]) -> seeds_lib.Seeds:
    """What each shard's backward pass starts from, by the loss's rule (`seeds`)."""
    primary = tower_requests[0]
    found = seeds_lib.for_request(
        self._graph, self._loss_reduction, self._inputs,
        [x for x in primary.xs if isinstance(x, tf.Variable)],
        [q.ys for q in tower_requests], [q.grad_ys for q in tower_requests],
        [self._nonempty[k] for k in self.towers], [self._sizes[k] for k in self.towers],
        self._batch,
        ungated=None if self._device_of is None else lambda i: self._ungated(self.towers[i]),
        across=self._across)
    if found.loss is not None:
      self._whole_losses.setdefault(primary.ys[0].ref(), found.loss)
    return found

  def _whole_batch(self, tower_requests: Sequence[Request], seeds: Sequence) -> list:
    """One backward pass over every tower's seeds; parts summed per variable."""
    primary = tower_requests[0]
    ys, grad_ys, stops = [], [], []
    for request, (tower_ys, tower_grad_ys) in zip(tower_requests, seeds):
      ys.extend(tower_ys)
      grad_ys.extend(tower_grad_ys)
      stops.extend(_as_list(request.options.get('stop_gradients') or []))
    xs, parts, reads = self._xs_and_parts(primary, self.towers)
    stops.extend(reads)
    grads = interception.graph_gradients(ys, xs, grad_ys, **_options(primary, stops))
    combined = []
    for x, part in zip(primary.xs, parts):
      if len(part) == 1:
        combined.append(grads[part[0]])
        continue
      reduced = self._combine([grads[j] for j in part]) if self._combine else None
      if reduced is not None:
        combined.append(reduced)
        continue
      with tf.device(self._aggregation_device(x)), tf.name_scope('combine_gradients'):
        combined.append(_add([grads[j] for j in part]))
    return combined

  def _xs_and_parts(self, primary: Request, towers: Sequence[int]) -> tuple[list, list, list]:
    """What to differentiate for `towers`' parts of each of the primary's xs.

    A variable's gradient is summed from parts here rather than where the
    backward pass would meet: the towers' own copies of it ('replicated'),
    and each tower's reads of a variable on another task (a parameter
    server), whose parts are summed on the workers' CPU so that only the sum
    is sent.

    Returns:
      (xs, parts, reads): the tensors and variables to differentiate; per
      primary x, the positions in xs whose gradients sum to its gradient; the
      parameter-server reads among xs (to stop the backward pass at).
    """
    xs, parts, reads = [], [], []
    for x in primary.xs:
      members = [x]
      if isinstance(x, tf.Variable):
        members = []
        for k in towers:
          copy = self._copy_of(x, k)
          member = x if copy is None else copy
          if all(member is not m for m in members):
            members.append(member)
        if self._aggregation_device(x) != x.device:  # on a parameter server
          ps_reads = interception.plain_reads(x)
          members.extend(ps_reads)
          reads.extend(ps_reads)
      parts.append(list(range(len(xs), len(xs) + len(members))))
      xs.extend(members)
    return xs, parts, reads

  def whole_batch_loss(self, loss: tf.Tensor) -> tf.Tensor | None:
    """The whole-batch loss differentiated for tower 0's ratio loss `loss`, or None."""
    return self._whole_losses.get(loss.ref()) if isinstance(loss, tf.Tensor) else None

  def _by_micro_batch(self, tower_requests: Sequence[Request], found: seeds_lib.Seeds,
                      ordered: bool) -> list:
    """The whole-batch gradient with micro-batches: one backward pass per shard.

    Not one backward pass over every shard's loss (`_whole_batch`), for two
    reasons: the micro-batches of a device run one after another, so each
    one's backward pass must be ops of its own that the next micro-batch's
    inputs can wait for (`after_backward`); and the parts of a variable's
    gradient from one device's micro-batches are summed on that device, in
    micro-batch order, before they cross to the variable's aggregation device,
    so the bytes sent per step do not grow with the number of micro-batches
    (one backward pass over all losses would send each shard's part to the
    variable's device). Only the first request is ordered: a later one's
    backward pass depends on the earlier whole-batch answer, which depends on
    every micro-batch. A rebuilt loss's shard-independent terms (a
    regulariser) get the whole loss's backward pass, stopped at its totals.
    """
    primary = tower_requests[0]
    by_device: dict[str, list] = {}
    direct = None
    if found.stops:
      direct = self._shard_gradients(
          self.towers[0], primary, [found.loss], primary.grad_ys[:1], primary, found.stops)
      if self._across is None:
        by_device['whole_batch_loss'] = direct
    for k, request, (ys, grad_ys) in zip(self.towers, tower_requests, found.shards):
      grads = self._shard_gradients(k, request, ys, grad_ys, primary)
      device = self._device_of(k)
      if device not in by_device:
        by_device[device] = grads
      else:
        with tf.device(device), tf.name_scope('micro_batch_sum'):
          by_device[device] = [_add([a, b]) for a, b in zip(by_device[device], grads)]
      if ordered and self._after_backward is not None:
        self._after_backward(k, [g for g in grads if g is not None])
    combined = []
    for i, x in enumerate(primary.xs):
      parts = [grads[i] for grads in by_device.values()]
      if sum(p is not None for p in parts) <= 1:
        combined.append(_add(parts))
        continue
      reduced = (self._combine(parts) if self._combine and isinstance(x, tf.Variable)
                 and 'whole_batch_loss' not in by_device else None)
      if reduced is not None:
        combined.append(reduced)
        continue
      device = self._aggregation_device(x) if isinstance(x, tf.Variable) else None
      with tf.device(device), tf.name_scope('combine_gradients'):
        combined.append(_add(parts))
    return self._sum_across(primary, combined, direct, included=False)

  def _shard_gradients(self, k: int | Sequence[int], request: Request, ys: list, grad_ys: list,
                       primary: Request, stops: Sequence = ()) -> list:
    """Shard k's gradient of its seeds with respect to each of the primary's xs.

    `k` may be a list of shards (every tower: the backward pass of a loss
    made of all of them).
    """
    if not ys:  # a shard whose seeds are all zero
      return [None] * len(primary.xs)
    shards = list(k) if isinstance(k, (list, tuple)) else [k]
    xs, parts, reads = self._xs_and_parts(primary, shards)
    stops = _as_list(request.options.get('stop_gradients') or []) + reads + list(stops)
    micro = self._device_of is not None  # a micro-batch's pass keeps plain's gates
    grads = interception.graph_gradients(ys, xs, grad_ys,
                                         **_options(primary, stops, gates=micro))
    device = self._device_of(shards[0]) if micro else None
    with tf.device(device), tf.name_scope('shard_gradients'):
      return [_add([grads[j] for j in part]) for part in parts]

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
        self._segments[tower] = self._segment(tower)
      raise TowerStop()
    return self.answers[i]

  def _check_same_variables(self, tower: int, i: int, request: Request) -> None:
    reference = self.requests[i].xs
    mine = [self._primary_of(x) for x in request.xs]
    if len(mine) != len(reference) or any(a is not b for a, b in zip(mine, reference)):
      raise DivergentTowersError(
          f'Gradient request #{i} of tower {tower} is with respect to '
          f'{_names(request.xs)} but the same request of tower 0 is with '
          f'respect to {_names(reference)}. Every tower runs the same model_fn '
          f'and must ask for the same gradients.')

  def _primary_of(self, x: Any) -> Any:
    return self._primary(x) if isinstance(x, tf.Variable) else x

  def stopped_at_expected_request(self, tower: int) -> bool:
    progress = self._progress[tower]
    return progress.stop_at is None or progress.captured is not None

  # -- Tower k's counterpart of a tensor of tower 0 ---------------------------

  def counterpart(self, tower: int, tensor: tf.Tensor) -> tf.Tensor | None:
    """Tower `tower`'s tensor matching `tensor` of the primary tower, or None.

    Found (1) for tensors from which a whole-batch request was derived (the
    loss, the logits): the path of op inputs from the request's ys to `tensor`
    in the primary is followed from the tower's own ys, checking op types; or
    (2) for any tensor the primary built before its first request: the op made
    at the same position of the tower's own build (variable creation left
    out), when every op up to it has the same type.
    """
    if not isinstance(tensor, tf.Tensor):
      return None
    for r, request in enumerate(self.requests):
      theirs = self.others[tower].get(r)
      if theirs is None:
        continue
      for y, y_k in zip(request.ys, theirs.ys):
        path = counterparts.path(y, tensor)
        if path is not None:
          found = counterparts.follow(y_k, y, path)
          if found is not None:
            return found
    mine, theirs = self._segments.get(self.towers[0]), self._segments.get(tower)
    if not mine or theirs is None:
      return None
    position = {id(op): i for i, op in enumerate(mine)}.get(id(tensor.op))
    if position is None or position >= len(theirs):
      return None
    if any(a.type != b.type for a, b in zip(mine[:position + 1], theirs)):
      return None
    return theirs[position].outputs[tensor.value_index]

  def _mapped(self, tower: int, request: Request) -> Request | None:
    """Tower `tower`'s counterpart of a primary request, from what it built."""
    def each(tensors):
      found = [None if t is None else self.counterpart(tower, t) for t in tensors]
      return None if any(f is None and t is not None for f, t in zip(found, tensors)) else found
    ys, grad_ys = each(request.ys), each(request.grad_ys)
    stops = each(_as_list(request.options.get('stop_gradients') or []))
    if ys is None or grad_ys is None or stops is None:
      return None
    options = dict(request.options, stop_gradients=stops or None)
    return Request(request.kind, ys, request.xs, grad_ys, options, request.structure)

  def _segment(self, tower: int) -> list[tf.Operation]:
    """The ops a tower's build made so far, without those creating variables."""
    start = self._starts[tower]
    ops = self._graph.get_operations()[start:]
    skip = set()
    for first, end in self._creation_spans:
      if end > start:
        skip.update(range(max(first, start) - start, end - start))
    return [op for i, op in enumerate(ops) if i not in skip]


  def all_counterparts(self, tensor: tf.Tensor) -> list[tf.Tensor] | None:
    """`tensor` and every other tower's counterpart, or None if one is unknown."""
    found = [tensor] + [self.counterpart(k, tensor) for k in self.towers[1:]]
    return None if any(t is None for t in found) else found


class _Building:
  """Marks a tower as being built (for `WholeBatchGradients.handle`)."""

  def __init__(self, broker: WholeBatchGradients, tower: int, stop_at: int | None):
    self._broker, self._tower, self._stop_at = broker, tower, stop_at

  def __enter__(self):
    if self._tower != self._broker.towers[0]:
      self._broker._start(self._tower, self._stop_at)  # pylint: disable=protected-access
    self._broker._starts[self._tower] = self._broker._graph.version  # pylint: disable=protected-access
    self._broker._building.append(self._tower)  # pylint: disable=protected-access
    return self

  def __exit__(self, *exc):
    self._broker._building.pop()  # pylint: disable=protected-access
    return False


def _names(xs: Sequence) -> list[str]:
  return [getattr(x, 'name', repr(x)) for x in xs]
