"""A plain Estimator's training graph, built once, run as several train() calls.

The plain references (testlib.PlainTraining, testlib.plain_train_and_read) read
the undecorated model_fn's variables after steps of one or several train()
calls. A real Estimator builds the graph again for each call, starts a session,
writes checkpoints with their MetaGraphDef, graph.pbtxt and events; `PlainGraph`
builds it once, with Estimator's own steps (its private methods: the global step
and its read, the input_fn under /cpu:0 with the dataset iterator's initializer
hook, the model_fn called with Estimator's params and config; then the loss
summary and Estimator's Saver), and `train()` runs one call as Estimator runs
it: a new Session (stateful kernels such as seeded random ops start again, as in
a new graph), the variables restored from a checkpoint or initialized and the
local init op run (ChiefSessionCreator, Estimator's SessionManager), the input
from its first element, the caller's hooks, StopAtStepHook, NanTensorHook and
the spec's training hooks, and [train_op, loss] run until the hooks stop. The
variables are read from checkpoints written by that Saver (model_dir/model.ckpt-N
and the `checkpoint` state file), the names and values Estimator's checkpoints
hold.
"""

from __future__ import annotations

import os

import tensorflow as tf
from tensorflow.python.training import training_util  # pylint: disable=g-direct-tensorflow-import

ModeKeys = tf.estimator.ModeKeys


class _SaveAt(tf.compat.v1.train.SessionRunHook):
  """After a step that brings global_step to a key of `save_at`, saves the
  variables in that model_dir (`model.ckpt-<step>` and its state file)."""

  def __init__(self, scaffold, global_step, save_at: dict[int, str]):
    self._scaffold, self._global_step, self._save_at = scaffold, global_step, save_at
    self.saved: dict[int, str] = {}

  def after_run(self, run_context, run_values):
    del run_values
    step = int(run_context.session.run(self._global_step))
    if step in self._save_at and step not in self.saved:
      model_dir = self._save_at[step]
      os.makedirs(model_dir, exist_ok=True)
      path = self._scaffold.saver.save(run_context.session, os.path.join(model_dir, 'model.ckpt'),
                              global_step=step, write_meta_graph=False, write_state=False)
      tf.compat.v1.train.update_checkpoint_state(model_dir, path)
      self.saved[step] = path


class PlainGraph:
  """`estimator`'s TRAIN graph on `input_fn`, built once (see the module's doc)."""

  # pylint: disable=protected-access
  def __init__(self, estimator: tf.estimator.Estimator, input_fn):
    self._config = estimator._session_config
    self.graph = tf.Graph()
    with self.graph.as_default() as g, g.device(estimator._device_fn):
      tf.compat.v1.random.set_random_seed(estimator.config.tf_random_seed)
      self._global_step = estimator._create_and_assert_global_step(g)
      training_util._get_or_create_global_step_read(g)
      features, labels, input_hooks = estimator._get_features_and_labels_from_input_fn(
          input_fn, ModeKeys.TRAIN)
      spec = estimator._call_model_fn(features, labels, ModeKeys.TRAIN, estimator.config)
      if not any(s.op.name == 'loss' for s in tf.compat.v1.get_collection(
          tf.compat.v1.GraphKeys.SUMMARIES)):
        tf.compat.v1.summary.scalar('loss', spec.loss)  # as Estimator (hooks may look for it)
      tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.LOSSES, spec.loss)
      self._fetches = [spec.train_op, spec.loss]
      self._input_hooks = list(input_hooks)
      self._hooks = ([tf.compat.v1.train.NanTensorHook(spec.loss)] + list(spec.training_hooks)
                     + list(spec.training_chief_hooks))
      if not (spec.scaffold.saver or tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SAVERS)):
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, tf.compat.v1.train.Saver(
            sharded=True, max_to_keep=None, defer_build=True, save_relative_paths=True))
      self._scaffold = spec.scaffold
  # pylint: enable=protected-access

  def train(self, steps: int, save_at: dict[int, str], restore: str | None = None,
            hooks=None) -> dict:
    """One train(steps=`steps`, hooks=`hooks`) call from checkpoint `restore`
    (None: from the initializers); the checkpoint path written at each step of
    `save_at` (step -> model_dir), by step."""
    with self.graph.as_default():
      creator = tf.compat.v1.train.ChiefSessionCreator(
          scaffold=self._scaffold, config=self._config, checkpoint_filename_with_path=restore)
      saves = _SaveAt(self._scaffold, self._global_step, save_at)  # finalized by `creator`
      hooks = (self._input_hooks + list(hooks or []) + [
          tf.compat.v1.train.StopAtStepHook(num_steps=steps)] + self._hooks + [saves])
      with tf.compat.v1.train.MonitoredSession(session_creator=creator, hooks=hooks) as session:
        while not session.should_stop():
          session.run(self._fetches)
    missing = sorted(set(save_at) - set(saves.saved))
    assert not missing, f'the plain model_fn never reached global_step {missing}'
    return saves.saved
