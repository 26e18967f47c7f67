"""The backward passes of the whole-batch gradient: one over every tower, or one per shard.

`seeds` says what each shard's backward pass starts from (its ys and their
initial gradients); this module builds the passes and hands each variable's
parts to `gradient_sync` to meet.

- Towers alone: one backward pass over every tower's seeds, each tower's part
  colocated with its forward ops, so it runs on that tower's device. A
  variable's part is taken per copy of it a tower read (the 'replicated' and
  'collective' placements' copies, a parameter server's reads), so that the
  parts meet where `gradient_sync` says rather than wherever the pass would.
- Micro-batches: one backward pass per shard. The micro-batches of a device
  run one after another, so each one's backward pass must be ops of its own;
  the parts of a variable's gradient from one device's micro-batches are
  summed on that device, in micro-batch order, before they cross to the
  variable's aggregation device, so the bytes sent per step do not grow with
  the number of micro-batches. The next micro-batch's inputs wait for the
  running sums (`after_backward`), not only for the micro-batch's gradients:
  each is then added as soon as it exists and freed, and grappler cannot merge
  the chain of sums into one AddN that would keep every micro-batch's
  gradients alive until the last one's (bench/micro_batches_bench.py
  --model=two_encoders shows it). A micro-batch's pass keeps the model_fn's per-op gates
  (see `_options`). Only the first request is ordered: a later one's backward
  pass depends on the earlier whole-batch answer, which depends on every
  micro-batch.

Either way, a rebuilt loss's shard-independent terms (a regulariser) get one
more pass: the whole loss's, stopped at the totals of the shards' statistics
(`Seeds.stops`), added once by `gradient_sync`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.gradients import fixed_order
from estimator_towers.gradients import gradient_sync
from estimator_towers.gradients.request import is_ref_variable
from estimator_towers.gradients.request import Request
from estimator_towers.placement import strategies
from estimator_towers.towers import tower_copies


def _graph_gradients(*args, **kwargs) -> list:
  """`tf.gradients`, what it builds by a tower's loop placed (`place_gradient_loops`)."""
  graph = tf.compat.v1.get_default_graph()
  first = len(graph.get_operations())
  grads = interception.graph_gradients(*args, **kwargs)
  strategies.place_gradient_loops(graph.get_operations()[first:])
  return grads


def _options(primary: Request, stops: list, gates: bool = False, fixed: bool = False) -> dict:
  """The primary request's gradient options for one backward pass of ours.

  `gates`: keep the primary's per-op gates (`gate_gradients`, which
  Optimizer's default GATE_OP asks for) instead of dropping them. They only
  order a gradient op's outputs, with the same values, and add an Identity per
  input and a NoOp to every multi-input op, so one backward pass over every
  tower drops them; a micro-batch's backward pass keeps them, because that
  order is plain's: without it the executor may compute an elementwise layer's
  input gradient before reducing its parameter's, which keeps one more
  activation-sized buffer alive (bench/micro_batches_bench.py: the allocator's
  peak 1.20 x plain at B / k without the gates, 1.04 x with them). With ref
  variables (`disable_resource_variables()`) the gates are always kept: a read
  of a ref variable shares its buffer, which the update changes in place, and
  the gates are what makes a variable's update wait for every gradient op that
  reads it (a layer's input gradient reads its kernel), as on one device.

  `fixed` (the shard grid): TensorFlow's default aggregation of a tensor's
  gradients from several consumers sums them per device first, an order that
  depends on the topology (a tower's activations reached from every tower
  through a batch norm's global statistics); the pairwise running sum sums
  them in the graph's order, the same on any topology.
  """
  options = dict(primary.options)
  options['stop_gradients'] = stops or None
  if fixed:  # a tensor's gradients from several consumers: summed in consumer order, not by device
    options['aggregation_method'] = tf.AggregationMethod.EXPERIMENTAL_TREE
  options['colocate_gradients_with_ops'] = True
  if not gates and not any(is_ref_variable(x) for x in primary.xs):
    options['gate_gradients'] = False
  return options


class BackwardPasses:
  """Builds a request's whole-batch gradient from its seeds.

  Args:
    sync: where a variable's parts meet (`gradient_sync.GradientSync`).
    copy_of: `copy_of(variable, k)` is tower k's own copy of `variable`, or None.
    device_of: with micro-batches, `device_of(k)` is the device shard k runs
      on (then each shard gets a backward pass of its own); None: towers alone.
    after_backward: with micro-batches, `after_backward(k, sums)` is called
      once shard k's backward pass of the first request is built, with its
      device's running sums of the gradients so far (to order the next
      micro-batch of its device after them).
    copies: the towers' copies of tower 0's forward pass (`tower_copies`), or
      None; a copied tower's backward pass is a copy of tower 0's.
    fixed: with the fixed shard grid, its summation order (`fixed_order`):
      one backward pass per shard (`device_of` is then required), the parts
      summed over the fixed tree instead of meeting by the placement's rule.
  """

  def __init__(self, sync: gradient_sync.GradientSync,
               copy_of: Callable[[tf.Variable, int], tf.Variable | None],
               device_of: Callable[[int], str] | None = None,
               after_backward: Callable[[int, list], None] | None = None,
               copies: tower_copies.TowerCopies | None = None,
               fixed: fixed_order.FixedOrder | None = None):
    self.sync = sync
    self._fixed = fixed
    self._copies = copies
    self._copy_of = copy_of
    self._device_of = device_of
    self._after_backward = after_backward

  @property
  def per_shard(self) -> bool:
    return self._device_of is not None

  @property
  def copied_towers(self) -> bool:
    """True if some tower's forward pass is a copy (its backward pass is then one of its own)."""
    return self._copies is not None and self._copies.any_copied()

  def adopt(self, k: int, pairs: dict) -> None:
    """Tower k's counterparts of tensors made after its forward pass (`TowerCopies.adopt`)."""
    if self._copies is not None:
      self._copies.adopt(k, pairs)

  def answer(self, towers: Sequence[int], requests: Sequence[Request], seeds: Any,
             ordered: bool) -> list:
    """The whole-batch gradient of `requests` (one per tower, the primary's first)."""
    primary = requests[0]
    if self._fixed is not None:
      answer = self._in_fixed_order(towers, requests, seeds.shards, ordered)
    else:
      if self.per_shard:
        parts = self._per_shard(towers, requests, seeds.shards, ordered)
      else:
        parts = self._one_pass(towers, requests, seeds.shards, copied=not seeds.one_pass)
      answer = [self.sync.meet(x, p) for x, p in zip(primary.xs, parts)]
    direct = None
    if seeds.stops:  # the shard-independent terms
      # A request of several tensors is differentiated as one scalar (`request_seeds`), whose
      # initial gradient is ones.
      grad_ys = primary.grad_ys[:1] if len(primary.ys) == 1 else [None]
      direct = self._gradients(towers, primary, [seeds.loss], grad_ys,
                               primary.stops + list(seeds.stops))
    return self.sync.finish(primary.xs, answer, direct)

  def _one_pass(self, towers: Sequence[int], requests: Sequence[Request],
                shards: Sequence, copied: bool = True) -> list:
    """Per primary x, its parts from one backward pass over every tower's seeds
    (or, with `copied`, tower 0's pass and its copies where the towers are copies)."""
    copied = self._copied_passes(towers, requests, shards) if copied else None
    if copied is not None:
      return copied
    primary = requests[0]
    ys, grad_ys, stops = [], [], []
    for request, (tower_ys, tower_grad_ys) in zip(requests, shards):
      ys.extend(tower_ys)
      grad_ys.extend(tower_grad_ys)
      stops.extend(request.stops)
    xs, members, reads = self._xs_and_members(primary, towers)
    grads = _graph_gradients(ys, xs, grad_ys, **_options(primary, stops + reads))
    return [[grads[j] for j in positions] for positions in members]

  def _copied_passes(self, towers: Sequence[int], requests: Sequence[Request],
                     shards: Sequence) -> list | None:
    """Per primary x, its parts per tower: tower 0's backward pass and its copies.

    For the towers whose forward pass is a copy of tower 0's (`tower_copies`),
    their backward pass is a copy of tower 0's on their forward tensors and
    seeds (and its own copies of the variables, if it has them); any other
    tower's is built. None where the request is not with respect to
    variables alone, or to one on a parameter server.
    """
    copies, primary = self._copies, requests[0]
    if (copies is None or not any(copies.copied(k) for k in towers[1:]) or not shards[0][0]
        or any(not isinstance(x, tf.Variable) or self.sync.aggregation_device(x) != x.device
               for x in primary.xs)):
      return None
    xs = list(primary.xs)
    ys0, seeds0 = shards[0]
    with copies.recording() as recording:
      first = _graph_gradients(ys0, xs, seeds0, **_options(primary, primary.stops))
    parts = [[g] for g in first]
    for k, request, (ys, seeds) in zip(towers[1:], requests[1:], shards[1:]):
      grads = self._copied_pass(k, recording, first, ys0, seeds0, ys, seeds)
      if grads is None:  # a built tower: with respect to its own copies, if it has them
        mine = [x if self._copy_of(x, k) is None else self._copy_of(x, k) for x in xs]
        grads = (_graph_gradients(ys, mine, seeds, **_options(primary, request.stops))
                 if ys else [None] * len(xs))
      for part, grad in zip(parts, grads):
        part.append(grad)
    return parts

  def _copied_pass(self, k: int, recording: tower_copies.Recording, first: list,
                   ys0: list, seeds0: list, ys: list, seeds: list) -> list | None:
    """Tower k's gradients as a copy of tower 0's pass `first`, or None if it cannot be."""
    copies = self._copies
    made = set(recording.ops)
    if (not copies.copied(k) or len(ys) != len(ys0) or len(seeds) != len(seeds0)
        or not all(copies.matches(k, a, b) for a, b in zip(ys0, ys))
        or any((a is None) != (b is None) for a, b in zip(seeds0, seeds))
        or not all(t.op in made for g in first for t in tower_copies.components(g))):
      return None
    theirs = copies.copy_pass(k, recording, {a.ref(): b for a, b in zip(seeds0, seeds)
                                             if a is not None},
                              [t for g in first for t in tower_copies.components(g)])
    if theirs is None:
      return None
    grads = [tower_copies.map_gradient(theirs, g) for g in first]
    return None if any(g is None and f is not None for g, f in zip(grads, first)) else grads

  def _per_shard(self, towers: Sequence[int], requests: Sequence[Request],
                 shards: Sequence, ordered: bool) -> list:
    """Per primary x, its parts per device from one backward pass per shard."""
    primary = requests[0]
    by_device: dict[str, list] = {}
    for k, request, (ys, grad_ys) in zip(towers, requests, shards):
      grads = self._gradients([k], primary, ys, grad_ys, request.stops)
      device = self._device_of(k)
      if device not in by_device:
        by_device[device] = grads
      else:
        with tf.device(device), tf.name_scope('micro_batch_sum'):
          by_device[device] = [gradient_sync.add([a, b])
                               for a, b in zip(by_device[device], grads)]
      if ordered and self._after_backward is not None:
        self._after_backward(k, [g for g in by_device[device] if g is not None])
    return [[grads[i] for grads in by_device.values()] for i in range(len(primary.xs))]

  def _in_fixed_order(self, towers: Sequence[int], requests: Sequence[Request],
                      shards: Sequence, ordered: bool) -> list:
    """Per primary x, the sum of its per-shard gradients over the fixed tree."""
    primary = requests[0]
    per_shard = {k: self._gradients([k], primary, ys, grad_ys, request.stops)
                 for k, request, (ys, grad_ys) in zip(towers, requests, shards)}
    done: dict[int, list] = {}
    answer = []
    for i, x in enumerate(primary.xs):
      device = self.sync.aggregation_device(x) if isinstance(x, tf.Variable) else None
      answer.append(self._fixed.total(
          {k: grads[i] for k, grads in per_shard.items()}, device,
          lambda last, values: done.setdefault(last, []).extend(values)))
    if ordered and self._after_backward is not None:
      for k in towers:
        self._after_backward(k, [g for g in per_shard[k] if g is not None] + done.get(k, []))
    return answer

  def _gated(self) -> bool:
    """Whether a shard's backward pass keeps the per-op gates: with micro-batches (their
    order is plain's: see `_options`); not for the grid's towers side by side."""
    return self.per_shard and (self._fixed is None or self._after_backward is not None)

  def _gradients(self, shards: Sequence[int], primary: Request, ys: list, grad_ys: list,
                 stops: list) -> list:
    """The gradient of `ys` (built by `shards`) with respect to each of the primary's xs."""
    if not ys:  # a shard whose seeds are all zero
      return [None] * len(primary.xs)
    xs, members, reads = self._xs_and_members(primary, shards)
    grads = _graph_gradients(
        ys, xs, grad_ys, **_options(primary, stops + reads, gates=self._gated(),
                                    fixed=self._fixed is not None))
    device = self._device_of(shards[0]) if self.per_shard else None
    with tf.device(device), tf.name_scope('shard_gradients'):
      return [gradient_sync.add([grads[j] for j in positions]) for positions in members]

  def _xs_and_members(self, primary: Request, towers: Sequence[int]
                      ) -> tuple[list, list, list]:
    """What to differentiate for `towers`' parts of each of the primary's xs.

    Returns:
      (xs, members, reads): the tensors and variables to differentiate; per
      primary x, the positions in xs whose gradients are its parts (the
      towers' copies of a variable, each tower's reads of a variable on a
      parameter server); the parameter-server reads among xs (the backward
      pass stops at them).
    """
    xs, members, reads = [], [], []
    for x in primary.xs:
      found = [x]
      if isinstance(x, tf.Variable):
        found = []
        for k in towers:
          copy = self._copy_of(x, k)
          member = x if copy is None else copy
          if all(member is not m for m in found):
            found.append(member)
        if self.sync.aggregation_device(x) != x.device:  # on a parameter server
          ps_reads = interception.plain_reads(x)
          found.extend(ps_reads)
          reads.extend(ps_reads)
      members.append(list(range(len(xs), len(xs) + len(found))))
      xs.extend(found)
    return xs, members, reads
