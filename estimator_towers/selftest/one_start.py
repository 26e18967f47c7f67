"""One initialisation: every run of the own-model check starts from one checkpoint.

The rule: the variables are created and initialised once, by the reference
(the user's model_fn decorated for the first device alone), and saved as the
step-0 checkpoint; every run, the reference's own included, copies that
checkpoint into a fresh model directory before `train()`, so Estimator
restores it instead of running the initialisers. Without it two runs would
start from different values: an initialiser's op seed follows the order in
which the graph creates its ops, and a towered graph creates more of them.
The step-0 checkpoint is written by a training run stopped before its first
step (Estimator's checkpoint hook saves the state it starts from).

A run is the user's model_fn through `replicate_model_fn(devices=...,
micro_batches=...)` (and the run's other `make_config` settings) for `steps` steps of the user's input_fn, with the
user's params; it returns its checkpoint's values, its TRAIN graph and the
variables in the order the graph created them.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import tempfile
from typing import Callable

import tensorflow as tf

import estimator_towers as et

CHECKPOINT = 'model.ckpt-0'


class _Capture(tf.compat.v1.train.SessionRunHook):
  """Keeps the TRAIN graph and its variables' creation order; `stop`: no step runs."""

  def __init__(self, stop: bool = False):
    self.stop, self.graph, self.variables = stop, None, []

  def begin(self):
    self.graph = tf.compat.v1.get_default_graph()
    self.variables = [v.op.name for v in tf.compat.v1.global_variables()]

  def after_create_session(self, session, coord):
    if self.stop:  # the checkpoint hook has saved step 0 by now
      coord.request_stop()


@dataclasses.dataclass
class Trained:
  """A run's variables after training (name -> value), its graph, the creation order."""
  values: dict
  graph: tf.Graph
  order: list
  steps: int


def _estimator(model_fn: Callable, devices, micro_batches: int, params: dict,
               model_dir: str, settings: dict) -> tf.estimator.Estimator:
  config = et.make_config(devices=list(devices), micro_batches=micro_batches, **settings)
  run_config = et.make_run_config(config, model_dir=model_dir, save_summary_steps=None,
                                  log_step_count_steps=10**6)
  return tf.estimator.Estimator(et.replicate_model_fn(model_fn, plan=config.plan),
                                config=run_config, params=params or None)  # {}: a model_fn without params


def initial_checkpoint(model_fn: Callable, input_fn: Callable, device: str, params: dict,
                       root: str | None = None, settings: dict | None = None) -> str:
  """A directory (in `root`) holding the step-0 checkpoint of `model_fn` decorated for `device`."""
  directory = tempfile.mkdtemp(prefix='start_', dir=root)
  _estimator(model_fn, [device], 1, params, directory, settings or {}).train(
      input_fn, max_steps=1, hooks=[_Capture(stop=True)])
  if not glob.glob(os.path.join(directory, CHECKPOINT + '.index')):
    raise RuntimeError(f'no step-0 checkpoint in {directory}: the reference run saved '
                       f'{sorted(os.listdir(directory))}. A model_fn whose global step does '
                       f'not start at 0 cannot be checked from one initialisation.')
  return directory


def train(model_fn: Callable, input_fn: Callable, devices, micro_batches: int, params: dict,
          start: str, steps: int, root: str | None = None,
          settings: dict | None = None) -> Trained:
  """`model_fn` on `devices` x `micro_batches`, `steps` steps from the checkpoint in `start`."""
  model_dir = tempfile.mkdtemp(prefix='run_', dir=root)
  for path in glob.glob(os.path.join(start, CHECKPOINT + '.*')):
    shutil.copy(path, model_dir)
  tf.compat.v1.train.update_checkpoint_state(model_dir, CHECKPOINT)
  capture = _Capture()
  estimator = _estimator(model_fn, devices, micro_batches, params, model_dir, settings or {})
  estimator.train(input_fn, steps=steps, hooks=[capture])
  reader = tf.train.load_checkpoint(model_dir)
  values = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
  step = int(values.get('global_step', steps))
  return Trained(values, capture.graph, capture.variables, step)
