"""Which ops change a variable's value: assignments, scatters, optimizers' applies.

Every stage that treats a tower's side effects apart from its computation asks
this one question (variable sharing, tower copies, the cluster's updates, the
towers' detached side effects, the order of a variable's reads and writes);
the answer is an op type's prefix. Which variable a resource handle is, is
the op that made it, followed back through the ops that pass a handle on.
"""

from __future__ import annotations

import tensorflow as tf

# Op types that change a variable's value (checked by prefix).
_UPDATE_PREFIXES = ('Assign', 'ResourceScatter', 'Scatter', 'ResourceApply', 'Apply',
                    'ResourceSparseApply', 'SparseApply')


def is_update(op: tf.Operation) -> bool:
  """Whether `op` changes a variable's value (an assignment, a scatter, an optimizer's apply)."""
  return op.type.startswith(_UPDATE_PREFIXES)


# Ops that pass a resource handle on unchanged.
_PASS_THROUGH = frozenset({'Identity', 'IdentityN'})


def variable_op(handle: tf.Tensor) -> tf.Operation:
  """The op that made the resource handle `handle` (its VarHandleOp), through the ops
  that pass a handle on."""
  while handle.op.type in _PASS_THROUGH and handle.op.inputs:
    handle = handle.op.inputs[0]
  return handle.op
