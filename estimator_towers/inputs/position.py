"""The training input's position, saved in every checkpoint with the variables.

Rule: in TRAIN the library reads the input_fn's dataset through its own
iterator (`Source`), whose position is part of the checkpoint: the same Saver
that writes the variables (`PositionSaver`, Estimator's own settings) writes
tf.data's state of that iterator (its cursors, shuffle buffers and seeds) and
the global batches the iterator had already handed out that no step consumed
(staged on devices by `staged_input_fn`), as serialized tensors. A checkpoint's
weights and its input position therefore always belong together. Restoring
sets the iterator to the saved state (no batch is read again, so resuming costs
the same at any step) and queues the saved batches: the next steps read them
first, then the iterator. A resumed run sees the global batches an
uninterrupted one sees, in the same order.

The position counts global batches: devices, micro-batches and staging depth
split a global batch after it is read, so a run resumes on any of them. When
each worker of a cluster reads its own part of the data, there is one position
per worker (`worker_positions`), tied to their number; `global_batches` is how
workers read one sequence, which resumes on any number of them.

When a session starts, exactly one of three sets the position: the Saver's
restore (a checkpoint with a position), the Scaffold's init_fn (no
checkpoint: the first element) or, for a task that restores nothing (a
worker), the input's hook. Across the workers of a collective cluster the
chief's position of global batches is every worker's: each worker takes the
chief's (restored or initialized) in its local init (`broadcast_from_chief`). With parameter
servers only the chief's input is positioned; a worker's restarts (one
warning). A checkpoint without a position (written with
`resume_input=False` or before it existed) or of another dataset restores the
variables alone, with one warning, and the input starts from its first
element.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.inputs import global_batches
from estimator_towers.inputs import positionable

# The checkpoint keys, under one name: <NAME>/iterator, /pending, /ended, /fingerprint.
NAME = 'input_position'
# `Source.restorable`'s answer for a dataset read to its end: read it again.
ENDED = 'the dataset was read to its end'
NO_POSITION = ('it holds no input position (written with resume_input=False, by a model_fn '
               'without replicate_model_fn, or by an earlier version)')


def other_workers(saved: int) -> str:
  """Why a checkpoint of `saved` workers' own positions does not resume this training."""
  return (f'it holds the positions of {saved} workers, each reading its own part of the '
          f'data, which resume on {saved} such workers only (the position of '
          f'estimator_towers.global_batches resumes on any number)')


class Source:
  """The training input: the library's own iterator of a dataset, and a replay.

  Args:
    variant: the dataset's variant tensor (what the input_fn's iterator was
      made from).
    element_spec: the structure of an element: (features, labels) or
      features alone.
    fingerprint: the dataset's fingerprint (`positionable`).
    device: the input pipeline's device.
    with_labels: whether an element is (features, labels).
    saved: whether checkpoints save its position (else it only reads).
    replays: whether saved batches may have to be read before the iterator
      (staging writes them; a plain read skips that test when the latest
      checkpoint has none).
  """

  def __init__(self, variant: tf.Tensor, element_spec: Any, fingerprint: str, device: str,
               with_labels: bool, saved: bool = True, replays: bool = True):
    self.element_spec = element_spec
    self.replays = replays
    self.saved = saved
    self.with_labels = with_labels
    self.is_global = global_batches.is_global(variant)
    self.specs = tf.nest.flatten(element_spec, expand_composites=True)
    self.fingerprint = fingerprint
    self.device = device
    self._ready: 'weakref.WeakSet' = weakref.WeakSet()  # sessions whose position is set
    self.from_chief = False  # a worker's local init sets it to the chief's
    self.pending_in_flight: Callable[[], tf.Tensor] | None = None  # set by staging
    with tf.name_scope(NAME), tf.device(device):
      dataset = tf.data.experimental.from_variant(variant, element_spec)
      self.iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
      self.resource = self.iterator.initializer.inputs[1]  # MakeIterator(dataset, iterator)
      # Saved global batches still to be read: one row of serialized components each.
      self.replay = tf.compat.v1.Variable(
          tf.zeros([0, len(self.specs)], tf.string), trainable=False, collections=[],
          shape=tf.TensorShape([None, len(self.specs)]), use_resource=True, name='replay')
      self.replayed = tf.compat.v1.Variable(
          tf.constant(0, tf.int64), trainable=False, collections=[], use_resource=True,
          name='replayed')
      # Whether the dataset was read to its end (then the next train() reads it again).
      self.ended = tf.compat.v1.Variable(False, trainable=False, collections=[],
                                         use_resource=True, name='ended')
      self.initializer = tf.group(
          self.iterator.initializer,
          self.replay_from(tf.zeros([0, len(self.specs)], tf.string), tf.constant(False)),
          name='initialize')

  # Reading.

  def replay_from(self, pending: tf.Tensor, ended: Any = False) -> tf.Operation:
    """An op that queues `pending` ([n, components] serialized) to be read first."""
    return tf.group(self.replay.assign(pending, read_value=False),
                    self.replayed.assign(0, read_value=False),
                    self.ended.assign(ended, read_value=False))

  def _at_the_end(self, raise_end: bool) -> list:
    """The iterator's end: remembered, then OutOfRangeError (or zeros, no value)."""
    remember = self.ended.assign(True, read_value=False)
    signal = []
    if raise_end:
      with tf.control_dependencies([remember]):  # an ended iterator ends again: OutOfRangeError
        signal = tf.nest.flatten(self.iterator.get_next(), expand_composites=True)[:1]
    with tf.control_dependencies([remember] + signal):
      return [tf.zeros([d if d is not None else 0 for d in s.shape.as_list()], s.dtype)
              for s in self.specs]

  def _replaying(self) -> tf.Tensor:
    return self.replayed.read_value() < tf.cast(tf.shape(self.replay)[0], tf.int64)

  def _next_replayed(self) -> list:
    row = tf.gather(self.replay, self.replayed.read_value())
    with tf.control_dependencies([row]):
      advance = self.replayed.assign_add(1, read_value=False)
    with tf.control_dependencies([advance]):
      flat = []
      for i, spec in enumerate(self.specs):
        value = tf.io.parse_tensor(row[i], spec.dtype)
        value.set_shape(spec.shape)
        flat.append(value)
      return flat

  def get_next(self) -> Any:
    """The next element (saved batches first); OutOfRangeError at the end."""
    with tf.name_scope(NAME), tf.device(self.device):
      def from_iterator():
        optional = self.iterator.get_next_as_optional()
        return tf.cond(optional.has_value(),
                       lambda: tf.nest.flatten(optional.get_value(), expand_composites=True),
                       lambda: self._at_the_end(raise_end=True))

      flat = (tf.cond(self._replaying(), self._next_replayed, from_iterator, name='next')
              if self.replays else from_iterator())
      return self._pack(flat)

  def get_next_as_optional(self) -> tuple[tf.Tensor, Any]:
    """(has_value, element): the next element, or zeros once the input ended."""
    def from_iterator():
      optional = self.iterator.get_next_as_optional()
      return tf.cond(
          optional.has_value(),
          lambda: [tf.constant(True)] + tf.nest.flatten(optional.get_value(),
                                                        expand_composites=True),
          lambda: [tf.constant(False)] + self._at_the_end(raise_end=False))

    with tf.name_scope(NAME), tf.device(self.device):
      out = (tf.cond(self._replaying(), lambda: [tf.constant(True)] + self._next_replayed(),
                     from_iterator, name='next_as_optional')
             if self.replays else from_iterator())
      return out[0], self._pack(out[1:])

  def next_for_worker(self, rank: int, count: int) -> tuple[tf.Tensor, Any, Any]:
    """(has_value, features, labels) of worker `rank` of `count`: its rows of a global batch.

    A dataset read through `global_batches` gives every worker the same
    global batch, of which it takes its rows (`global_batches.worker_rows`);
    a worker whose share of the last batch is empty has no value.
    """
    has_value, element = self.get_next_as_optional()
    if self.is_global:
      with tf.name_scope(NAME), tf.device(self.device):
        element = global_batches.worker_rows(element, rank, count)
        rows = tf.shape(tf.nest.flatten(element)[0])[0]
        has_value = tf.logical_and(has_value, rows > 0)
    if self.with_labels:
      return has_value, element[0], element[1]
    return has_value, element, None

  def _pack(self, flat: list) -> Any:
    for value, spec in zip(flat, self.specs):
      value.set_shape(spec.shape)
    return tf.nest.pack_sequence_as(self.element_spec, flat, expand_composites=True)

  # The checkpoint.

  def state(self) -> tf.Tensor:
    """tf.data's state of the iterator, serialized to bytes (a scalar string)."""
    with tf.device(self.device):
      # Bytes rather than a variant, so that every key reads with numpy
      # (`Estimator.get_variable_value`, checkpoint tools).
      return tf.io.serialize_tensor(tf.raw_ops.SerializeIterator(
          resource_handle=self.resource, external_state_policy=2))  # 2: FAIL on external state

  def set_state(self, state: tf.Tensor, pending: tf.Tensor, ended: Any = False) -> tf.Operation:
    """An op setting the position: `state` (from `state()`), `pending` batches, `ended`."""
    with tf.device(self.device):
      with tf.control_dependencies([self.iterator.initializer]):
        deserialize = tf.raw_ops.DeserializeIterator(
            resource_handle=self.resource, serialized=tf.io.parse_tensor(state, tf.variant))
      return tf.group(deserialize, self.replay_from(pending, ended))

  def pending(self) -> tf.Tensor:
    """The global batches handed out but not consumed: [n, components] strings."""
    with tf.device(self.device):
      rest = self.replay[self.replayed.read_value():]
      if self.pending_in_flight is None:
        return rest
      return tf.concat([self.pending_in_flight(), rest], 0)

  def saveable(self) -> 'PositionSaveable':
    with tf.name_scope(NAME):
      return PositionSaveable(self)

  def restorable(self, save_path: str) -> str | None:
    """None if the checkpoint at `save_path` holds this dataset's position, else why not."""
    reader = tf.train.load_checkpoint(save_path)
    if reader.has_tensor(f'{NAME}/ranks'):
      return other_workers(len(reader.get_tensor(f'{NAME}/ranks')))
    if not reader.has_tensor(f'{NAME}/iterator'):
      return NO_POSITION
    saved = reader.get_tensor(f'{NAME}/fingerprint')
    saved = saved.decode() if isinstance(saved, bytes) else str(saved)
    if saved != self.fingerprint:
      return ('the input_fn\'s dataset is not the one the checkpoint was written with '
              '(another batch size, other files, other ops), and tf.data would go on '
              'with the old one')
    pending_rows = reader.get_variable_to_shape_map()[f'{NAME}/pending'][0]
    if pending_rows and not self.replays:
      return ('it holds batches staged on devices, written after this graph was built '
              'without a replay of them')
    if reader.get_tensor(f'{NAME}/ended') and not pending_rows:
      return ENDED
    return None

  def describe(self, save_path: str) -> tuple[int | None, str]:
    """(the step of the position at `save_path`, where the input reads on), for the log."""
    reader = tf.train.load_checkpoint(save_path)
    step = checkpoint_step(reader)
    pending = reader.get_variable_to_shape_map()[f'{NAME}/pending'][0]
    first = f', its {pending} staged global batch(es) first' if pending else ''
    return step, f'the input reads on after the global batch of step {step}{first}'

  # Sessions.

  def mark_ready(self, session: Any) -> None:
    self._ready.add(session)

  def initialize(self, session: Any) -> None:
    """Sets the position to the dataset's first element."""
    session.run(self.initializer)
    self._ready.add(session)

  def ensure(self, session: Any) -> None:
    """Sets the position to the first element unless a restore, an init or the chief did."""
    if session not in self._ready and not self.from_chief:
      self.initialize(session)

  # Workers.

  def broadcast_from_chief(self, across: Any) -> tf.Operation:
    """An op setting every training task's position to the chief's (in the local init).

    The chief sends its iterator's state and its pending batches (restored
    or initialized before the local init runs); every other task initializes
    its iterator, then takes them, so that its session start sets nothing
    more (`from_chief`). Every task builds the same all-reduces, in the
    same order.

    Args:
      across: the cluster's all-reduces (`cluster.cross_worker.CrossWorker`:
        its `rank` and `strings_from_chief`).
    """
    def chiefs():
      with tf.device(self.device):
        return [self.state(), tf.io.serialize_tensor(self.pending())]

    with tf.name_scope(NAME):
      state, pending = across.strings_from_chief(chiefs, 2)
      if across.rank == 0:
        return tf.group(state, pending, name='to_workers')
      self.from_chief = True
      with tf.device(self.device):
        pending = tf.io.parse_tensor(pending, tf.string)
        pending.set_shape([None, len(self.specs)])
      return self.set_state(state, pending)


class PositionSaveable(interception.SaveableObject):
  """The position as a Saver saves it: tf.data's state, the pending batches, the fingerprint."""

  def __init__(self, source: Source):
    self._source = source
    resource = source.resource
    state = source.state()
    with tf.device(source.device):
      pending = source.pending()
      fingerprint = tf.constant(source.fingerprint)
      ended = source.ended.read_value()
    specs = [interception.SaveSpec(ended, '', f'{NAME}/ended', device=source.device),
             interception.SaveSpec(state, '', f'{NAME}/iterator', device=source.device),
             interception.SaveSpec(pending, '', f'{NAME}/pending', device=source.device),
             interception.SaveSpec(fingerprint, '', f'{NAME}/fingerprint',
                                   device=source.device)]
    super().__init__(resource, specs, NAME)

  def restore(self, restored_tensors, restored_shapes):
    del restored_shapes
    ended, state, pending, _ = restored_tensors
    return self._source.set_state(state, pending, ended)


class PositionSaver(tf.compat.v1.train.Saver):
  """Estimator's Saver with the input's position, and a fallback without it.

  Args:
    position: what is saved: a `Source`, or every worker's position
      (`worker_positions.WorkerPositions`); its `saveable()`,
      `restorable(path)`, `initialize(session)` and `mark_ready(session)`.
    config: the RunConfig (how many checkpoints to keep).
  """

  def __init__(self, position: Any, config: Any):
    model_dir = getattr(config, 'model_dir', None)
    latest = tf.train.latest_checkpoint(model_dir) if model_dir else None
    # Only a checkpoint without this dataset's position needs a Saver of the variables alone.
    self._needs_fallback = latest is not None and position.restorable(latest) not in (None, ENDED)
    kwargs = dict(sharded=True, save_relative_paths=True,
                  max_to_keep=getattr(config, 'keep_checkpoint_max', 5),
                  keep_checkpoint_every_n_hours=getattr(
                      config, 'keep_checkpoint_every_n_hours', 10000.0))
    super().__init__(defer_build=True, **kwargs)
    self._position = position
    self._kwargs = kwargs
    self._without_position = None

  def build(self):
    if self._without_position is None:
      others = tf.compat.v1.global_variables() + tf.compat.v1.get_collection(
          tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS)
      interception.set_saver_var_list(self, others + [self._position.saveable()])
      self._without_position = (tf.compat.v1.train.Saver(var_list=others, **self._kwargs)
                                if self._needs_fallback else False)
    super().build()

  def restore(self, sess, save_path):
    reason = self._position.restorable(save_path) if save_path else 'no checkpoint'
    if reason is None:
      super().restore(sess, save_path)
      self._position.mark_ready(sess)
      logs.info('%s', resumed(save_path, self._position))
      return
    if reason == ENDED:  # an epoch loop: each train() call reads the dataset once
      logs.info('estimator_towers: %s: the previous train() read the dataset to its end, '
                   'so this one reads it again from its first element.', save_path)
      super().restore(sess, save_path)
    elif not self._without_position:
      raise RuntimeError(
          f'estimator_towers: {save_path} appeared after this training graph was built, and '
          f'it cannot restore the input position: {reason}. Run train() again: its graph '
          f'then restores the variables alone, and the input starts from its first element.')
    else:
      logs.warning('estimator_towers: restoring %s without the input position: %s. The '
                      'input starts from its first element.', save_path, reason)
      self._without_position.restore(sess, save_path)
    self._position.initialize(sess)


def checkpoint_step(reader: Any) -> int | None:
  """The global step a checkpoint was written at (None if it has no `global_step`)."""
  return int(reader.get_tensor('global_step')) if reader.has_tensor('global_step') else None


def resumed(save_path: str, position: Any) -> str:
  """What a session that restored `save_path` with its input position resumes, in one line."""
  step, where = position.describe(save_path)
  ckpt_step = checkpoint_step(tf.train.load_checkpoint(save_path))
  return (f'estimator_towers: resumed training from {save_path} (global step {ckpt_step}) '
          f'with the input position of step {step}: {where}.')


def own(features: Any, labels: Any, replace: bool, across: bool, resume: bool,
        model_dir: str | None = None) -> tuple[Any, Any, Source | None]:
  """The training input read through a `Source`, or unchanged with one warning why not.

  Args:
    features: the features Estimator passed (outputs of an input_fn's
      iterator, or of `staged_input_fn`'s).
    labels: the labels (None for a features-only dataset).
    replace: whether to return the Source's next element in their place
      (False: staging or the workers' live inputs read the Source itself).
    across: whether several workers train: each takes its rows of a dataset
      of `global_batches`, and any other dataset is each worker's own part
      of the data (one position per worker, `worker_positions`).
    resume: `resume_input`. Without it, a Source is still made, unsaved, for
      global batches across workers, whose rows it gives each worker.
    model_dir: where the checkpoint to resume is (a plain read replays saved
      batches only when its latest checkpoint holds some).

  Returns:
    (features, labels, source): source None when the input is read as
    Estimator gives it; `source.saved` False when it is not checkpointed.
  """
  get_next = _get_next_op(features, labels)
  if get_next is None:
    if resume and _varies(features, labels):  # else the same batch at every step
      _unpositioned('the input_fn returns tensors, not a tf.data.Dataset')
    return features, labels, None
  makers = [op for op in get_next.inputs[0].consumers() if op.type == 'MakeIterator']
  if len(makers) != 1:
    if resume:
      _unpositioned(f'its iterator ({get_next.inputs[0].op.type}) was not made by Estimator '
                    f'from a tf.data.Dataset (a hand-made or one-shot iterator)')
    return features, labels, None
  variant = makers[0].inputs[0]
  is_global = global_batches.is_global(variant)
  if across and not is_global and not resume:
    return features, labels, None
  dataset_graph = positionable.DatasetGraph(variant)
  fingerprint = dataset_graph.fingerprint()
  saved = resume and not dataset_graph.reasons
  if resume and dataset_graph.reasons:
    logs.warning_once(positionable.unpositionable_warning(dataset_graph.reasons))
  if not saved and not (across and is_global):
    return features, labels, None
  structure = (features, labels) if labels is not None else features
  element_spec = tf.nest.map_structure(tf.type_spec_from_value, structure)
  source = Source(variant, element_spec, fingerprint, makers[0].device or '/cpu:0',
                  with_labels=labels is not None, saved=saved,
                  replays=not replace or _pending_in(model_dir))
  if not replace:
    return features, labels, source
  with tf.device(source.device):  # Estimator's iterator then reads nothing at all.
    empty = tf.data.experimental.from_variant(variant, element_spec).take(0)
  interception.replace_input(makers[0], 0, tf.data.experimental.to_variant(empty))
  element = source.get_next()
  return ((element[0], element[1]) if labels is not None else (element, None)) + (source,)


def _pending_in(model_dir: str | None) -> bool:
  """Whether the latest checkpoint in `model_dir` holds staged batches to replay."""
  checkpoint = tf.train.latest_checkpoint(model_dir) if model_dir else None
  if checkpoint is None:
    return False
  shapes = tf.train.load_checkpoint(checkpoint).get_variable_to_shape_map()
  return bool(shapes.get(f'{NAME}/pending', [0])[0])


def _get_next_op(features: Any, labels: Any) -> tf.Operation | None:
  """The one IteratorGetNext whose whole element the inputs are, else None.

  A dense leaf must be one of its outputs itself (not computed from one); a
  sparse or ragged leaf is decoded from one of them.
  """
  found, used = set(), set()
  for leaf in tf.nest.flatten((features, labels)):
    if leaf is None:
      continue
    if isinstance(leaf, tf.Tensor):
      found.add(leaf.op)
      used.add(leaf.name)
      continue
    for component in tf.nest.flatten(leaf, expand_composites=True):
      op, hops = component.op, 0
      while op.type != 'IteratorGetNext' and op.inputs and hops < 4:
        op, hops = op.inputs[0].op, hops + 1
      found.add(op)
      used.update(t.name for t in op.outputs)  # decoded: not counted output by output
  if len(found) != 1:
    return None
  op = next(iter(found))
  if op.type != 'IteratorGetNext' or used != {t.name for t in op.outputs}:
    return None
  return op


def _varies(features: Any, labels: Any) -> bool:
  """Whether the inputs can change from step to step (a stateful op or a placeholder above)."""
  pending = [t.op for t in tf.nest.flatten((features, labels), expand_composites=True)
             if isinstance(t, tf.Tensor)]
  seen = set()
  while pending:
    op = pending.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    if op.type == 'Placeholder' or op.op_def.is_stateful:
      return True
    pending.extend(t.op for t in op.inputs)
  return False


def _unpositioned(why: str) -> None:
  logs.warning_once(
      f'estimator_towers: the training input cannot be positioned: {why}. A resumed '
      f'train() or a restarted job reads it again from its first element. Return a '
      f'tf.data.Dataset from the input_fn to resume it where it left off.')
