"""ThroughputHook: global examples/sec (and an ETA) at Estimator's logging cadence.

Estimator logs and plots `global_step/sec`; with towers a step is a global
batch spread over N devices, so the number users compare across device counts
is examples/sec. The towered model_fn records each step's global batch size in
the graph (`record_global_batch`): a number when it is known statically (then
the hook adds nothing to the steps), else a scalar the hook fetches with every
step. Every `log_step_count_steps` steps the hook logs examples/sec, steps/sec
and, when `max_steps` is given, the step count and the estimated time left,
and writes the `examples_per_sec` scalar to the model directory (TensorBoard).

  estimator = tf.estimator.Estimator(towered_model_fn, config=run_config)
  hook = et.ThroughputHook(estimator.config, max_steps=64000)
  tf.estimator.train_and_evaluate(
      estimator, tf.estimator.TrainSpec(input_fn, max_steps=64000, hooks=[hook]), ...)
"""

from __future__ import annotations

import datetime
from typing import Any

import tensorflow as tf

from estimator_towers.base import logs
from estimator_towers.base import shapes

# Graph collection holding the global batch size (int32 scalar) of each step.
GLOBAL_BATCH_KEY = 'estimator_towers_global_batch'


def first_leaf_rows(features: Any) -> tf.Tensor | int | None:
  """The batch size of a features structure: the rows of its first batched leaf.

  None when no leaf has a batch dimension (the model_fn reports that itself).
  """
  for leaf in tf.nest.flatten(features):
    if isinstance(leaf, tf.SparseTensor):
      return tf.cast(leaf.dense_shape[0], tf.int32)
    if isinstance(leaf, tf.RaggedTensor):
      return tf.cast(leaf.nrows(), tf.int32)
    if not isinstance(leaf, tf.Tensor) or leaf.shape.rank == 0:
      continue
    if shapes.dim(leaf) is not None:
      return shapes.dim(leaf)
    return tf.shape(leaf, out_type=tf.int32)[0]
  return None


def record_global_batch(batch: tf.Tensor | int | None) -> None:
  """Records the global batch size of a training graph for `ThroughputHook`.

  Args:
    batch: a Python int when known statically, else an integer scalar Tensor;
      None records nothing.
  """
  if batch is None:
    return
  if not isinstance(batch, int):
    with tf.name_scope('global_batch_size'):
      batch = tf.cast(batch, tf.int32)
  tf.compat.v1.add_to_collection(GLOBAL_BATCH_KEY, batch)


def _format_duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=int(round(seconds))))


class ThroughputHook(tf.compat.v1.train.SessionRunHook):
  """Logs and plots global examples/sec, with an ETA when max_steps is known.

  Args:
    config: the Estimator's RunConfig (`estimator.config`): its
      `log_step_count_steps` is the cadence (as for Estimator's own
      `global_step/sec`; None turns the hook off) and its `model_dir` receives
      the `examples_per_sec` scalar.
    max_steps: the global step training stops at (TrainSpec's or train()'s
      max_steps), for the ETA; None for no ETA.

  Raises:
    TypeError: if `config` is not a RunConfig.
    ValueError: if max_steps is not a positive integer; in `begin`, if the
      graph has no towered model_fn (replicate_model_fn) or global step.

  Example:
      ```python
      estimator = tf.estimator.Estimator(estimator_towers.replicate_model_fn(model_fn))
      hook = estimator_towers.ThroughputHook(estimator.config, max_steps=10000)
      estimator.train(input_fn, max_steps=10000, hooks=[hook])
      # logs: examples/sec: 854.0 (53.4 steps/sec, 16.0 examples/step); step 11 of 10000, ETA ...
      ```
  """

  def __init__(self, config: tf.estimator.RunConfig, max_steps: int | None = None):
    if not isinstance(config, tf.estimator.RunConfig):
      raise TypeError(
          f'ThroughputHook needs the Estimator\'s RunConfig (estimator.config), '
          f'got {config!r}.')
    if max_steps is not None and (isinstance(max_steps, bool)
                                  or not isinstance(max_steps, int) or max_steps < 1):
      raise ValueError(f'max_steps must be a positive integer or None, got '
                       f'{max_steps!r}.')
    self._every_n_steps = config.log_step_count_steps
    self._output_dir = config.model_dir
    self._max_steps = max_steps
    self._examples = 0

  def begin(self) -> None:
    self._active = bool(self._every_n_steps)
    if not self._active:
      return
    batches = tf.compat.v1.get_collection(GLOBAL_BATCH_KEY)
    if not batches:
      raise ValueError(
          'ThroughputHook counts the examples of a towered model_fn, but this '
          'graph has none: wrap the model_fn with '
          'estimator_towers.replicate_model_fn, and use the hook in training.')
    self._batch = batches[-1]  # An int, or a Tensor fetched with every step.
    self._global_step = tf.compat.v1.train.get_global_step()
    if self._global_step is None:
      raise ValueError('ThroughputHook needs a global step; Estimator creates '
                       'one before calling the model_fn.')
    self._timer = tf.compat.v1.train.SecondOrStepTimer(every_steps=self._every_n_steps)
    self._writer = (tf.compat.v1.summary.FileWriterCache.get(self._output_dir)
                    if self._output_dir else None)

  def after_create_session(self, session, coord) -> None:
    del coord
    if self._active:
      self._timer.reset()
      self._examples = 0
      # Steps are counted here and the global step read only when logging:
      # with a static batch size the hook adds nothing to a step's run.
      self._step = int(session.run(self._global_step))

  def before_run(self, run_context) -> tf.compat.v1.train.SessionRunArgs | None:
    if not self._active or isinstance(self._batch, int):
      return None
    return tf.compat.v1.train.SessionRunArgs(self._batch)

  def after_run(self, run_context, run_values) -> None:
    if not self._active:
      return
    self._examples += (self._batch if isinstance(self._batch, int)
                       else int(run_values.results))
    self._step += 1
    if not self._timer.should_trigger_for_step(self._step):
      return
    self._step = step = int(run_context.session.run(self._global_step))
    elapsed_time, elapsed_steps = self._timer.update_last_triggered_step(step)
    examples, self._examples = self._examples, 0
    if not elapsed_time or not elapsed_steps:
      return  # The first trigger only starts the clock.
    examples_per_sec = examples / elapsed_time
    steps_per_sec = elapsed_steps / elapsed_time
    progress = ''
    if self._max_steps is not None:
      left = max(self._max_steps - step, 0)
      progress = (f'; step {step} of {self._max_steps}, ETA '
                  f'{_format_duration(left / steps_per_sec)}')
    logs.info('examples/sec: %.1f (%.3g steps/sec, %.1f examples/step)%s',
                 examples_per_sec, steps_per_sec, examples / elapsed_steps, progress)
    if self._writer is not None:
      summary = tf.compat.v1.Summary(value=[tf.compat.v1.Summary.Value(
          tag='examples_per_sec', simple_value=examples_per_sec)])
      self._writer.add_summary(summary, step)
