"""Each worker's own input position, gathered into the chief's checkpoint.

Rule: across the W workers of a collective cluster, an input_fn that reads
each worker's own part of the data (`dataset.shard(count, index)` with
`worker_index_and_count()`) has W positions, one per worker, and a checkpoint
holds all W, taken after the same step as its variables. The chief decides
before a step whether a checkpoint follows it (`SaverHook`: Estimator's
CheckpointSaverHook, same settings, deciding one step ahead) and says so in
the step's first all-reduce (`CrossWorker.set_live`). After such a step every
task serializes its iterator's state and one all-reduce of bytes brings all W
to the chief (`GatherHook` on the workers, `SaverHook` on the chief), which
keeps them in a variable that its Saver writes with the variables
(`input_position/ranks`, and the step they were taken at). At the end of
training every task gathers once more, for the last checkpoint.

At session start the chief restores them, and each task takes its own from
the chief in the local init; an empty one (nothing restored) or one of another
dataset (its fingerprint; one warning) starts from the first element. The
positions are tied to the number of workers: a checkpoint of another number
restores the variables alone (one warning), and each worker's input starts
from its first element; `global_batches` resumes on any number.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from estimator_towers.base import logs
from estimator_towers.base import interception
from estimator_towers.inputs import position as position_lib

NAME = position_lib.NAME
# What a task's local init did with its slot of the chief's positions.
FIRST_ELEMENT, TAKEN, OTHER_DATASET = 0, 1, 2


class WorkerPositions:
  """The W workers' positions of a per-worker input (the interface of `Source`'s checkpoint).

  Args:
    source: this task's positioned input (its own part of the data).
    across: the cluster's all-reduces (`cluster.cross_worker.CrossWorker`),
      after `set_live`.
  """

  def __init__(self, source: position_lib.Source, across: Any):
    self.source = source
    self.across = across
    self.size = across.size
    with tf.name_scope(NAME), tf.device(across.device):
      empty = tf.constant([b''] * self.size)
      # The positions of every task, as the last gather or the restore left them.
      self.ranks = tf.compat.v1.Variable(empty, trainable=False, collections=[],
                                         use_resource=True, name='ranks')
      self.step = tf.compat.v1.Variable(tf.constant(-1, tf.int64), trainable=False,
                                        collections=[], use_resource=True, name='step')
      self.taken = tf.compat.v1.Variable(FIRST_ELEMENT, trainable=False, collections=[],
                                         use_resource=True, name='taken')
      self.initializer = tf.group(source.initializer,
                                  self.ranks.assign(empty, read_value=False),
                                  self.step.assign(-1, read_value=False),
                                  self.taken.assign(FIRST_ELEMENT, read_value=False))
    self.gather_op = self._gather()

  def _gather(self) -> tf.Operation:
    """An op bringing every task's position to every task's `ranks` (all tasks run it)."""
    source = self.source
    with tf.name_scope(NAME):
      with tf.device(source.device):
        ended = tf.where(source.ended.read_value(), b'1', b'')
        mine = tf.io.serialize_tensor(tf.stack([
            source.state(), tf.io.serialize_tensor(source.pending()), ended,
            tf.constant(source.fingerprint)]))
      every = [slot[0] for slot in self.across.strings_of_every_task([mine])]
      with tf.device(self.across.device):
        step = tf.cast(tf.compat.v1.train.get_or_create_global_step().read_value(), tf.int64)
        return tf.group(self.ranks.assign(tf.stack(every), read_value=False),
                        self.step.assign(step, read_value=False), name='gather')

  def take_from_chief(self) -> tf.Operation:
    """An op setting each task's position to its slot of the chief's (in the local init)."""
    source, rank = self.source, self.across.rank
    with tf.name_scope(NAME):
      slots = self.across.strings_from_chief(
          lambda: tf.unstack(self.ranks.read_value(), num=self.size), self.size)
      source.from_chief = True
      with tf.device(source.device):
        mine = slots[rank]

        def saved():
          parts = tf.io.parse_tensor(mine, tf.string)
          parts.set_shape([4])

          def take():
            pending = tf.io.parse_tensor(parts[1], tf.string)
            pending.set_shape([None, len(source.specs)])
            with tf.control_dependencies(
                [source.set_state(parts[0], pending, tf.equal(parts[2], b'1'))]):
              return tf.constant(TAKEN)
          return tf.cond(tf.equal(parts[3], source.fingerprint), take,
                         lambda: tf.constant(OTHER_DATASET))

        # The first element unless the slot holds this dataset's position.
        with tf.control_dependencies([source.initializer]):
          status = tf.cond(tf.strings.length(mine) > 0, saved,
                           lambda: tf.constant(FIRST_ELEMENT))
        return self.taken.assign(status, read_value=False)

  # The checkpoint (the interface `PositionSaver` uses).

  def saveable(self) -> interception.SaveableObject:
    with tf.name_scope(NAME):
      return _RanksSaveable(self)

  def restorable(self, save_path: str) -> str | None:
    """None if the checkpoint at `save_path` holds these workers' positions, else why not."""
    reader = tf.train.load_checkpoint(save_path)
    if not reader.has_tensor(f'{NAME}/ranks'):
      if reader.has_tensor(f'{NAME}/iterator'):
        return ('it holds one position of global batches (estimator_towers.global_batches), '
                'and each worker now reads its own part of the data')
      return position_lib.NO_POSITION
    ranks = reader.get_tensor(f'{NAME}/ranks')
    if len(ranks) != self.size:
      return position_lib.other_workers(len(ranks))
    step = reader.get_tensor(f'{NAME}/step')
    global_step = (reader.get_tensor('global_step') if reader.has_tensor('global_step')
                   else step)
    if any(ranks) and step != global_step:
      return (f'its input positions were taken at step {step}, not at its step {global_step} '
              f'(a Saver other than Estimator\'s wrote it)')
    if ranks.size and all(_ended(r) for r in ranks):
      return position_lib.ENDED
    return None

  def describe(self, save_path: str) -> tuple[int, str]:
    """(the step the positions were taken at, where each worker reads on), for the log."""
    reader = tf.train.load_checkpoint(save_path)
    step = int(reader.get_tensor(f'{NAME}/step'))
    names = self.across.cluster.training_tasks
    where = []
    for rank, slot in enumerate(reader.get_tensor(f'{NAME}/ranks')):
      name = 'the chief' if rank == 0 else f'worker {rank - 1}'
      if not slot:
        where.append(f'{name} ({names[rank]}) reads its input from its first element')
      elif _ended(slot):
        where.append(f'{name} ({names[rank]}) stays at the end of its input')
      else:
        where.append(f'{name} ({names[rank]}) reads on from its own position')
    return step, '; '.join(where)

  def initialize(self, session: Any) -> None:
    session.run(self.initializer)
    self.source.mark_ready(session)

  def mark_ready(self, session: Any) -> None:
    self.source.mark_ready(session)


def _ended(slot: bytes) -> bool:
  """Whether a saved slot is an input read to its end with nothing pending."""
  if not slot:
    return False
  proto = tf.make_tensor_proto([b''])
  proto.ParseFromString(slot)
  state, pending, ended, _ = tf.make_ndarray(proto)
  proto.ParseFromString(pending)
  return ended == b'1' and not np.asarray(tf.make_ndarray(proto)).size


class _RanksSaveable(interception.SaveableObject):
  """Every worker's position, and the step it was taken at."""

  def __init__(self, positions: WorkerPositions):
    self._positions = positions
    device = positions.across.device
    with tf.device(device):
      ranks = positions.ranks.read_value()
      step = positions.step.read_value()
    specs = [interception.SaveSpec(ranks, '', f'{NAME}/ranks', device=device),
             interception.SaveSpec(step, '', f'{NAME}/step', device=device)]
    super().__init__(positions.ranks.handle, specs, NAME)

  def restore(self, restored_tensors, restored_shapes):
    del restored_shapes
    ranks, step = restored_tensors
    return tf.group(self._positions.ranks.assign(ranks, read_value=False),
                    self._positions.step.assign(step, read_value=False))


class GatherHook(tf.compat.v1.train.SessionRunHook):
  """A task's part in the gathers: after a step the chief saves, and at the end.

  Args:
    positions: the workers' positions.
    gathers: whether this task runs the gathers here (a worker; the chief
      when no `SaverHook` runs them).
  """

  def __init__(self, positions: WorkerPositions, gathers: bool):
    self._positions = positions
    self._gathers = gathers

  def after_create_session(self, session, coord):
    del coord
    self._positions.source.ensure(session)
    if session.run(self._positions.taken) == OTHER_DATASET:
      logs.warning(
          'estimator_towers: the checkpoint\'s input position of this worker (rank %d) is '
          'of another dataset (another batch size, other files, other ops, another shard), '
          'and tf.data would go on with the old one: this worker\'s input starts from its '
          'first element.', self._positions.across.rank)

  def before_run(self, run_context):
    if self._gathers:
      return tf.compat.v1.train.SessionRunArgs(self._positions.across.save_due)
    return None

  def after_run(self, run_context, run_values):
    if self._gathers and run_values.results:
      run_context.session.run(self._positions.gather_op)

  def end(self, session):
    if self._gathers:
      session.run(self._positions.gather_op)


class SaverHook(tf.compat.v1.train.CheckpointSaverHook):
  """The chief's CheckpointSaverHook: it decides before a step whether a checkpoint follows.

  The decision rides in the step's first all-reduce, so that every task
  gathers its position after that step; the checkpoint is then written
  after the step whatever the time it took (`save_secs` counts from the
  decision).
  """

  def __init__(self, positions: WorkerPositions, config: Any, scaffold: Any):
    super().__init__(config.model_dir, save_secs=config.save_checkpoints_secs,
                     save_steps=config.save_checkpoints_steps, scaffold=scaffold,
                     save_graph_def=getattr(config, 'checkpoint_save_graph_def', True))
    self._positions = positions
    self._next_step = 0
    self._due = False

  def after_create_session(self, session, coord):
    super().after_create_session(session, coord)
    self._next_step = int(session.run(self._global_step_tensor)) + 1

  def before_run(self, run_context):
    self._due = self._timer.should_trigger_for_step(self._next_step)
    return tf.compat.v1.train.SessionRunArgs(
        self._global_step_tensor,
        feed_dict={self._positions.across.save_due_input: 1.0 if self._due else 0.0})

  def after_run(self, run_context, run_values):
    self._next_step = int(run_values.results) + 2
    if not self._due:
      return
    session = run_context.session
    session.run(self._positions.gather_op)
    step = int(session.run(self._global_step_tensor))
    self._next_step = step + 1
    self._timer.update_last_triggered_step(step)
    if self._save(session, step):
      run_context.request_stop()

  def end(self, session):
    session.run(self._positions.gather_op)
    super().end(session)
