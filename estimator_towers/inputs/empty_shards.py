"""EVAL and PREDICT towers whose shard turns out empty at run time do not run.

A batch whose size is known only at run time can leave the last towers with
no examples (25 examples, batch 12, 3 towers: the last batch splits 1/0/0).
Computing a model_fn on an empty batch can fail (a `py_func` dividing by the
batch length) or give NaN (a mean of nothing), and a borrowed example would
be counted by the metrics. So in EVAL and PREDICT such a tower's shard goes
through a `Switch` on "the shard is non-empty": when it is empty, every op
computed from the shard is dead in TensorFlow's executor and does not run
(no py_func call, no metric update, no NaN). What Estimator fetches from the
tower (its loss, metric updates and per-example predictions) comes out of a
`Merge` with a stand-in that is live exactly when the shard is empty: a loss
of 0 (its weight is 0 too), an update that does nothing, and predictions
with no rows. Tower 0 holds the largest shard, so it is empty only when the
whole batch is, as in a plain model_fn; it is never gated. Ops of a tower
that do not depend on its shard (variable reads, constants) still run.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def _switch(value: tf.Tensor, nonempty: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
  """(value if the shard is empty, value if it is not); the other side is dead."""
  return tuple(tf.raw_ops.Switch(data=value, pred=nonempty))


def gate_inputs(shard: Any, nonempty: tf.Tensor) -> Any:
  """The shard's tensors, dead at run time when the shard is empty."""
  if shard is None:
    return None
  def gate(t):
    with tf.compat.v1.get_default_graph().colocate_with(t):
      return _switch(t, nonempty)[1]
  return tf.nest.map_structure(gate, shard, expand_composites=True)


def live(value: tf.Tensor, nonempty: tf.Tensor, stand_in: tf.Tensor | None = None) -> tf.Tensor:
  """`value` when the shard is non-empty, else `stand_in` (zeros); never dead."""
  if stand_in is None:
    stand_in = tf.zeros(value.shape if value.shape.is_fully_defined() else [], value.dtype)
  when_empty, _ = _switch(stand_in, nonempty)
  return tf.raw_ops.Merge(inputs=[when_empty, value])[0]


def _live_update(update: Any, nonempty: tf.Tensor) -> tf.Tensor:
  """Runs `update` when the shard is non-empty, nothing otherwise; never dead."""
  token = tf.constant(True)
  when_empty, when_nonempty = _switch(token, nonempty)
  with tf.control_dependencies([update]):
    done = tf.identity(when_nonempty)
  return tf.raw_ops.Merge(inputs=[when_empty, done])[0]


def _live_predictions(predictions: Any, first: Any, nonempty: tf.Tensor) -> Any:
  """Per-example predictions, or no rows (tower `first`'s, sliced) when empty.

  Known scalars are per-batch and taken from tower 0: left as they are.
  """
  if predictions is None or (isinstance(predictions, dict) and not predictions):
    return predictions
  flat, first_flat = tf.nest.flatten(predictions), tf.nest.flatten(first)
  kept = [p if p.shape.rank == 0 else live(p, nonempty, f[:0])
          for p, f in zip(flat, first_flat)]
  return tf.nest.pack_sequence_as(predictions, kept)


def gate_spec(spec: tf.estimator.EstimatorSpec, first: tf.estimator.EstimatorSpec,
              nonempty: tf.Tensor) -> tf.estimator.EstimatorSpec:
  """The spec of a tower built on `gate_inputs`, with every fetch kept live.

  Args:
    spec: the tower's EstimatorSpec (EVAL or PREDICT).
    first: tower 0's EstimatorSpec, whose predictions give the empty stand-ins.
    nonempty: bool scalar Tensor: the tower's shard has examples.

  Returns:
    `spec` with its loss (0 when empty), metric update ops (none when empty)
    and predictions (no rows when empty) taken through a `Merge`.
  """
  with tf.name_scope('live_when_empty'):
    loss = spec.loss
    if loss is not None:
      loss = tf.convert_to_tensor(loss)
      loss = live(loss, nonempty)
    metrics = spec.eval_metric_ops or {}
    if metrics:  # One Merge for all of them: Estimator runs every update at once.
      done = _live_update(tf.group(*[update for _, update in metrics.values()]), nonempty)
      metrics = {key: (value, done) for key, (value, _) in metrics.items()}
    predictions = _live_predictions(spec.predictions, first.predictions, nonempty)
  return spec._replace(loss=loss, eval_metric_ops=metrics, predictions=predictions)
