"""The other towers, made at the primary's gradient request and stopped at their own.

In TRAIN only the primary tower runs the model_fn in the model_fn's own flow.
When it asks for the r-th gradient with respect to variables, every other
tower is made up to its own r-th request: copied from the primary's ops
(`tower_copies`) where the copy is what building would give, else built by
running the model_fn again in a clean context (the primary's name scope,
control dependencies, control-flow context and device stack set aside), on
its own device, with the shared variables, and stopped by `TowerStop`.
Either way a tower has its forward pass and nothing else: its updates are
detached, and Keras' batch-norm updates are not built. A tower that returns
before making the primary's requests does not run the same model_fn:
`DivergentTowersError`.

Each tower's loss is the counterpart of the primary's loss along the
gradient's path; a loss the gradients were not asked of is built by a
second pass of the model_fn (logged once).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.gradients import whole_batch
from estimator_towers.towers import builder as builder_lib


class OtherTowers:
  """Builds or copies the towers other than the primary for the broker's requests.

  Args:
    builder: the towers' builder (shards, devices, variable sharing).
    copies: the primary's forward pass copied per tower (`TowerCopies`), or None.
  """

  def __init__(self, builder: builder_lib.TowerBuilder, copies: Any):
    self.builder = builder
    self.copies = copies
    self.broker: whole_batch.WholeBatchGradients | None = None

  def attach(self, broker: whole_batch.WholeBatchGradients) -> None:
    """The broker whose requests the towers are made for (it calls `build`)."""
    self.broker = broker

  def build(self, k: int, stop_at: int | None) -> Any:
    """Tower k, in a clean context, up to its `stop_at`-th gradient request."""
    if self.copies is not None and stop_at == 0 and self._copied(k):
      return None
    builder, broker, graph = self.builder, self.broker, self.builder.graph
    expected = None if stop_at is None else broker.variables_at[stop_at]
    first_op = len(graph.get_operations())
    # Its updates would be dropped: Keras' batch-norm updates are not built.
    with interception.clean_context(graph, builder.devices), \
        builder.variable_sharing.suspended(), graph.name_scope(f'tower_{k}'), \
        builder_lib.tower_collections(builder.base), broker.building(k, stop_at), \
        interception.batch_norm_updates_skipped():
      spec = builder.build(k, reuse=True, expected=expected)
    builder_lib.detach_side_effects(graph.get_operations()[first_op:])
    if not broker.stopped_at_expected_request(k):
      raise whole_batch.DivergentTowersError(
          f'Tower {k} returned from the model_fn after {stop_at} gradient '
          f'request(s) with respect to variables, but tower 0 made more. '
          f'Every tower runs the same model_fn and must make the same gradient '
          f'requests; do not branch on the shard or device around them.')
    return spec

  def _copied(self, k: int) -> bool:
    """Tower k's forward pass copied from the primary's (`tower_copies`), if it can be."""
    broker = self.broker
    request = broker.requests[0]
    with interception.clean_context(self.builder.graph, self.builder.devices):
      counterpart = self.copies.copy(k, broker.primary_segment(),
                                     request.ys + request.grad_ys + request.stops)
    if counterpart is None:
      return False
    if not broker.adopt_copy(k, counterpart):  # copy() checked the request's tensors
      raise RuntimeError(f'estimator_towers: tower {k} was copied from tower 0 but its '
                         f'gradient request has no counterpart; please report this.')
    return True

  def counterparts(self, tensor: tf.Tensor) -> list | None:
    """Every built tower's counterpart of the primary's `tensor`, without borrowed rows.

    A shard whose size is known only at run time and turns out empty borrows
    an example; its counterpart is cut to the shard's size. None when some
    tower has no counterpart.
    """
    found = self.broker.all_counterparts(tensor)
    if found is None:
      return None
    shards = self.builder.shards
    return [t if isinstance(shards.sizes[k], int) or t.shape.rank == 0 else t[:shards.sizes[k]]
            for k, t in zip(shards.active, found)]

  def loss(self, k: int, loss: tf.Tensor) -> tf.Tensor:
    """Tower k's counterpart of the primary's loss (a second pass when there is none)."""
    loss_k = self.broker.counterpart(k, loss)
    if loss_k is None:  # The loss is not what the gradients were asked of.
      logs.warning_once(
          'estimator_towers: the EstimatorSpec\'s loss is not the tensor (or an '
          'ancestor of the tensor) the model_fn asked gradients of, so each '
          'tower\'s loss is built by a second pass of its model_fn, which costs '
          'an extra forward pass per step on every tower but the first.')
      with interception.gradient_requests(self.broker.handle):
        loss_k = self.build(k, None).loss
    return loss_k
