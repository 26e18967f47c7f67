"""Shared helpers for the tests: data, reference models, Estimators on virtual CPUs.

The reference for almost every test is the plain, single-device model_fn run by
a plain Estimator on the same data, or on the graph a plain Estimator builds, run
as it runs it (tests/plain_graph.py: the same values, one graph build).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import plain_graph


def _write_graph_pbtxt_in_c() -> None:
  """Estimator's graph.pbtxt, written by protobuf's C text encoder.

  Every Estimator session start writes graph.pbtxt (CheckpointSaverHook) with
  the pure-Python `text_format.MessageToString`: about 0.4 s a call for a
  towered graph, a sixth of a short test's time. The C encoder behind
  `str(graph_def)` (upb) writes the same GraphDef (it parses back equal) in a
  tenth of the time. Only the writing of the text changes; nothing the tests
  compare is read from graph.pbtxt's bytes. TensorFlow's private module is
  touched here only.
  """
  from google.protobuf.internal import api_implementation  # pylint: disable=g-import-not-at-top
  from tensorflow.python.lib.io import file_io  # pylint: disable=g-import-not-at-top
  from tensorflow.python.training import training_util  # pylint: disable=g-import-not-at-top
  if api_implementation.Type() != 'upb' or getattr(training_util.write_graph, 'in_c', False):
    return
  original = training_util.write_graph

  def write_graph(graph_or_graph_def, logdir, name, as_text=True):
    if not as_text or logdir.startswith('gs:') or not isinstance(
        graph_or_graph_def, tf.compat.v1.GraphDef) or sys.byteorder == 'big':
      return original(graph_or_graph_def, logdir, name, as_text)
    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, name)
    file_io.atomic_write_string_to_file(path, str(graph_or_graph_def))
    return path

  write_graph.in_c = True
  training_util.write_graph = write_graph


_write_graph_pbtxt_in_c()


def _graph_def_of_a_finalized_graph_once() -> None:
  """A finalized graph's GraphDef, made once and copied for each later ask.

  An Estimator train() call asks its finalized graph for `as_graph_def(add_shapes=True)`
  about eight times (graph.pbtxt, the MetaGraphDef of the events file and of each saved
  checkpoint, the events file's graph), each a Python walk over every op for its shapes
  (tests/test_equivalence.py: 63 s of CPU before, 53 s after). A finalized graph takes no
  new op (its `version`, which counts its ops, and its functions are the key: a graph
  unfinalized and changed is made again), so each ask gets a copy of the same GraphDef,
  made by protobuf's C code; callers may change their copy. TensorFlow's private method
  is touched here only.
  """
  from tensorflow.python.framework import ops  # pylint: disable=g-import-not-at-top
  original = ops.Graph._as_graph_def  # pylint: disable=protected-access
  if getattr(original, 'once', False):
    return
  made_of = weakref.WeakKeyDictionary()  # graph -> {key: (GraphDef, version)}

  def _as_graph_def(self, from_version=None, add_shapes=False, use_pybind11_proto=False):
    if not self.finalized or from_version is not None or use_pybind11_proto:
      return original(self, from_version, add_shapes, use_pybind11_proto)
    key = (self.version, len(self._functions), add_shapes)  # pylint: disable=protected-access
    made = made_of.setdefault(self, {})
    if key not in made:
      made[key] = original(self, from_version, add_shapes)
    graph_def, version = made[key]
    copy = type(graph_def)()
    copy.CopyFrom(graph_def)
    return copy, version

  _as_graph_def.once = True
  ops.Graph._as_graph_def = _as_graph_def  # pylint: disable=protected-access


_graph_def_of_a_finalized_graph_once()

# TF1 behaviour by name: `disable_v2_behavior()` ('v1') and each of its parts alone. It is
# process-global, so it is switched on before any graph, in a process of its own (the
# tasks' `tf1` setting, tests/tf1_behaviour_task.py, conftest's ESTIMATOR_TOWERS_TEST_BEHAVIOUR).
TF1_BEHAVIOURS = {
    'v1': tf.compat.v1.disable_v2_behavior,
    'tensorshape': tf.compat.v1.disable_v2_tensorshape,
    'ref_variables': tf.compat.v1.disable_resource_variables,
    'control_flow_v1': tf.compat.v1.disable_control_flow_v2,
}

NUM_FEATURES = 5
NUM_CLASSES = 3
LEARNING_RATE = 0.5


def run_script(code: str, directory, timeout: int, name: str = 'snippet.py'):
  """Runs `code` as a fresh Python program in `directory` (its TMPDIR too), this checkout on
  its path and no GPUs: the CompletedProcess (text) and its stdout + stderr."""
  script = os.path.join(str(directory), name)
  with open(script, 'w') as f:
    f.write(code)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get('PYTHONPATH', ''),
             TMPDIR=str(directory), CUDA_VISIBLE_DEVICES='')
  done = subprocess.run([sys.executable, script], cwd=str(directory), env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)
  return done, done.stdout + done.stderr


def summary_values(model_dir: str, histogram=None) -> dict[str, dict[int, object]]:
  """tag -> {step: value} from every events file in model_dir: scalars, and with
  `histogram`, each histogram as histogram(its HistogramProto)."""
  values = {}
  for path in glob.glob(os.path.join(model_dir, 'events.out.tfevents.*')):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.HasField('simple_value'):
          values.setdefault(value.tag, {})[event.step] = value.simple_value
        elif histogram is not None and value.HasField('histo'):
          values.setdefault(value.tag, {})[event.step] = histogram(value.histo)
  return values


def cpu_devices(n: int) -> list[str]:
  return [f'/cpu:{i}' for i in range(n)]


def session_config(num_cpus: int = 1, **kwargs) -> tf.compat.v1.ConfigProto:
  """The tests' ConfigProto: `num_cpus` virtual CPU devices, two inter-op threads.

  Grappler runs each of its passes once on a graph (`meta_optimizer_iterations`
  ONE; TensorFlow's default is two rounds of all of them): every rewrite a user's
  session makes is made, and a session's first run of a towered graph, which
  Grappler took about a third of, costs less (a tenth of tests/test_cross_example.py's
  time). Its threads do not spin (`quiet_threads`). `kwargs`: ConfigProto's.
  """
  config = tf.compat.v1.ConfigProto(
      device_count={'CPU': max(num_cpus, 1)}, inter_op_parallelism_threads=2,
      intra_op_parallelism_threads=1, **kwargs)
  config.graph_options.rewrite_options.meta_optimizer_iterations = (
      rewriter_config_pb2.RewriterConfig.ONE)
  return quiet_threads(config)


def quiet_threads(config: tf.compat.v1.ConfigProto) -> tf.compat.v1.ConfigProto:
  """`config` with its thread pools' threads sleeping when out of work, not spinning
  (`experimental.disable_thread_spinning`). The suite runs two test processes, and a
  cluster test's tasks, on two cores: a thread spinning for work takes a core another
  process's step needs (two test files side by side: an eighth of their time). How
  fast a step reacts is no test's subject; what it computes does not change."""
  config.experimental.disable_thread_spinning = True
  return config


def run_config(num_cpus: int = 1, **kwargs) -> tf.estimator.RunConfig:
  """A RunConfig with `num_cpus` virtual CPU devices (`session_config`)."""
  kwargs.setdefault('save_checkpoints_steps', 1000)
  kwargs.setdefault('save_summary_steps', 1000)
  kwargs.setdefault('log_step_count_steps', 1000)
  return tf.estimator.RunConfig(session_config=session_config(num_cpus), **kwargs)


def make_estimator(model_fn, num_cpus: int = 1, model_dir: str | None = None,
                   params=None, **config_kwargs) -> tf.estimator.Estimator:
  model_dir = model_dir or tempfile.mkdtemp(prefix='et_')
  return tf.estimator.Estimator(model_fn, model_dir=model_dir,
                                config=run_config(num_cpus, **config_kwargs),
                                params=params)


def data(num_examples: int, seed: int = 0):
  rng = np.random.RandomState(seed)
  x = rng.randn(num_examples, NUM_FEATURES).astype(np.float32)
  y = rng.randint(0, NUM_CLASSES, size=num_examples).astype(np.int32)
  return x, y


def input_fn(x, y, batch_size: int, static_batch: bool = False, epochs: int = 1):
  """Batches of (x, y); static_batch=False leaves the batch dimension unknown."""
  def fn():
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat(epochs)
    return ds.batch(batch_size, drop_remainder=static_batch)
  return fn


# The input's position (the library's, in TRAIN checkpoints): not a variable.
POSITION_PREFIX = 'input_position/'


def variables(estimator: tf.estimator.Estimator) -> dict[str, np.ndarray]:
  """The checkpoint's variables (not the input position) by name."""
  return {n: estimator.get_variable_value(n) for n in estimator.get_variable_names()
          if not n.startswith(POSITION_PREFIX)}


def stepwise_estimator(model_fn, num_cpus: int = 1, model_dir: str | None = None,
                       params=None, **config_kwargs) -> tf.estimator.Estimator:
  """`make_estimator` that keeps a checkpoint of every step (for `train_and_read`).

  Its checkpoints hold the variables only: no MetaGraphDef (.meta) beside each and
  no graph.pbtxt (`checkpoint_save_graph_def=False`), which a towered graph took
  a tenth of a 3-step train() call to write; nothing reads them here, and every
  other Estimator of the tests still writes them.
  """
  config_kwargs.setdefault('checkpoint_save_graph_def', False)
  return make_estimator(model_fn, num_cpus, model_dir, params, save_checkpoints_steps=1,
                        keep_checkpoint_max=0, **config_kwargs)


def checkpoint_variables(path: str) -> dict[str, np.ndarray]:
  """Every value of checkpoint `path`, under the names `variables` gives."""
  reader = tf.train.load_checkpoint(path)
  return {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map()
          if not n.startswith(POSITION_PREFIX)}


def train_and_read(estimator: tf.estimator.Estimator, input_fn, at=(1, 3),
                   hooks=None) -> list[dict[str, np.ndarray]]:
  """The variables after each step of `at`, from ONE train(steps=max(at)) call.

  One graph build and session instead of one per step count: the input runs
  on (a second train() call would restart it). `estimator` must keep a
  checkpoint of every step (`stepwise_estimator`); the reference it is
  compared with must be read the same way.
  """
  config = estimator.config
  assert config.save_checkpoints_steps == 1 and not config.keep_checkpoint_max, (
      'train_and_read needs a stepwise_estimator (a checkpoint of every step, all kept)')
  estimator.train(input_fn, steps=max(at), hooks=hooks)
  # Checkpoints are named by the global step: the one of each step of `at` must be there.
  return [checkpoint_variables(os.path.join(estimator.model_dir, f'model.ckpt-{step}'))
          for step in at]


def plain_train_and_read(model_fn, input_fn, at=(1, 3), params=None, hooks=None,
                         model_dir: str | None = None) -> list[dict[str, np.ndarray]]:
  """`train_and_read(stepwise_estimator(model_fn, params=params), input_fn, at, hooks)`
  for the plain model_fn, without an Estimator: its graph built once as Estimator
  builds it (tests/plain_graph.py), one train(steps=max(at)) session, the variables
  read from the checkpoints its Saver writes at each step of `at` (the names and
  values the Estimator's checkpoints hold). With `model_dir`, they are all written
  there (its latest: the step max(at), for an Estimator to evaluate or resume)."""
  graph = plain_graph.PlainGraph(make_estimator(model_fn, params=params), input_fn)
  directory = tempfile.mkdtemp(prefix='et_')
  saved = graph.train(max(at), {step: model_dir or os.path.join(directory, f'step_{step}')
                                for step in at}, hooks=hooks)
  return [checkpoint_variables(saved[step]) for step in at]


def predictions(estimator, fn, key='logits') -> np.ndarray:
  return np.stack([p[key] for p in estimator.predict(fn, yield_single_examples=True)])


# The project-wide rule for "equal to plain": |actual - expected| <=
# TOLERANCE * max(1, |expected|), elementwise. Float32 rounding of products
# over other shard sizes (which depends on the CPU's kernels) stays far below.
TOLERANCE = 1e-5


def assert_close(actual, expected, err_msg: str = '', tol: float = TOLERANCE) -> None:
  """Asserts |actual - expected| <= tol * max(1, |expected|) elementwise.

  Shapes must match; NaN must be where `expected` has NaN (and only there).
  `tol=0` asks for exact equality.
  """
  actual = np.asarray(actual, dtype=np.float64)
  expected = np.asarray(expected, dtype=np.float64)
  assert actual.shape == expected.shape, (
      f'{err_msg}: shape {actual.shape} != expected {expected.shape}')
  nan = np.isnan(expected)
  np.testing.assert_array_equal(np.isnan(actual), nan, err_msg=f'{err_msg}: NaN positions')
  diff = np.where(nan, 0.0, np.abs(actual - expected))
  bound = tol * np.maximum(1.0, np.abs(expected))
  bad = ~(diff <= bound)
  if bad.any():
    worst = np.unravel_index(np.argmax(np.where(bad, diff - bound, -np.inf)), diff.shape)
    raise AssertionError(
        f'{err_msg}: {int(bad.sum())} of {diff.size} elements differ by more than '
        f'{tol} * max(1, |expected|); worst at {worst}: actual '
        f'{actual[worst]!r}, expected {expected[worst]!r} (|d| = {diff[worst]:.3g})')


_DEPRECATED = re.compile(r'^WARNING:tensorflow:From (\S+): (.*) is deprecated', re.M)


def library_deprecations(log: str) -> list[tuple[str, str, str]]:
  """TensorFlow's deprecation warnings that a line of the library makes, in a process's log,
  as (the library's file:line, what it calls, the instructions), except Estimator's own.

  Every part of Estimator is deprecated ("Use tf.keras instead."), and a plain Estimator
  program makes those warnings too; any other is of the library's making.
  """
  found = []
  for match in _DEPRECATED.finditer(log):
    rest = log[match.end():].split('Instructions for updating:\n', 1)
    found.append((match.group(1), match.group(2),
                  rest[1].splitlines()[0] if len(rest) > 1 else ''))
  return [f for f in found if '/estimator_towers/' in f[0] and f[2] != 'Use tf.keras instead.']


def logged_warnings(monkeypatch) -> list:
  """The library's warnings logged from now on in this test (each test sees its own)."""
  from estimator_towers.base import logs  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(logs, '_warned', set())
  found = []
  monkeypatch.setattr(logs, 'warning', lambda fmt, *a: found.append(fmt % a))
  return found


def assert_variables_close(actual: dict, expected: dict, tol: float = TOLERANCE):
  """Same names, and every value within `assert_close`'s rule (`tol=0`: exact)."""
  assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
  for name in expected:
    if np.asarray(expected[name]).dtype.kind in 'SUO':  # e.g. an object graph proto
      assert actual[name] == expected[name], f'variable {name}'
      continue
    assert_close(actual[name], expected[name], err_msg=f'variable {name}', tol=tol)


# --- Reference models ---------------------------------------------------------

def v1_model_fn(features, labels, mode, params):
  """tf.compat.v1.layers + a tf.compat.v1.train optimizer (batch-separable)."""
  x = features['x'] if isinstance(features, dict) else features
  hidden = tf.compat.v1.layers.dense(
      x, 4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  logits = tf.compat.v1.layers.dense(
      hidden, NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=3))
  classes = tf.argmax(logits, 1)
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(
        mode, predictions={'logits': logits, 'classes': classes},
        export_outputs={'serving_default': tf.estimator.export.PredictOutput(
            {'logits': logits})})
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'accuracy': tf.compat.v1.metrics.accuracy(labels, classes),
        'mean_logit': tf.compat.v1.metrics.mean(logits),
        # A metric of a batch-level value (the loss itself), as k-means' score.
        'mean_loss': tf.compat.v1.metrics.mean(loss),
        'auc': tf.compat.v1.metrics.auc(
            tf.equal(labels, 0), tf.nn.softmax(logits)[:, 0]),
    })
  optimizer = tf.compat.v1.train.GradientDescentOptimizer(
      (params or {}).get('learning_rate', LEARNING_RATE))
  train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def keras_model_fn(features, labels, mode, params):
  """tf.keras.layers with BatchNormalization + a Keras legacy optimizer."""
  x = features['x'] if isinstance(features, dict) else features
  training = mode == tf.estimator.ModeKeys.TRAIN
  norm = tf.keras.layers.BatchNormalization(momentum=0.9)
  dense = tf.keras.layers.Dense(
      4, activation='tanh',
      kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))
  head = tf.keras.layers.Dense(
      NUM_CLASSES, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2),
      bias_initializer=tf.keras.initializers.RandomNormal(seed=3))
  logits = head(dense(norm(x, training=training)))
  if mode == tf.estimator.ModeKeys.PREDICT:
    return tf.estimator.EstimatorSpec(mode, predictions={'logits': logits})
  loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
      labels, logits, from_logits=True))
  if mode == tf.estimator.ModeKeys.EVAL:
    accuracy = tf.keras.metrics.SparseCategoricalAccuracy()
    accuracy.update_state(labels, logits)
    return tf.estimator.EstimatorSpec(mode, loss=loss,
                                      eval_metric_ops={'accuracy': accuracy})
  optimizer = tf.keras.optimizers.legacy.SGD(
      (params or {}).get('learning_rate', LEARNING_RATE))
  optimizer.iterations = tf.compat.v1.train.get_global_step()
  weights = norm.trainable_weights + dense.trainable_weights + head.trainable_weights
  train_op = tf.group(optimizer.get_updates(loss, weights), *norm.updates)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


MODELS = {'v1_layers': v1_model_fn, 'keras_bn': keras_model_fn}


def minibatch_kmeans_steps(centres, counts, batches, reads: str | None = None):
  """Mini-batch k-means (squared Euclidean distance) in float64, as
  `clustering_ops._mini_batch_training_op` states it: each example goes to its
  nearest centre, then c_j += (sum of its k examples - k c_j) / (n_j + k) and
  n_j += k. The reference for TensorFlow's KMeans, whose plain graph races
  (see tests/test_kmeans.py).

  `reads`, one letter per batch, models that race: 'o' reads the old counts
  n_j (as stated), 'u' the counts already updated, n_j + k (1 / (n_j + 2k)).
  """
  centres, counts = centres.astype(np.float64), counts.astype(np.float64)
  for batch, read in zip(batches, reads or 'o' * len(batches)):
    batch = batch.astype(np.float64)
    nearest = ((batch[:, None, :] - centres[None]) ** 2).sum(-1).argmin(1)
    new = centres.copy()
    for j in range(len(centres)):
      members = batch[nearest == j]
      k = len(members)
      if k:
        n = counts[j] + (k if read == 'u' else 0)
        new[j] += (members.sum(0) - k * centres[j]) / (n + k)
        counts[j] += k
    centres = new
  return centres, counts


# --- Towered vs plain training over several train() calls ---------------------

class PlainTraining:
  """The plain model_fn's variables, each way of running it computed once, when asked.

  `after`: after steps 1, 3 and 4 run as train(steps=1), train(steps=2),
  train(steps=1), each call restarting the input (the plain model_fn saves no
  input position), so a towered run resumed from a plain checkpoint, which
  holds no position either, sees the same batches (the resume checks).
  `continuous()`: after steps 1 and 3 of one train(steps=3) call (the input
  runs on), as `train_and_read` reads a towered run, and as a towered run
  resumed from its own checkpoint (which holds the input's position) sees them.

  The plain graph is built once (tests/plain_graph.py: as a plain Estimator
  builds it) and each train() call is a session of its own on it, restored from
  the previous call's checkpoint; the values are read from the checkpoints its
  Saver writes. The first call of `after` is step 1 of `continuous()`'s call
  (the same graph, initial values and first batch): one session runs both.
  """

  def __init__(self, model_fn, input_fn, params=None):
    self._model_fn, self._input_fn, self._params = model_fn, input_fn, params
    self._graph = self._dir = self._step_1 = None
    self._calls = 0
    self._after = None
    self._continuous = None

  def _train(self, steps: int, save_at: tuple, restore: str | None = None) -> dict[int, str]:
    """One train() call on the plain graph: the checkpoint of each step of `save_at`."""
    if self._graph is None:
      self._graph = plain_graph.PlainGraph(
          make_estimator(self._model_fn, params=self._params), self._input_fn)
      self._dir = tempfile.mkdtemp(prefix='et_')
    self._calls += 1
    dirs = {step: os.path.join(self._dir, f'call_{self._calls}_step_{step}') for step in save_at}
    return self._graph.train(steps, dirs, restore)

  def continuous(self) -> dict[int, dict[str, np.ndarray]]:
    if self._continuous is None:
      saved = self._train(3, (1, 3))
      self._step_1 = saved[1]
      self._continuous = {step: checkpoint_variables(saved[step]) for step in (1, 3)}
    return self._continuous

  @property
  def after(self) -> dict[int, dict[str, np.ndarray]]:
    if self._after is None:
      after = {1: self.continuous()[1]}
      step_3 = self._train(2, (3,), restore=self._step_1)[3]
      step_4 = self._train(1, (4,), restore=step_3)[4]
      after[3], after[4] = checkpoint_variables(step_3), checkpoint_variables(step_4)
      for total, values in after.items():
        assert values['global_step'] == total, 'the plain reference must train'
      self._after = after
    return self._after

  def plain_checkpoint_after_step_1(self) -> str:
    """A new model_dir holding (a copy of) the plain checkpoint of step 1."""
    self.continuous()
    model_dir = tempfile.mkdtemp(prefix='et_')
    _copy_checkpoint(os.path.dirname(self._step_1), model_dir)
    return model_dir


def _copy_checkpoint(source: str, target: str) -> None:
  """The latest checkpoint of model_dir `source` (its files and the state file
  naming it), copied into model_dir `target`."""
  checkpoint = tf.train.latest_checkpoint(source)
  for path in tf.io.gfile.glob(checkpoint + '.*'):
    shutil.copy(path, target)
  tf.compat.v1.train.update_checkpoint_state(
      target, os.path.join(target, os.path.basename(checkpoint)))


def check_towered_training(model_fn, towered_model_fn, num_devices: int, input_fn,
                           reference: PlainTraining, params=None,
                           tol: float = TOLERANCE, resume: bool = True) -> None:
  """Towered training equals `reference`: steps 1 and 3, resume both ways.

  Checks: variables and optimizer slots within `tol` (assert_close's rule)
  after 1 and 3 steps, with exactly the plain checkpoint names; global_step +1
  per step. With `resume`: steps 1 and 3 in two train() calls (the second
  resumes the towered estimator's own checkpoint and its input position: one
  uninterrupted plain call is the reference), and a checkpoint resumed plain ->
  towered -> plain (no position in the plain checkpoint: the towered call
  starts its input from the first element, as the plain calls do). Without:
  one train(steps=3) call, read at steps 1 and 3 (one graph build), against
  the plain run made the same way.
  """
  if not resume:
    towered = stepwise_estimator(towered_model_fn, num_cpus=num_devices, params=params)
    after_1, after_3 = train_and_read(towered, input_fn, at=(1, 3))
    assert_variables_close(after_1, reference.continuous()[1], tol)
    assert_variables_close(after_3, reference.continuous()[3], tol)
    return
  towered = make_estimator(towered_model_fn, num_cpus=num_devices, params=params)
  towered.train(input_fn, steps=1)
  assert_variables_close(variables(towered), reference.after[1], tol)
  towered.train(input_fn, steps=2)  # resumes its own checkpoint, the input where it was
  assert_variables_close(variables(towered), reference.continuous()[3], tol)

  # The plain checkpoint of step 1 (the reference's own; plain training is
  # deterministic, so training it again would write the same values).
  mixed_dir = reference.plain_checkpoint_after_step_1()
  mixed = make_estimator(towered_model_fn, num_cpus=num_devices, model_dir=mixed_dir,
                         params=params)
  mixed.train(input_fn, steps=2)  # towered, resumed from the plain checkpoint
  assert_variables_close(variables(mixed), reference.after[3], tol)
  plain_again = make_estimator(model_fn, model_dir=mixed_dir, params=params)
  plain_again.train(input_fn, steps=1)  # plain, resumed from the towered checkpoint
  assert_variables_close(variables(plain_again), reference.after[4], tol)


class StateRecorder(tf.compat.v1.train.SessionRunHook):
  """Records every global variable's value at session start and after each run."""

  def __init__(self):
    self.states: list[dict[str, np.ndarray]] = []
    self._variables = None

  def begin(self):
    self._variables = {v.op.name: v for v in tf.compat.v1.global_variables()}

  def after_create_session(self, session, coord):
    self.states.append(session.run(self._variables))

  def after_run(self, run_context, run_values):
    self.states.append(run_context.session.run(self._variables))


class AdamWeightDecayOptimizer(tf.compat.v1.train.Optimizer):
  """BERT-style Adam with decoupled weight decay and no bias correction.

  Overrides apply_gradients; its slots are get_variable()s named after the
  parameter; it ignores global_step (the model_fn increments it by hand).
  """

  def __init__(self, learning_rate, weight_decay_rate=0.01, beta_1=0.9, beta_2=0.999,
               epsilon=1e-6, exclude_from_weight_decay=('bias',),
               name='AdamWeightDecayOptimizer'):
    super().__init__(False, name)
    self.learning_rate = learning_rate
    self.weight_decay_rate = weight_decay_rate
    self.beta_1 = beta_1
    self.beta_2 = beta_2
    self.epsilon = epsilon
    self.exclude_from_weight_decay = exclude_from_weight_decay

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    del global_step  # BERT's optimizer does not advance it.
    assignments = []
    for grad, param in grads_and_vars:
      if grad is None or param is None:
        continue
      param_name = re.match(r'^(.*):\d+$', param.name).group(1)
      m = tf.compat.v1.get_variable(
          param_name + '/adam_m', shape=param.shape.as_list(), dtype=tf.float32,
          trainable=False, initializer=tf.compat.v1.zeros_initializer())
      v = tf.compat.v1.get_variable(
          param_name + '/adam_v', shape=param.shape.as_list(), dtype=tf.float32,
          trainable=False, initializer=tf.compat.v1.zeros_initializer())
      next_m = self.beta_1 * m + (1.0 - self.beta_1) * grad
      next_v = self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad)
      update = next_m / (tf.sqrt(next_v) + self.epsilon)
      if not any(re.search(r, param_name) for r in self.exclude_from_weight_decay):
        update += self.weight_decay_rate * param
      next_param = param - self.learning_rate * update
      assignments.extend([param.assign(next_param), m.assign(next_m), v.assign(next_v)])
    return tf.group(*assignments, name=name)
