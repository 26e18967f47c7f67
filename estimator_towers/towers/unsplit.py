"""A model_fn whose step cannot be split across towers runs once, on the whole batch.

Updates that are not gradient steps (k-means' cluster updates) and EVAL
values of ops that mix the batch's rows cannot be split across towers: the
model_fn runs on the whole batch on tower 0's device, with the variables
tower 0 created, and the towers' build is unused. One warning says so and
why. In TRAIN, reads of a variable run before the later updates of it, as
the code says (`ordering`).
"""

from __future__ import annotations

import tensorflow as tf

from estimator_towers.base import logs
from estimator_towers.inputs import sharding
from estimator_towers.placement import strategies as placement_lib
from estimator_towers.towers import builder as builder_lib
from estimator_towers.towers import ordering
from estimator_towers.towers import tower_context


def run_unsplit(builder: builder_lib.TowerBuilder, features, labels, staged, why: str,
                order: bool = True) -> tf.estimator.EstimatorSpec:
  """The model_fn on the whole batch, on tower 0's device; `why` says why in the warning."""
  device = builder.tower_devices[0]
  _log_once(f'estimator_towers: {why} on the whole batch on {device}.')
  shards = builder.shards
  whole = (features, labels) if staged is None else (
      sharding.concat(shards.features), sharding.concat(shards.labels))
  first_op = len(builder.graph.get_operations())
  with tf.name_scope('whole_batch'), \
      tf.compat.v1.device(placement_lib.tower_device(device)), \
      builder.variable_sharing.reusing(0, builder.root_scope, copies=False), \
      tower_context.entering(0, 1, device, True):
    spec = builder.run(whole[0], whole[1], builder.mode)
  if order:  # Reads of a variable see it as the code says: before later updates.
    ordering.order_reads_before_writes(builder.graph.get_operations()[first_op:])
  return spec


_logged = set()


def _log_once(message: str) -> None:
  if message not in _logged:
    _logged.add(message)
    logs.warning(message)
