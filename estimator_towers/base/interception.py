"""The few places where towering must reach into TensorFlow's private API.

Each exists because TensorFlow 2.15 offers no public hook for it; this module and
`control_flow` (the control flow and function graphs of ops already built) are the only ones
that import TensorFlow's private API, so that an upgrade has two files to check.

- Gradient requests. Every graph-mode gradient a model_fn can ask for goes through
  `gradients_util._GradientsHelper` (`tf.gradients`, `tf.compat.v1.gradients`,
  `Optimizer.compute_gradients` / `minimize`, Keras legacy `get_gradients`) or through
  `GradientTape.gradient` (Keras legacy `minimize`). To hand the model_fn the gradient of
  the whole batch, both are wrapped while a towered model_fn is built, and only then.
- A clean building context: the other towers are built in the middle of the primary's
  model_fn (at its gradient request), with its device stack and tape recording set aside.
- The control dependencies in force at a gradient request (`_control_dependencies_stack`):
  the whole-batch backward pass is built without them; they are put back on its gradients.
- Reads of a variable outside control flow (`Operation._control_flow_context`), summed
  where the placement says; a variable's device through a function body's captures.
- Batch statistics (`sync_batch_norm`). Every batch norm reaches TensorFlow through
  `gen_nn_ops.fused_batch_norm_v3` (Keras and `tf.compat.v1.layers` fused,
  `tf.compat.v1.nn.fused_batch_norm`) or `nn_impl.moments` (Keras non-fused,
  `tf.nn.moments`, `tf.compat.v1.nn.moments`); there is no public hook to replace batch
  statistics with global ones, so both are wrapped while the towers of a TRAIN graph are
  built with sync on, and only then.
- Keras batch-norm layers' moving-average updates (`BatchNormalizationBase.add_update`):
  not built in the towers after the first (they are dropped).
- Shape reads kept in the graph. `tf.shape`, `tf.size`, `tf.zeros_like` and `tf.ones_like`
  of a static shape fold to a constant (`array_ops`' `shape_internal`, `size_internal`,
  `array_like_impl`, `optimize=True`); while a tower is built they give their op instead
  (`optimize=False`), so that a head on the whole batch reads the whole batch's size
  (`rows`, `heads`). `tf.rank` (`rank_internal`) stays a constant, recorded as one.
- The loss reduction `tf.compat.v1.losses` and Keras record (`Graph._last_loss_reduction`):
  a summed loss (v1 canned heads) told from an averaged one.
- An input replaced on an op that already exists (`Operation._update_input`): a batch
  statistic of an early tower takes later towers' statistics.
- A control input added to an op that already exists (`Operation._add_control_inputs`):
  a micro-batch's input gates wait for a backward pass built later; `ordering` puts a
  variable's reads before its later updates (k-means); every writer of the global step
  waits for its read (`draws.step_order`, which reads `Graph._functions` too).
- The gradient of a `tf.function` call in a graph, kept on the Python op
  (`Operation._gradient_function`): `whole_batch_head`'s copy of an opaque function of the
  batch is differentiated as the original.
- A fresh variable store (`variable_scope`'s store and scope-name counters): a tower after
  the first asks for exactly the names tower 0 asked for (`sharing`). Variables' initializers
  (`_initializer_op`, `_initial_value`) kept as tower 0 set them (`init_from_checkpoint`).
- Random ops: every random draw a model_fn makes reaches TensorFlow through the generated
  `gen_*random_ops` and `gen_candidate_sampling_ops` functions; they are wrapped while a
  model_fn is built with keyed draws on (`draws.keyed`), and only then.
- Graph-mode blocks with no public TF2 counterpart: a model_fn's argument names as Estimator
  reads them (`fn_args`), the v1 all-reduce (`all_reduce`), prefetch buffers (`StagingArea`).
- An input's position in the checkpoint (`inputs.position`): `SaveableObject`, a deferred
  Saver's list (`Saver._var_list`), which op types are stateful (`op_def_registry`).
- Estimator's server start under `train_and_evaluate`
  (`_TrainingExecutor._start_std_server`), replaced so that a collective task's server
  names the chief as its group leader (`cluster.servers`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

import tensorflow as tf

from estimator_towers.base import shared_patch
from tensorflow.python.eager import backprop  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.eager import record  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.client import pywrap_tf_session as c_api  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import c_api_util  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import importer  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import op_def_registry  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.framework import random_seed  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import array_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import gen_candidate_sampling_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import gen_nn_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import gen_random_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import gen_stateful_random_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import gen_stateless_random_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import gen_stateless_random_ops_v2  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import gradients_util  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import collective_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import data_flow_ops  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import nn_impl  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import variable_scope  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.training.saving import saveable_object  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.util import function_utils  # pylint: disable=g-direct-tensorflow-import

# The original functions (the combined gradient is built with these).
graph_gradients = gradients_util._GradientsHelper  # pylint: disable=protected-access
tape_gradient = backprop.GradientTape.gradient

# Handlers receive (kind, call_original, args, kwargs) and return the result.
Handler = Callable[[str, Callable, tuple, dict], Any]


@contextlib.contextmanager
def gradient_requests(handler: Handler) -> Iterator[None]:
  """While active, every graph gradient request is passed to `handler(kind, original, args,
  kwargs)`: kind 'graph' for `_GradientsHelper(ys, xs, grad_ys, ...)`, 'tape' for
  `GradientTape.gradient(tape, target, sources, ...)`; `original` does TensorFlow's."""

  def graph_request(*args, **kwargs):
    with shape_reads_folded():
      return handler('graph', graph_gradients, args, kwargs)

  def tape_request(*args, **kwargs):
    with shape_reads_folded():
      return handler('tape', tape_gradient, args, kwargs)

  saved = (gradients_util._GradientsHelper, backprop.GradientTape.gradient)  # pylint: disable=protected-access
  gradients_util._GradientsHelper = graph_request  # pylint: disable=protected-access
  backprop.GradientTape.gradient = tape_request
  try:
    yield
  finally:
    gradients_util._GradientsHelper, backprop.GradientTape.gradient = saved  # pylint: disable=protected-access


@contextlib.contextmanager
def batch_norm_calls(fused: Callable, moments: Callable) -> Iterator[None]:
  """While active, batch-norm statistics are built by the given handlers.

  `fused(original, *args, **kwargs)` receives the calls of
  `gen_nn_ops.fused_batch_norm_v3` and `moments(original, *args, **kwargs)`
  those of `nn_impl.moments` (v1 signature; `tf.nn.moments` calls it);
  `original` does what TensorFlow would have done.
  """
  v1_nn = tf.compat.v1.nn
  saved = (gen_nn_ops.fused_batch_norm_v3, nn_impl.moments, v1_nn.moments)
  original_fused, original_moments = saved[0], saved[1]

  def fused_call(*args, **kwargs):
    return fused(original_fused, *args, **kwargs)

  def moments_call(*args, **kwargs):
    return moments(original_moments, *args, **kwargs)

  gen_nn_ops.fused_batch_norm_v3 = fused_call
  nn_impl.moments = v1_nn.moments = moments_call
  try:
    yield
  finally:
    gen_nn_ops.fused_batch_norm_v3, nn_impl.moments, v1_nn.moments = saved


_KERAS_BATCH_NORM = 'keras.src.layers.normalization.batch_normalization'


# Which threads skip batch-norm updates (depth of nesting); the Keras class patched.
_skipping = threading.local()
_skip_base: dict = {}


def _skipping_add_update(own: Callable | None) -> Callable:
  """Keras' `Layer.add_update`, which adds nothing in a thread that skips updates."""
  base = _skip_base['class']

  def add_update(layer, *args, **kwargs):
    if getattr(_skipping, 'depth', 0):
      return None  # its callables are not called
    if own is not None:
      return own(layer, *args, **kwargs)
    return super(base, layer).add_update(*args, **kwargs)
  return add_update


_skip_patch = shared_patch.SharedPatch(lambda: [(_skip_base['class'], 'add_update', lambda original:
                                     _skipping_add_update(vars(_skip_base['class']).get(
                                         'add_update')))], _skipping)


@contextlib.contextmanager
def batch_norm_updates_skipped() -> Iterator[None]:
  """While active, Keras batch-norm layers built in this thread build no moving-average updates.

  `add_update` of Keras' `BatchNormalizationBase` (Keras' and
  `tf.compat.v1.layers`' batch norms, fused or not) ignores its updates in
  this thread; other threads building batch norms meanwhile keep theirs
  (the patch is one, shared, and asks which thread calls). The layer's
  outputs are unchanged (renorm's corrections, which read updated values,
  are built outside `add_update`). Nothing happens when Keras' batch norm
  was never imported.
  """
  base = getattr(sys.modules.get(_KERAS_BATCH_NORM), 'BatchNormalizationBase', None)
  if base is None:
    yield
    return
  _skip_base.setdefault('class', base)
  with _skip_patch.held():
    yield


# The shape reads' patch: installed while any thread builds a tower, active in those threads.
_unfolding = threading.local()


def _unfolded(original: Callable, position: int) -> Callable:
  """`original` with its `optimize` argument (at `position`) False in a thread that unfolds."""

  def call(*args, **kwargs):
    if getattr(_unfolding, 'depth', 0):
      if len(args) > position:
        args = args[:position] + (False,) + args[position + 1:]
      else:
        kwargs['optimize'] = False
    return original(*args, **kwargs)
  return call


_folded_ranks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {op name}


def _rank_recorded(original: Callable) -> Callable:
  """`original` (`rank_internal`), its constant results recorded in a thread that unfolds."""

  def call(*args, **kwargs):
    result = original(*args, **kwargs)
    if getattr(_unfolding, 'depth', 0) and isinstance(result, tf.Tensor) and (
        not tf.executing_eagerly() and result.op.type == 'Const'):
      _folded_ranks.setdefault(result.graph, set()).add(result.op.name)
    return result
  return call


_unfold_patch = shared_patch.SharedPatch(lambda: [
    (array_ops, 'shape_internal', lambda f: _unfolded(f, 2)),
    (array_ops, 'size_internal', lambda f: _unfolded(f, 2)),
    (array_ops, 'array_like_impl', lambda f: _unfolded(f, 5)),
    (array_ops, 'rank_internal', _rank_recorded)], _unfolding)


def is_folded_rank(tensor: tf.Tensor) -> bool:
  """Whether `tensor` is a `tf.rank` folded into a constant while a tower was built."""
  return tensor.op.name in _folded_ranks.get(tensor.graph, ())


@contextlib.contextmanager
def shape_reads_kept() -> Iterator[None]:
  """While active, shape reads in this thread are ops of the graph, never constants.

  `tf.shape(x)`, `tf.size(x)`, `tf.zeros_like(x)`, `tf.ones_like(x)` (and
  TensorFlow's own calls of them) of an `x` with a static shape give the
  Shape, Size, ZerosLike or OnesLike op that they give for a shape known only
  at run time, instead of a constant holding the shape: the graph then
  says which values are the shard's size. `tf.rank` stays a constant (the
  rank does not depend on the batch), recorded as one (`is_folded_rank`).
  Other threads are unaffected.
  """
  with _unfold_patch.held():
    yield


@contextlib.contextmanager
def shape_reads_folded() -> Iterator[None]:
  """While active, shape reads in this thread fold as TensorFlow's do (`shape_reads_kept`
  set aside): the library's own ops (a gradient request's answer, the backward passes, the
  heads) are built as ever; a tower built meanwhile keeps its shape reads again."""
  depth = getattr(_unfolding, 'depth', 0)
  _unfolding.depth = 0
  try:
    yield
  finally:
    _unfolding.depth = depth


def device_stack(graph: tf.Graph) -> Any:
  """A copy of the graph's current device-function stack."""
  return graph._device_function_stack.copy()  # pylint: disable=protected-access


@contextlib.contextmanager
def clean_context(graph: tf.Graph, devices: Any) -> Iterator[None]:
  """The graph as it was outside any model_fn, with the device stack `devices`.

  Root name scope, no control dependencies, no control-flow context, no
  colocation, no gradient-tape recording, and the device functions that were
  active when the towers started (e.g. Estimator's replica_device_setter).
  """
  # colocate_with(None) empties the device stack, so the stack is set inside it.
  with graph.colocate_with(None, ignore_existing=True):
    saved = graph._device_function_stack  # pylint: disable=protected-access
    graph._device_function_stack = devices.copy()  # pylint: disable=protected-access
    try:
      with graph.name_scope(None), graph.control_dependencies(None), \
          record.stop_recording():
        yield
    finally:
      graph._device_function_stack = saved  # pylint: disable=protected-access


@contextlib.contextmanager
def control_dependencies_set_aside(graph: tf.Graph) -> Iterator[bool]:
  """The caller's `tf.control_dependencies` blocks are inactive meanwhile.

  Unlike `graph.control_dependencies(None)`, the control-flow context is
  kept. Yields whether any block had control inputs: the caller then
  re-attaches them to what it hands back (an op made after this context,
  from tensors made inside it, gets the blocks' control inputs).
  """
  saved = graph._control_dependencies_stack  # pylint: disable=protected-access
  graph._control_dependencies_stack = []  # pylint: disable=protected-access
  try:
    yield any(block.control_inputs for block in saved)
  finally:
    graph._control_dependencies_stack = saved  # pylint: disable=protected-access


def plain_reads(variable: tf.Variable) -> list[tf.Tensor]:
  """The values of `variable` read outside any control-flow construct."""
  return [op.outputs[0] for op in variable.op.outputs[0].consumers()   # a ref variable's: Identity
          if op.type in ('ReadVariableOp', 'Identity') and op._control_flow_context is None]  # pylint: disable=protected-access


def resource_device(tensor: tf.Tensor) -> str | None:
  """The device of the resource (a variable) a resource-typed tensor refers to.

  Followed back through the ops that pass a handle on (Identity, Switch, Enter)
  and through a function body's captures (a `tf.cond` or `tf.while_loop`
  branch), to the first op with a device. None if it cannot be told.
  """
  for _ in range(64):
    op = tensor.op
    if op.device:
      return op.device
    if op.type == 'Placeholder':
      captures = dict((id(internal), external) for external, internal in
                      getattr(op.graph, 'captures', ()))
      tensor = captures.get(id(tensor))
      if tensor is None:
        return None
    elif op.inputs:
      tensor = op.inputs[0]
    else:
      return None
  return None


def last_loss_reduction(graph: tf.Graph) -> Any:
  """The reduction of the last loss a TensorFlow loss function built, or None."""
  return getattr(graph, '_last_loss_reduction', None)


def reset_loss_reduction(graph: tf.Graph) -> None:
  graph._last_loss_reduction = None  # pylint: disable=protected-access


# The generated modules of random ops, by the short name `random_op_calls` hands its handler.
RANDOM_MODULES = {
    'random': gen_random_ops, 'stateless': gen_stateless_random_ops,
    'stateless_v2': gen_stateless_random_ops_v2, 'stateful': gen_stateful_random_ops,
    'candidate_sampling': gen_candidate_sampling_ops}
_random_handlers = threading.local()


def _random_call(module_name: str, name: str, original: Callable) -> Callable:
  def call(*args, **kwargs):
    stack = getattr(_random_handlers, 'stack', None)
    if not stack:
      return original(*args, **kwargs)
    saved = list(stack)   # the draws a handler makes itself are TensorFlow's
    stack.clear()
    try:
      return saved[-1](module_name, name, original, args, kwargs)
    finally:
      stack[:] = saved
  return call


def _seed_recorded(original: Callable) -> Callable:
  def get_seed(op_seed):
    _random_handlers.op_seed = op_seed   # None: the graph's op seed counter gives it
    return original(op_seed)
  return get_seed


def given_op_seed() -> Any:
  """The op seed the model_fn gave the random op being handled (None: none), read once.

  Every random op's Python function calls `random_seed.get_seed(op_seed)` just before.
  """
  seed, _random_handlers.op_seed = getattr(_random_handlers, 'op_seed', None), None
  return seed


_random_patch = shared_patch.SharedPatch(lambda: [
    (module, name, lambda f, m=module_name, n=name: _random_call(m, n, f))
    for module_name, module in RANDOM_MODULES.items() for name in dir(module)
    if name.islower() and not name.startswith('_') and callable(getattr(module, name))
    and name not in ('deprecated_endpoints', 'tf_export') and 'eager' not in name
] + [(random_seed, 'get_seed', _seed_recorded)])


@contextlib.contextmanager
def random_op_calls(handler: Callable) -> Iterator[None]:
  """While active, this thread's calls of the generated random-op functions go to `handler`.

  `handler(module, name, original, args, kwargs)`: `module` a key of
  `RANDOM_MODULES`, `name` the function's (`'random_uniform'`),
  `original(*args, **kwargs)` what TensorFlow would have done; the op seed
  the model_fn gave the op, if any, is `given_op_seed()`. Nested uses
  stack: the innermost handler of the thread is called, and while it runs,
  its own calls go to TensorFlow. Other threads are unaffected.
  """
  if not hasattr(_random_handlers, 'stack'):
    _random_handlers.stack = []
  with _random_patch.held():
    _random_handlers.stack.append(handler)
    try:
      yield
    finally:
      _random_handlers.stack.pop()


def op_seed_count(graph: tf.Graph) -> int:
  """How many op seeds the graph-level seed has given out in `graph` (the next op seed)."""
  return random_seed._graph_to_seed_dict.get(graph, 0)  # pylint: disable=protected-access


def import_ops(graph_def: Any, input_map: dict, names: list,
               colocated: dict | None = None) -> list:
  """`graph_def`'s ops imported under their own names, in the order of `names`.

  `tf.graph_util.import_graph_def` checks that every op an imported op is
  colocated with is imported too; a tower's copy of an op colocated with a
  variable (which is not copied) is not. With `colocated` ({op name: the ops
  it is colocated with}, for every such op), the import is what TensorFlow's
  does for a GraphDef whose devices are final (no functions, no device scope):
  an op keeps its NodeDef's device, a colocated op takes its group's first
  device, and no attribute is read again (half the import's cost per op).
  """
  if colocated is None:
    return importer._import_graph_def_internal(  # pylint: disable=protected-access
        graph_def, input_map=input_map, return_elements=names, name='',
        validate_colocation_constraints=False)
  graph = tf.compat.v1.get_default_graph()
  scoped = c_api_util.ScopedTFImportGraphDefOptions()
  importer._PopulateTFImportGraphDefOptions(  # pylint: disable=protected-access
      scoped.options, '', input_map, names, False)
  with graph._mutation_lock():  # pylint: disable=protected-access
    with c_api_util.tf_buffer(graph_def.SerializeToString()) as serialized:
      try:
        with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
          results = c_api.TF_GraphImportGraphDefWithResults(c_graph, serialized, scoped.options)
        results = c_api_util.ScopedTFImportGraphDefResults(results)
      except tf.errors.InvalidArgumentError as e:
        raise ValueError(str(e)) from e
    new_ops = graph._add_new_tf_operations(compute_devices=False)  # pylint: disable=protected-access
    for op in new_ops:
      for name in colocated.get(op.name, ()):
        try:
          target = graph._get_operation_by_name(name)  # pylint: disable=protected-access
        except KeyError:
          continue
        if target.device:
          op._set_device(target.device)  # pylint: disable=protected-access
          break
  return importer._GatherReturnElements(names, graph, results.results)  # pylint: disable=protected-access


def initializers(graph: tf.Graph) -> dict:
  """{variable: (its initializer op, its initial value)} (`_initializer_op`, `_initial_value`:
  what `init_from_checkpoint` sets), for `set_initializers` to put back."""
  variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) + \
      graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
  return {v: (v._initializer_op, v._initial_value) for v in variables  # pylint: disable=protected-access
          if hasattr(v, '_initializer_op')}


def set_initializers(saved: dict) -> None:
  for variable, (op, value) in saved.items():
    variable._initializer_op, variable._initial_value = op, value  # pylint: disable=protected-access


def hook_tensors(hook: Any) -> list:
  """The tensors (or names) a LoggingTensorHook logs or a NanTensorHook checks, given to it."""
  tensors = getattr(hook, '_tensors', None) or {}
  return list(tensors.values()) + [t for t in [getattr(hook, '_loss_tensor', None)] if t is not None]


def add_control_inputs(op: tf.Operation, controls: list[tf.Operation]) -> None:
  """Makes the existing `op` wait for `controls` (see the module docstring)."""
  op._add_control_inputs(controls)  # pylint: disable=protected-access


def replace_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
  """Makes `tensor` op's input `index` (`Operation._update_input`).

  Sync points of batch statistics (`sync_points`) join tensors of towers
  built one after another: the table a tower built earlier holds its own
  tensor in each later tower's slot until that tower builds its own.
  """
  op._update_input(index, tensor)  # pylint: disable=protected-access


def copy_gradient_function(source: tf.Operation, target: tf.Operation) -> None:
  """`target` (a copy of `source`) is differentiated as `source` is.

  A `tf.function` called in a graph is a call op whose gradient lives on the
  Python op (`Operation._gradient_function`), not in the registry: the
  whole-batch head's copy of the call needs it too.
  """
  function = getattr(source, '_gradient_function', None)
  if function is not None:
    target._gradient_function = function  # pylint: disable=protected-access


# Graph-mode building blocks TensorFlow 2.15 keeps private, used as they are.
fn_args = function_utils.fn_args            # a model_fn's / input_fn's argument names
all_reduce = collective_ops.all_reduce      # v1 all-reduce with group and instance keys
StagingArea = data_flow_ops.StagingArea     # a device's prefetch buffer
VariableScope = variable_scope.VariableScope
SaveableObject = saveable_object.SaveableObject  # what a Saver saves besides variables
SaveSpec = saveable_object.SaveSpec


def is_stateful(op_type: str) -> bool:
  """Whether TensorFlow registers `op_type` as stateful (also for ops in function bodies)."""
  return bool(getattr(op_def_registry.get(op_type), 'is_stateful', False))


def set_saver_var_list(saver: Any, var_list: list) -> None:  # before a deferred Saver's build
  saver._var_list = var_list  # pylint: disable=protected-access


def scaffold_with(base: Any, init_fn: Callable | None, local_init_op: Any) -> Any:
  """A copy of Scaffold `base`, its class kept, with init_fn(scaffold, session) and local init."""
  copied = copy.copy(base)
  copied._user_init_fn = init_fn  # pylint: disable=protected-access
  copied._init_fn = None if init_fn is None else (lambda session: init_fn(copied, session))  # pylint: disable=protected-access
  copied._local_init_op = local_init_op  # pylint: disable=protected-access
  return copied


@contextlib.contextmanager
def fresh_variable_store(scope: Any = None) -> Iterator[None]:
  """Inside, `get_variable` sees no variables and fresh scope-name counters, from `scope`
  (default: the current variable scope)."""
  scope_stores = tf.compat.v1.get_collection_ref(variable_scope._VARSCOPESTORE_KEY)  # pylint: disable=protected-access
  saved_scope_stores = list(scope_stores)
  fresh = variable_scope._VariableScopeStore()  # pylint: disable=protected-access
  fresh.current_scope = scope if scope is not None else variable_scope.get_variable_scope()
  scope_stores[:] = [fresh]
  try:
    with variable_scope.with_variable_store(variable_scope._VariableStore()):  # pylint: disable=protected-access
      yield
  finally:
    scope_stores[:] = saved_scope_stores


def training_executor() -> type:
  """Estimator's `_TrainingExecutor`, which starts a task's server in `train_and_evaluate`."""
  from tensorflow_estimator.python.estimator import training  # pylint: disable=g-import-not-at-top
  return training._TrainingExecutor  # pylint: disable=protected-access


def op_determinism_enabled() -> bool:
  """Whether `tf.config.experimental.enable_op_determinism()` was called (no public getter)."""
  from tensorflow.python.framework import config as framework_config  # pylint: disable=g-direct-tensorflow-import,import-outside-toplevel
  return bool(framework_config.is_op_determinism_enabled())
