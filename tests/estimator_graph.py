"""The graph Estimator builds, driven by MonitoredSession as Estimator drives it.

Tests that run the same case many times (tests/test_faults.py repeats every
pipeline fault 20 times) cannot afford a full `Estimator.train/evaluate/predict`
per run (graph building, checkpoints and a fresh session each time). `EstimatorGraph`
builds the graph once exactly as Estimator does for one mode:

- global step first, then the input_fn under `/cpu:0`; a returned
  `tf.data.Dataset` gets an initializable iterator and a hook that initializes
  it in every session (Estimator's `_DatasetInitializerHook`);
- the model_fn called with (features, labels, mode, params, config) as
  Estimator calls it (no labels in PREDICT), and the hooks of its spec
  (training/evaluation/prediction hooks);

and `run()` drives it as Estimator's loops do: a `MonitoredSession` (hooks'
`after_create_session`, the same swallowing of OutOfRangeError as the end of
input), `while not should_stop(): run(...)` over train_op+loss, the metric
update ops, or the predictions. Each `run()` opens a new MonitoredSession on one
kept `tf.compat.v1.Session`: the scaffold's local init op (metric variables,
tables) runs at each creation as it does for a restored session; variables keep
their values between runs (Estimator would restore them from the checkpoint).
So does a TRAIN input the library positions (`inputs/position.py`; the
scaffold's init_fn sets it to the first element in the first run): the next
run reads on from where its iterator is, but without a checkpoint the global
batches a staged run left on the devices are dropped, which Estimator would
restore with the position; an input the library cannot position (a dataset
reading a variable, as tests/test_faults.py's) starts again at every run.
Session options are the tests' (`testlib.session_config`) with
`operation_timeout_in_ms`, so a blocked op fails with DeadlineExceededError
instead of hanging the test.
"""

from __future__ import annotations

import inspect

import tensorflow as tf

import testlib

ModeKeys = tf.estimator.ModeKeys


class _InitializeIterator(tf.compat.v1.train.SessionRunHook):
  """Estimator's hook for an input_fn that returns a Dataset."""

  def __init__(self, initializer):
    self._initializer = initializer

  def after_create_session(self, session, coord):
    del coord
    session.run(self._initializer)


class _KeptSession:
  """The kept session, as MonitoredSession sees it: closing it keeps it open."""

  def __init__(self, session: tf.compat.v1.Session):
    self._session = session
    self.graph = session.graph

  def run(self, *args, **kwargs):
    return self._session.run(*args, **kwargs)

  def close(self):
    pass


class _Creator(tf.compat.v1.train.SessionCreator):

  def __init__(self, owner: 'EstimatorGraph'):
    self._owner = owner

  def create_session(self):
    return self._owner._prepare()  # pylint: disable=protected-access


class EstimatorGraph:
  """One mode's Estimator graph, run any number of times.

  Args:
    model_fn: the model_fn (towered or plain).
    input_fn: a no-argument input_fn (a Dataset, or (features, labels)).
    mode: a tf.estimator.ModeKeys value.
    num_cpus: virtual CPU devices of the session.
    timeout_ms: every blocking op fails after this long.
  """

  def __init__(self, model_fn, input_fn, mode: str, num_cpus: int = 1,
               timeout_ms: int = 60000, params=None):
    self.mode = mode
    session_config = testlib.session_config(num_cpus, operation_timeout_in_ms=timeout_ms)
    config = tf.estimator.RunConfig(session_config=session_config)
    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.compat.v1.train.get_or_create_global_step()
      hooks = []
      with tf.compat.v1.device('/cpu:0'):
        result = input_fn()
      if isinstance(result, tf.data.Dataset):
        iterator = tf.compat.v1.data.make_initializable_iterator(result)
        hooks.append(_InitializeIterator(iterator.initializer))
        result = iterator.get_next()
      features, labels = result if isinstance(result, (tuple, list)) else (result, None)
      if mode == ModeKeys.PREDICT:
        labels = None  # Estimator.predict gives the model_fn the features only.
      # As Estimator: features, and whichever of the others the model_fn names.
      given = dict(labels=labels, mode=mode, params=params, config=config)
      names = inspect.signature(model_fn).parameters
      spec = model_fn(features, **{k: v for k, v in given.items() if k in names})
      if mode == ModeKeys.TRAIN:
        hooks += list(spec.training_hooks) + list(spec.training_chief_hooks)
        self._fetch = [spec.train_op, spec.loss]
        self._values = None
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TRAIN_OP, spec.train_op)  # as Estimator
      elif mode == ModeKeys.EVAL:
        hooks += list(spec.evaluation_hooks)
        metrics = dict(spec.eval_metric_ops)
        metrics['loss'] = tf.compat.v1.metrics.mean(spec.loss)
        self._fetch = tf.group(*[update for _, update in metrics.values()])
        self._values = {name: value for name, (value, _) in metrics.items()}
      else:
        hooks += list(spec.prediction_hooks)
        self._fetch = spec.predictions
        self._values = None
      self.hooks = hooks
      self.scaffold = spec.scaffold or tf.compat.v1.train.Scaffold()
      self.trainable = {v.op.name: v for v in tf.compat.v1.trainable_variables()}
    self.session = tf.compat.v1.Session(graph=self.graph, config=session_config)
    self._initialized = False

  def _prepare(self) -> _KeptSession:
    with self.graph.as_default():   # after the hooks' begin(), as MonitoredSession does
      self.scaffold.finalize()
    if not self._initialized:
      self.session.run(self.scaffold.init_op, feed_dict=self.scaffold.init_feed_dict)
      if self.scaffold.init_fn:
        self.scaffold.init_fn(self.session)
      self._initialized = True
    self.session.run(self.scaffold.local_init_op)
    return _KeptSession(self.session)

  def reset_variables(self) -> None:
    """Variables start from their initializers again at the next run()."""
    self._initialized = False

  def run(self):
    """One Estimator call: train (returns the number of steps), evaluate
    (returns the metrics) or predict (returns the list of batch predictions)."""
    results = []
    with self.graph.as_default():
      with tf.compat.v1.train.MonitoredSession(
          session_creator=_Creator(self), hooks=self.hooks) as session:
        while not session.should_stop():
          results.append(session.run(self._fetch))
    if self.mode == ModeKeys.EVAL:
      return self.session.run(self._values)
    if self.mode == ModeKeys.TRAIN:
      return len(results)
    return results

  def variables(self) -> dict:
    return self.session.run(self.trainable)

  def close(self) -> None:
    self.session.close()
