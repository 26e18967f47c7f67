"""The step's read comes first: every op that may write the global step waits for it.

Rule. Keyed draws key a step by the global step as it is when the step
starts. A model_fn, a hook or TensorFlow's own code may write the step in the
same session run, in no order with that read: BERT's
`global_step.assign(global_step + 1)` grouped with its update, an
`assign_add` a hook fetches beside the train op, a write inside a `tf.cond`,
a `tf.function` or a while loop. So every op that takes the step's variable
(its resource handle or ref) and is not a plain read is given a control input
on the read's copy (the `anchor`, a fresh tensor the draws' key is made of):
the op itself, or where the variable enters a v1 loop or cond, its Enter or
Switch, so that everything inside waits too. This is a graph edge, which
TensorFlow honours in every run, whatever the scheduling. It is done when the
model_fn returns and again in `StepOrderHook.begin`, which runs after every
other hook's `begin` (the last of the TRAIN spec's hooks) and so sees the ops
hooks build.

The read's own ops (the anchor's ancestors) are the only takers left alone.
What cannot be ordered is refused, naming the op: a function body that makes
a handle of its own to the step's variable (no op of the graph takes it, so
its writes cannot be found from the graph).
"""

from __future__ import annotations

from typing import Iterable

import tensorflow as tf

from estimator_towers.base import ancestry
from estimator_towers.base import control_flow
from estimator_towers.base import interception

__all__ = ['StepOrderHook', 'order_writes', 'unordered_writes']

# Ops that only read a variable: they need no order (a read's value is the step's either way).
_READS = frozenset({'ReadVariableOp', 'VarIsInitializedOp', 'IsVariableInitialized',
                    'VariableShape', '_ReadVariablesOp'})
_HANDLE_OPS = frozenset({'VarHandleOp', 'VariableV2', 'Variable'})


def _owners(graph: tf.Graph, step) -> list[tf.Operation]:
  """The ops that hold the step's variable: its own, and any other handle to it in `graph`."""
  own = step.op
  name = _shared_name(own)
  others = [op for op in graph.get_operations()
            if op.type in _HANDLE_OPS and op is not own and _shared_name(op) == name]
  return [own] + others


def _shared_name(op: tf.Operation) -> str:
  try:
    value = op.get_attr('shared_name')
  except ValueError:
    value = b''
  value = value.decode() if isinstance(value, bytes) else value
  return value or op.name


def _is_read(op: tf.Operation) -> bool:
  """A plain read: a read op, or the Identity a ref variable's value is (not a ref out)."""
  if op.type != 'Identity':
    return op.type in _READS
  dtype = op.outputs[0].dtype
  return dtype == dtype.base_dtype and dtype != tf.resource


def _takers(graph: tf.Graph, step) -> Iterable[tf.Operation]:
  """Every op that takes the step's variable, reads aside."""
  for owner in _owners(graph, step):
    for output in owner.outputs:
      for op in output.consumers():
        if not _is_read(op):
          yield op


def unordered_writes(graph: tf.Graph, anchor: tf.Operation, step=None) -> list[tf.Operation]:
  """The ops that may write the global step and do not wait for `anchor`."""
  step = step if step is not None else tf.compat.v1.train.get_global_step(graph)
  if step is None or not hasattr(step, 'op'):
    return []
  own = ancestry.ancestors(anchor)
  return [op for op in _takers(graph, step) if op not in own
          and anchor not in op.control_inputs
          and op is not getattr(step, 'initializer', None)]


def order_writes(graph: tf.Graph, anchor: tf.Operation) -> int:
  """Makes every op that may write the global step wait for `anchor`; how many it ordered.

  Raises:
    ValueError: for a write that cannot be ordered (see the module doc).
  """
  step = tf.compat.v1.train.get_global_step(graph)
  if step is None or not hasattr(step, 'op'):
    return 0
  _refuse_hidden_handles(graph, step)
  writes = unordered_writes(graph, anchor, step)
  for op in writes:
    interception.add_control_inputs(op, [anchor])
  return len(writes)


def _refuse_hidden_handles(graph: tf.Graph, step) -> None:
  name = _shared_name(step.op)
  for function, node in control_flow.function_nodes(graph):
    if node.op in _HANDLE_OPS and _shared_name_of_node(node) == name:
      raise _refusal(
          f'{node.op} {node.name} in the function {function}',
          'it makes its own handle to the global step inside a function body, so its '
          'writes cannot be seen or ordered from the graph')


def _shared_name_of_node(node) -> str:
  value = node.attr['shared_name'].s.decode() if 'shared_name' in node.attr else ''
  return value or node.name


def _refusal(what: str, why: str) -> ValueError:
  return ValueError(
      f'estimator_towers keys every random draw of a step by the global step read when the '
      f'step starts (random_draws=\'keyed\'), so every op that may write the global step '
      f'must wait for that read; {what} cannot: {why}. Fix: advance the global step '
      f'outside it (an optimizer\'s apply_gradients(global_step=...) or an assign in the '
      f'model_fn or a hook\'s begin()), or set random_draws=\'per_shard\'.')


class StepOrderHook(tf.compat.v1.train.SessionRunHook):
  """Orders the global step's writes that hooks built: the TRAIN spec's last hook, whose
  `begin` runs after every other hook's (the ops built after it, the Scaffold's init ops
  and Saver, run in session runs of their own)."""

  def __init__(self, anchor: tf.Operation):
    self._anchor = anchor

  def begin(self):
    order_writes(self._anchor.graph, self._anchor)
