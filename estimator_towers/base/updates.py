"""Which ops change a variable's value: assignments, scatters, optimizers' applies.

Every stage that treats a tower's side effects apart from its computation asks
this one question (variable sharing, tower copies, the cluster's updates, the
towers' detached side effects); the answer is an op type's prefix.
"""

from __future__ import annotations

import tensorflow as tf

# Op types that change a variable's value (checked by prefix).
_UPDATE_PREFIXES = ('Assign', 'ResourceScatter', 'Scatter', 'ResourceApply', 'Apply',
                    'ResourceSparseApply', 'SparseApply')


def is_update(op: tf.Operation) -> bool:
  """Whether `op` changes a variable's value (an assignment, a scatter, an optimizer's apply)."""
  return op.type.startswith(_UPDATE_PREFIXES)
