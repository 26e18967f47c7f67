"""How a TRAIN spec saves and resumes its input: its Saver, its session start, its hooks.

Rule: a positioned input (`position.Source`) is saved by the checkpoint's own
Saver (`position.PositionSaver`, in the SAVERS collection, where Estimator's
CheckpointSaverHook finds it), and exactly one of three sets it when a session
starts: the Saver's restore, the Scaffold's init_fn (nothing restored), or the
input's hook (a task that restores nothing). What is saved depends on the
input: one position of global batches (one machine, or `global_batches`
across workers: every worker takes the chief's in its local init), or one
position per worker of a cluster reading each its own part of the data
(`worker_positions`: the chief's saves wait for every worker's position).
A model_fn that brings its own Saver keeps it, and the position is not saved
(one warning).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.base import logs
from estimator_towers.inputs import position as position_lib
from estimator_towers.inputs import worker_positions

__all__ = ['attach']


class PositionHook(tf.compat.v1.train.SessionRunHook):
  """Sets the position in a session that neither restored nor initialized it (a worker)."""

  def __init__(self, source: position_lib.Source):
    self._source = source

  def after_create_session(self, session, coord):
    del coord
    self._source.ensure(session)


def attach(spec: tf.estimator.EstimatorSpec, source: position_lib.Source, config: Any,
           staged: bool, across: Any = None) -> tf.estimator.EstimatorSpec:
  """`spec` whose session start sets the position, and whose Saver saves it.

  Args:
    spec: the TRAIN spec.
    source: the positioned input.
    config: the RunConfig.
    staged: whether the staging hook sets the position (else the input's hook).
    across: the all-reduces of a collective cluster (`CrossWorker`), None on
      one machine or with parameter servers.
  """
  if source.saved and across is None and not getattr(config, 'is_chief', True):
    logs.warning_once(
        f'estimator_towers: this task ({getattr(config, "task_type", None)} '
        f'{getattr(config, "task_id", None)}) trains with parameter servers, where only '
        f'the chief\'s checkpoints save the input\'s position: this worker reads its own '
        f'input, which a restarted job reads again from its first element. To resume '
        f'every worker\'s input, train with variable_strategy=\'collective\'.')
  base = spec.scaffold or tf.compat.v1.train.Scaffold()
  saver_taken = bool(base.saver is not None or tf.compat.v1.get_collection(
      tf.compat.v1.GraphKeys.SAVERS))
  per_worker = across is not None and source.saved and not source.is_global and not saver_taken
  positions = worker_positions.WorkerPositions(source, across) if per_worker else source
  if source.saved and saver_taken:
    logs.warning(
        'estimator_towers: the model_fn brings its own Saver (Scaffold.saver or the '
        'SAVERS collection), so the input position is not saved: a resumed train() '
        'reads its input from the first element. Leave the Saver to Estimator to '
        'resume the input, or pass resume_input=False to say this is intended.')
  elif source.saved:
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SAVERS,
                                   position_lib.PositionSaver(positions, config))
  # After the variables' broadcast (cluster.session's local init). Not with the model_fn's
  # own Saver: no task restores a position then, and each starts from the first element.
  local_init_op = base.local_init_op
  if across is not None and source.saved and not saver_taken:
    with tf.control_dependencies([] if local_init_op is None else [local_init_op]):
      from_chief = (positions.take_from_chief() if per_worker
                    else source.broadcast_from_chief(across))
    local_init_op = from_chief if local_init_op is None else tf.group(local_init_op, from_chief)
  scaffold = _scaffold(base, positions, local_init_op)
  hooks, chief_hooks = tuple(spec.training_hooks or ()), tuple(spec.training_chief_hooks or ())
  if not per_worker:
    hooks += () if staged else (PositionHook(source),)
    return spec._replace(scaffold=scaffold, training_hooks=hooks)
  # Each worker's position: the chief's saves wait for every worker's (worker_positions).
  saves = (getattr(config, 'save_checkpoints_secs', None)
           or getattr(config, 'save_checkpoints_steps', None))
  chief_saves = bool(across.rank == 0 and saves)
  if chief_saves:
    chief_hooks += (worker_positions.SaverHook(positions, config, scaffold),)
  hooks += (worker_positions.GatherHook(positions, gathers=not chief_saves),)
  return spec._replace(scaffold=scaffold, training_hooks=hooks, training_chief_hooks=chief_hooks)


def _scaffold(base: tf.compat.v1.train.Scaffold, positions: Any, local_init_op: Any
              ) -> tf.compat.v1.train.Scaffold:
  """`base` whose init_fn also sets the position to the first element, and `local_init_op`."""
  user_init_fn = base._init_fn  # pylint: disable=protected-access

  def init_fn(scaffold, session):
    del scaffold
    if user_init_fn is not None:
      user_init_fn(session)
    positions.initialize(session)

  # A copy of its class: a cluster's Scaffold refuses a second session (cluster.session).
  return interception.scaffold_with(base, init_fn, local_init_op)
