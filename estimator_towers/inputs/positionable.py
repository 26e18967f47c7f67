"""Which training inputs can be positioned, and what identifies their dataset.

Rule: tf.data saves an iterator's position (its dataset's graph, cursors,
shuffle buffers and seeds) when every op the dataset runs is a dataset op or
stateless. The next values of a Python generator, a `tf.py_function` /
`tf.numpy_function` or a stateful random op (`tf.random.uniform` in a `map`)
are in no checkpoint, so such an input cannot be positioned: it restarts from
its first element on resume, and the library says so once, at graph
construction, naming the op (`unpositionable`).

A restored iterator runs the dataset graph its checkpoint describes, not the
one the input_fn builds now, so a changed input_fn (another batch size, other
files) would silently go on with the old one. The `fingerprint` identifies a
dataset by its ops, attributes and constants, with the generated names of its
functions replaced by their bodies' own fingerprints: the same input_fn gives
the same fingerprint in any process and graph, another input_fn another one,
and a checkpoint whose fingerprint differs restores no position (one warning).
"""

from __future__ import annotations

import hashlib
from typing import Any

import tensorflow as tf

from estimator_towers.base import interception

# Ops whose next values no checkpoint holds, and what they are to a user.
_PYTHON_OPS = {
    'PyFunc': 'a Python function (tf.numpy_function / tf.compat.v1.py_func)',
    'PyFuncStateless': 'a Python function (tf.numpy_function)',
    'EagerPyFunc': 'a tf.py_function',
    'GeneratorDataset': 'a Python generator (Dataset.from_generator)',
}
# Stateful by registration, yet saved by tf.data (or holding no state).
_SAVED_STATEFUL = frozenset({'Assert', 'Print', 'PrintV2', 'StatefulPartitionedCall',
                             'PartitionedCall', 'If', 'While', 'StatelessIf',
                             'StatelessWhile', 'NoOp'})
# Attributes that name rather than define: generated per graph or process.
_NAMING_ATTRS = frozenset({'metadata', 'shared_name', 'container'})


class DatasetGraph:
  """The ops and functions of a dataset variant's graph, read once.

  Args:
    variant: the dataset's variant tensor (a MakeIterator's input).
  """

  def __init__(self, variant: tf.Tensor):
    graph_def = variant.graph.as_graph_def()
    self._nodes = {n.name: n for n in graph_def.node}
    self._functions = {f.signature.name: f for f in graph_def.library.function}
    self._root = variant.op.name
    self._node_prints: dict = {}
    self._function_prints: dict = {}
    self.reasons: list[str] = []

  def fingerprint(self) -> str:
    """A hex digest of the dataset (see the module docstring)."""
    return self._node(self._root)

  def _node(self, name: str) -> str:
    if name in self._node_prints:
      return self._node_prints[name]
    self._node_prints[name] = ''  # a cycle (none in a dataset graph) reads as empty
    node = self._nodes[name]
    if node.op in _PYTHON_OPS:
      self._note(f'{node.op} ({_PYTHON_OPS[node.op]})', None)
    inputs = []
    for given in node.input:
      control = given.startswith('^')
      source, _, index = given.lstrip('^').partition(':')
      inputs.append(('^' if control else '') + self._node(source) + ':' + (index or '0'))
    digest = _digest(node.op, self._attrs(node.attr), inputs)
    self._node_prints[name] = digest
    return digest

  def _attrs(self, attrs: Any) -> list:
    out = []
    for key in sorted(attrs):
      if key.startswith('_') or key in _NAMING_ATTRS:
        continue
      value = attrs[key]
      if value.HasField('func'):
        out.append((key, self._function(value.func.name), self._attrs(value.func.attr)))
      elif value.HasField('list') and value.list.func:
        out.append((key, [self._function(f.name) for f in value.list.func]))
      else:
        out.append((key, hashlib.sha256(value.SerializeToString(deterministic=True)).hexdigest()))
    return out

  def _function(self, name: str) -> str:
    if name in self._function_prints:
      return self._function_prints[name]
    self._function_prints[name] = ''
    function = self._functions.get(name)
    if function is None:  # a function TensorFlow registers itself
      self._function_prints[name] = name
      return name
    body = []
    for node in sorted(function.node_def, key=lambda n: n.name):
      if node.op in _PYTHON_OPS:
        self._note(f'{node.op} ({_PYTHON_OPS[node.op]})', name)
      elif (node.op not in _SAVED_STATEFUL and not node.op.endswith('Dataset')
            and interception.is_stateful(node.op)):
        self._note(f'{node.op} (a stateful op: its values depend on how often it ran, '
                   f'which no checkpoint holds)', name)
      called = self._function(node.op) if node.op in self._functions else node.op
      body.append((node.name, called, self._attrs(node.attr), list(node.input)))
    signature = function.signature
    digest = _digest(
        [(a.type, a.type_attr) for a in signature.input_arg],
        [(a.type, a.type_attr) for a in signature.output_arg],
        body, sorted(function.ret.items()))
    self._function_prints[name] = digest
    return digest

  def _note(self, what: str, function: str | None) -> None:
    # Not the function's name: TensorFlow generates it anew in every graph.
    where = ' in a function of the dataset (a map, filter or interleave)' if function else ''
    reason = f'{what}{where}'
    if reason not in self.reasons:
      self.reasons.append(reason)


def _digest(*parts: Any) -> str:
  return hashlib.sha256(repr(parts).encode()).hexdigest()


def unpositionable_warning(reasons: list[str]) -> str:
  """The one WARNING for an input whose position cannot be saved."""
  return (
      f'estimator_towers: the training input cannot be positioned: its dataset runs '
      f'{"; ".join(reasons[:3])}{" and more" if len(reasons) > 3 else ""}. A resumed '
      f'train() or a restarted job reads it again from its first element, so examples '
      f'before the checkpoint are seen twice. To resume it where it left off, build it '
      f'from tf.data ops only: files or tensors instead of a generator, tf ops instead '
      f'of Python functions, a seeded shuffle and tf.random.stateless_* ops instead of '
      f'stateful random ops.')
