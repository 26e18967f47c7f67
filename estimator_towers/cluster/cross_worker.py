"""The sync point across workers: sums of tensors over the training tasks of a cluster.

Rule: under `variable_strategy='collective'` with a TF_CONFIG cluster, the W
training tasks (the chief and the workers, `cluster.Cluster`) each build the
same TRAIN graph and meet at all-reduces (`interception.all_reduce`, merge
'Add', final 'Id', on each task's host CPU; TensorFlow runs them as a ring on
CPUs and NCCL between GPUs). A step's all-reduces are made in graph-construction
order and keyed by that order (one group key, instance keys counted per
graph), so every task pairs the same tensors. Tensors of one dtype are packed
into one buffer per all-reduce.

Within a step:

1. `live`: each task says whether its input gave a batch; the first
   all-reduce counts the tasks with data. A task whose input has ended gets
   one zero example of weight zero (its shards count 0 examples), so it still
   meets every all-reduce; when no task has data, the step ends with
   OutOfRangeError on every task before any other all-reduce or update runs
   (`gate`), which ends Estimator's training on all of them together.
2. `global_total(t)`: a statistic's total over the cluster, whose gradient
   flows to this task's `t` only: stop_gradient(sum) + (t - stop_gradient(t)),
   equal to the sum bit for bit on every task.
3. `sum(gradients)`: each task's part of the whole-batch gradient, summed
   (on the fixed shard grid, floats in its fixed order: `fixed_reduce`).
4. `gather(rows)` (`sync_batch_norm`): every task's rows of a statistics
   table, in rank order (an all-reduce of each task's rows in its own slot
   and zeros elsewhere: exact), so every task combines the same table; its
   gradient sums the tasks' gradients of the table before taking the task's
   own slot.
5. `share_updates` (UPDATE_OPS, e.g. batch-norm moving averages): after the
   step, every task takes the values the first task with data computed
   (an all-reduce of its values and zeros), as towers on one machine keep
   tower 0's: the moving averages follow the first shard of the global
   batch, or the global statistics with `sync_batch_norm`.

At session start (`broadcast_from_chief`, run by `session`'s
Scaffold) every task sets its variables to the chief's values (an
all-reduce of the chief's values and the others' zeros); what is not a
variable (the training input's position) comes as the chief's bytes
(`strings_from_chief`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Sequence

import tensorflow as tf

from estimator_towers.base import control_flow
from estimator_towers.base import fixed_sums
from estimator_towers.base import interception
from estimator_towers.base import shapes
from estimator_towers.base import updates
from estimator_towers.cluster import fixed_reduce
from estimator_towers.cluster import tf_config as cluster_lib

GROUP_KEY = 0x2400
FIXED_ORDER_GROUP_KEY = 0x2401  # the same tasks, for the fixed shard grid's sums
LOCAL_GROUP_KEY_BASE = 0x2500
_INSTANCE_KEY_BASE = 1 << 20
_next_key: 'weakref.WeakKeyDictionary[tf.Graph, int]' = weakref.WeakKeyDictionary()
_SUPPORTED = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def instance_key(graph: tf.Graph) -> int:
  """The next collective instance key of `graph` (the same sequence on every worker)."""
  key = _next_key.get(graph, _INSTANCE_KEY_BASE)
  _next_key[graph] = key + 1
  return key


def local_group_key() -> int:
  """The group key of the all-reduces between this task's devices (one per task)."""
  cluster = cluster_lib.parse()
  return LOCAL_GROUP_KEY_BASE + (cluster.rank if cluster is not None and cluster.trains else 0)


class CrossWorker:
  """The all-reduces of one TRAIN graph across the cluster's training tasks.

  Args:
    cluster: the cluster (this task trains in it).
    communication_hint: the collective's implementation ('ring' on CPUs,
      'nccl' between GPUs, 'auto').
  """

  def __init__(self, cluster: cluster_lib.Cluster, communication_hint: str = 'ring',
               timeout_secs: float = 120.0):
    self.cluster = cluster
    self.timeout_secs = timeout_secs
    self.has_data: tf.Tensor | None = None
    self.size = cluster.num_workers
    self.rank = cluster.rank
    self.device = cluster.device
    self.communication_hint = communication_hint
    self.graph = tf.compat.v1.get_default_graph()
    self.gate: tf.Tensor | None = None
    self.first_op = len(self.graph.get_operations())  # where this TRAIN graph's model_fn began
    self._timeout = 0  # the collective's own timeout: only at session start
    self.live_workers: tf.Tensor | None = None
    self.source: tf.Tensor | None = None  # this task is the first with data
    self._fixed = fixed_reduce.FixedReduce(
        self.size, self.rank, FIXED_ORDER_GROUP_KEY, lambda: instance_key(self.graph),
        self.device, lambda: self._timeout)

  def _sum_of(self, flat: tf.Tensor, gated: bool, exact: bool) -> tf.Tensor:
    """A step's sum of `flat` over the tasks: in the shard grid's fixed order for
    floats on the grid (`fixed_reduce`), else an all-reduce (integers, and one
    task's values with the others' zeros, are the same bits in any order)."""
    if (gated and not exact and flat.dtype.is_floating
        and fixed_sums.active(self.graph)):
      controls = [self.gate] if self.gate is not None else []
      with tf.control_dependencies(controls):
        return self._fixed(tf.identity(flat))
    return self._all_reduce(flat, gated)

  def _all_reduce(self, value: tf.Tensor, gated: bool) -> tf.Tensor:
    controls = [self.gate] if gated and self.gate is not None else []
    with tf.device(self.device), tf.control_dependencies(controls):
      return interception.all_reduce(
          tf.identity(value), self.size, GROUP_KEY, instance_key(self.graph), 'Add', 'Id',
          communication_hint=self.communication_hint,
          timeout=self._timeout)

  def sum(self, tensors: Sequence[Any], gated: bool = True, exact: bool = False) -> list:
    """Each tensor summed over the tasks (None stays None); one all-reduce per dtype.

    `exact`: each element is one task's value and the others' zeros (a table of
    the tasks' slots), which any order sums to the same bits."""
    dense = [None if t is None else tf.convert_to_tensor(t) for t in tensors]
    out: list = [None] * len(dense)
    by_dtype: dict = {}
    for i, t in enumerate(dense):
      if t is not None:
        by_dtype.setdefault(t.dtype.base_dtype, []).append(i)
    with tf.name_scope('across_workers'):
      for dtype, members in by_dtype.items():
        if dtype not in _SUPPORTED:
          raise ValueError(
              f'variable_strategy=\'collective\' across workers sums tensors of '
              f'dtypes {[d.name for d in _SUPPORTED]}, got {dtype.name} '
              f'({dense[members[0]].name}).')
        with tf.device(self.device):
          shapes = [tf.shape(dense[i]) for i in members]
          flat = tf.concat([tf.reshape(dense[i], [-1]) for i in members], 0)
        total = self._sum_of(flat, gated, exact)
        with tf.device(self.device):
          sizes = [tf.reduce_prod(s) for s in shapes]
          pieces = tf.split(total, tf.stack(sizes), num=len(members))
          for i, piece, shape in zip(members, pieces, shapes):
            out[i] = tf.reshape(piece, shape)
            out[i].set_shape(dense[i].shape)
    return out

  def rows_before(self, batch: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """(the cluster's batch, this task's first example's position in it), int64.

    The cluster's global batch is the tasks' batches in rank order.
    """
    with tf.name_scope('across_workers'), tf.device(self.device):
      mine = tf.one_hot(self.rank, self.size, dtype=tf.int64) * tf.cast(batch, tf.int64)
    (every,) = self.sum([mine])
    with tf.device(self.device):
      return tf.reduce_sum(every), tf.reduce_sum(every[:self.rank])

  def global_total(self, tensors: Sequence[tf.Tensor]) -> list:
    """The cluster's totals, differentiable to this task's own parts (see module doc)."""
    totals = self.sum(tensors)
    return [tf.stop_gradient(s) + (t - tf.stop_gradient(t)) for s, t in zip(totals, tensors)]

  def set_live(self, has_data: tf.Tensor) -> None:
    """The step's first all-reduce: which tasks have data; the gate after it.

    It also carries the chief's word that a checkpoint follows this step
    (`save_due_input`, fed by the chief's saver hook), as `save_due` on
    every task.
    """
    self.has_data = has_data
    with tf.name_scope('across_workers'):
      with tf.device(self.device):
        self.save_due_input = tf.compat.v1.placeholder_with_default(0.0, [], name='save_due')
        mine = tf.concat([tf.one_hot(self.rank, self.size) * tf.cast(has_data, tf.float32),
                          [self.save_due_input if self.rank == 0 else 0.0]], 0)
      live = self._all_reduce(mine, gated=False)
      with tf.device(self.device):
        self.save_due = live[self.size] > 0
        live = live[:self.size]
        self.live_workers = tf.reduce_sum(live)
        self.source = tf.logical_and(
            has_data, tf.equal(tf.argmax(live, output_type=tf.int32), self.rank))
        ended = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.range(0))
        self.gate = tf.cond(self.live_workers > 0, lambda: tf.constant(0, tf.int64),
                            ended.get_next, name='every_input_ended')

  def gather(self, table: tf.Tensor) -> tf.Tensor:
    """Every task's `table` (same shape on each), concatenated along axis 0 in rank order.

    Differentiable: the gradient with respect to this task's `table` is its
    slot of the tasks' summed gradients of the result.
    """
    @tf.custom_gradient
    def gathered(mine):
      with tf.device(self.device):
        slots = tf.scatter_nd([[self.rank]], mine[None],
                              tf.concat([[self.size], tf.shape(mine)], 0))
      (total,) = self.sum([slots], exact=True)
      with tf.device(self.device):
        result = tf.reshape(total, tf.concat([[-1], tf.shape(mine)[1:]], 0))

      def grad(upstream):
        (summed,) = self.sum([upstream])
        with tf.device(self.device):
          return tf.reshape(summed, tf.concat([[self.size], tf.shape(mine)], 0))[self.rank]
      return result, grad

    with tf.name_scope('gather'):
      out = gathered(table)
    if table.shape.rank is not None:
      rows = shapes.dim(table) * self.size if shapes.dim(table) is not None else None
      out.set_shape(tf.TensorShape([rows]).concatenate(table.shape[1:]))
    return out

  def broadcast_from_chief(self, variables: Sequence[tf.Variable]) -> tf.Operation:
    """An op setting every task's `variables` to the chief's values.

    Its all-reduces time out after `timeout_secs` (a worker that never
    starts): DeadlineExceededError at session start.
    """
    chosen = [v for v in variables if v.dtype.base_dtype in _SUPPORTED]
    with tf.name_scope('broadcast_from_chief'):
      values = []
      for v in chosen:
        with tf.device(self.device):
          value = tf.identity(v.read_value() if hasattr(v, 'read_value') else v)
          values.append(value if self.rank == 0 else tf.zeros_like(value))
      with self._at_session_start():
        chiefs = self.sum(values, gated=False)
      assigns = [v.assign(c, read_value=False) for v, c in zip(chosen, chiefs)]
      return tf.group(*assigns)

  def strings_from_chief(self, chief_strings: Callable[[], Sequence[tf.Tensor]], count: int
                         ) -> list[tf.Tensor]:
    """`count` scalar strings of the chief's, on every task (at session start).

    `chief_strings()` makes them, on the chief only; the other tasks send
    empty strings (`strings_of_every_task`).
    """
    with tf.name_scope('strings_from_chief'):
      if self.rank == 0:
        strings = list(chief_strings())
        if len(strings) != count:
          raise ValueError(f'strings_from_chief: {len(strings)} strings, not {count}.')
      else:
        strings = [tf.constant(b'') for _ in range(count)]
      return self.strings_of_every_task(strings)[0]

  def strings_of_every_task(self, strings: Sequence[tf.Tensor]) -> list[list[tf.Tensor]]:
    """Every task's scalar `strings` (as many on each), by rank: `[rank][i]`.

    An all-reduce sums numbers, not strings, so their bytes travel as
    numbers: first the lengths (each task's in its own row), then the bytes,
    each task's at its own offset and zeros elsewhere, packed eight to an
    int64 (a sum with zeros is exact). Back on each task, the bytes become a
    string again as the end of `serialize_tensor` of a uint8 vector, whose
    TensorProto ends with the vector's raw bytes (its last field,
    `tensor_content`). Its all-reduces time out after `timeout_secs` (they
    run outside the steps: at session start, or when a checkpoint is due).
    """
    word, count = 8, len(strings)
    with tf.name_scope('strings_of_every_task'), tf.device(self.device):
      strings = [tf.convert_to_tensor(s, tf.string) for s in strings]
      mine = tf.cast(tf.stack([tf.strings.length(s) for s in strings]), tf.int64)
      rows = tf.scatter_nd([[self.rank]], mine[None], [self.size, count])
    with self._at_session_start():
      (lengths,) = self.sum([rows], gated=False)
    with tf.device(self.device):
      total = tf.reduce_sum(lengths)
      words = total // word + 1  # 1 to 8 bytes of padding: never an empty all-reduce
      before = tf.reduce_sum(lengths[:self.rank])
      own = tf.io.decode_raw(tf.strings.join(strings), tf.uint8)
      placed = tf.pad(own, [[before, words * word - before - tf.reduce_sum(mine)]])
      packed = tf.bitcast(tf.reshape(placed, [-1, word]), tf.int64)
    with self._at_session_start():
      (packed,) = self.sum([packed], gated=False)
    with tf.device(self.device):
      raw = tf.reshape(tf.bitcast(packed, tf.uint8), [-1])[:total]
      proto = tf.io.serialize_tensor(raw)
      whole = tf.strings.substr(proto, tf.cast(tf.strings.length(proto), tf.int64) - total,
                                total)
      flat = tf.reshape(lengths, [-1])
      starts = tf.cumsum(flat, exclusive=True)
      return [[tf.strings.substr(whole, starts[r * count + i], flat[r * count + i])
               for i in range(count)] for r in range(self.size)]

  @contextlib.contextmanager
  def _at_session_start(self):
    """The all-reduces made meanwhile time out after `timeout_secs` (a task that never starts)."""
    saved, self._timeout = self._timeout, self.timeout_secs
    try:
      yield
    finally:
      self._timeout = saved


def gate_updates(across: CrossWorker, train_op: Any) -> None:
  """Every variable update the train_op runs waits for the step's gate.

  The step in which every task's input has ended fails at the gate; an update
  that does not depend on the gradients (a global_step incremented by hand)
  must not run before it. Only the ops this model_fn made that `train_op`
  runs are gated (not the variables' initializers).
  """
  made = {op.name for op in across.graph.get_operations()[across.first_op:]}
  start = train_op.op if isinstance(train_op, tf.Tensor) else train_op
  pending, seen = [start], set()
  while pending:
    op = pending.pop()
    if op.name in seen or op.name not in made:
      continue
    seen.add(op.name)
    if (updates.is_update(op) and not control_flow.in_control_flow(op)
        and across.gate.op not in op.control_inputs):
      interception.add_control_inputs(op, [across.gate.op])
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)


def share_updates(across: CrossWorker, update_ops: Sequence[tf.Operation], train_op: Any) -> Any:
  """`train_op`, then every task takes the first live task's values of what UPDATE_OPS write.

  On one machine the towers run the model_fn's UPDATE_OPS (batch-norm moving
  averages) for tower 0's shard only; across workers every task runs them for
  its own tower 0, and after the step every task sets the variables they
  write to the values of the first task whose input gave a batch (the chief's
  while it has data): the update of the global batch's first shard, and the
  copies stay bit-equal. With `sync_batch_norm` the tasks' values are already
  equal (global statistics); the exchange costs the moving averages' bytes.
  """
  written = _written_variables(across, update_ops)
  if not written:
    return train_op
  with tf.name_scope('share_updates'), tf.control_dependencies([train_op]):
    with tf.device(across.device):
      values = [tf.identity(v.read_value()) for v in written]
      chosen = [tf.where(across.source, value, tf.zeros_like(value)) for value in values]
    totals = across.sum(chosen, exact=True)
    with tf.device(across.device):
      assigns = [v.assign(t, read_value=False) for v, t in zip(written, totals)]
  return tf.group(train_op, *assigns, name='train_op_with_shared_updates')


def _written_variables(across: CrossWorker, update_ops: Sequence[tf.Operation]) -> list:
  """The global variables that `update_ops` (and the ops they wait for) assign, by name."""
  # A resource variable's op is its VarHandleOp, a ref variable's its VariableV2.
  by_handle = {v.op.name: v for v in tf.compat.v1.global_variables()}
  made = {op.name for op in across.graph.get_operations()[across.first_op:]}
  pending, seen, written = list(update_ops), set(), {}
  while pending:
    op = pending.pop()
    if op.name in seen or (op.name not in made and op not in update_ops):
      continue
    seen.add(op.name)
    if updates.is_update(op) and op.inputs:
      target = op.inputs[0].op
      while target.type == 'Identity' and target.inputs:
        target = target.inputs[0].op
      variable = by_handle.get(target.name)
      if variable is not None and variable.dtype.base_dtype in _SUPPORTED:
        written[variable.op.name] = variable
    pending.extend(t.op for t in op.inputs)
    pending.extend(op.control_inputs)
  return [written[name] for name in sorted(written)]


def live_inputs(features: Any, labels: Any, read: tuple | None = None
                ) -> tuple[Any, Any, tf.Tensor]:
  """features and labels read so that an ended input gives one zero example.

  Estimator's features and labels are the outputs of one `IteratorGetNext`
  of the input_fn's dataset; they are read instead with
  `IteratorGetNextAsOptional` from the same iterator, or given as `read`:
  (has_value, features, labels) already read (the positioned input).

  Returns:
    (features, labels, has_data): has_data is False once the input ended,
    and then every leaf holds one example of zeros.

  Raises:
    ValueError: if the inputs do not all come from one dataset iterator.
  """
  if read is not None:
    return _one_zero_example_unless(*read)
  leaves = [t for t in tf.nest.flatten((features, labels), expand_composites=True)
            if t is not None]  # absent labels: a features-only dataset
  ops = {t.op for t in leaves if isinstance(t, tf.Tensor)}
  op = next(iter(ops)) if len(ops) == 1 else None
  if op is None or op.type != 'IteratorGetNext' or len(leaves) != len(op.outputs) or any(
      not isinstance(t, tf.Tensor) for t in leaves):
    raise ValueError(
        'variable_strategy=\'collective\' across workers needs the input_fn to '
        'return a tf.data.Dataset of dense Tensors (features, labels), read by '
        'Estimator: when one worker\'s input ends before the others\', it '
        'keeps meeting their all-reduces with empty batches, which it can only '
        f'do by reading the dataset itself. Got inputs made by {sorted(o.type for o in ops)}.')
  types = op.get_attr('output_types')
  shapes = [tf.TensorShape(s) for s in op.get_attr('output_shapes')]
  with tf.name_scope('live_inputs'), tf.device(op.device):
    optional = tf.raw_ops.IteratorGetNextAsOptional(
        iterator=op.inputs[0], output_types=types, output_shapes=shapes)
    has_data = tf.raw_ops.OptionalHasValue(optional=optional)

    def present():
      return tf.raw_ops.OptionalGetValue(optional=optional, output_types=types,
                                         output_shapes=shapes)

    def absent():
      return [tf.zeros([1] + [d if d is not None else 1 for d in s.as_list()[1:]], dtype)
              for s, dtype in zip(shapes, types)]

    values = tf.cond(has_data, present, absent)
  by_output = {}
  for value, output, shape in zip(values, op.outputs, shapes):
    value.set_shape(tf.TensorShape([None]).concatenate(shape[1:]))
    by_output[output.ref()] = value
  structure = (features, labels)
  replaced = tf.nest.map_structure(lambda t: None if t is None else by_output[t.ref()],
                                   structure, expand_composites=True)
  return replaced[0], replaced[1], has_data


def for_train_graph(config: Any, variable_strategy: str, timeout_secs: float,
                    staged: bool) -> CrossWorker | None:
  """The all-reduces across workers of a TRAIN graph under a collective cluster, or None.

  Args:
    config: the RunConfig Estimator passed the model_fn (its cluster).
    variable_strategy: the plan's variable strategy.
    timeout_secs: how long a step waits for the other workers.
    staged: whether the features came from `staged_input_fn`.

  Raises:
    ValueError: for a TF_CONFIG cluster the strategy cannot train on
      (`tf_config.check`), or what the collective strategy does not support
      across workers.
  """
  cluster = cluster_lib.from_run_config(config)
  if cluster is None or not cluster.trains:
    return None
  cluster_lib.check(cluster, variable_strategy)
  if variable_strategy != 'collective' or cluster.num_workers < 2:
    return None
  if staged:
    raise ValueError(
        f'variable_strategy=\'collective\' across {cluster.num_workers} workers '
        f'does not support staged_input_fn (read the dataset in the input_fn '
        f'instead): it would not give the single-device update. '
        f'Train without it, or on one machine.')
  return CrossWorker(cluster, timeout_secs=timeout_secs)


def _one_zero_example_unless(has_data: tf.Tensor, features: Any, labels: Any
                             ) -> tuple[Any, Any, tf.Tensor]:
  """(features, labels, has_data), every dense leaf one example of zeros without data."""
  structure = (features, labels)
  leaves = [t for t in tf.nest.flatten(structure) if t is not None]
  if any(not isinstance(t, tf.Tensor) for t in leaves):
    raise ValueError(
        'variable_strategy=\'collective\' across workers needs the input_fn to '
        'return a tf.data.Dataset of dense Tensors (features, labels): when one '
        'worker\'s input ends before the others\', it keeps meeting their '
        'all-reduces with one zero example of weight zero.')
  with tf.name_scope('live_inputs'):
    values = tf.cond(has_data, lambda: [tf.identity(t) for t in leaves],
                     lambda: [tf.zeros([1] + [d if d is not None else 1
                                              for d in t.shape.as_list()[1:]], t.dtype)
                              for t in leaves])
  for value, leaf in zip(values, leaves):
    value.set_shape(tf.TensorShape([None]).concatenate(leaf.shape[1:]))
  replaced = iter(values)
  out = tf.nest.map_structure(lambda t: None if t is None else next(replaced), structure)
  return out[0], out[1], has_data
