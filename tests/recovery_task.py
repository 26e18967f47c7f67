"""A training process for tests/test_recovery.py: killed, restarted, recovered.

  python recovery_task.py ps                      # a parameter server of TF_CONFIG's cluster
  python recovery_task.py train  MODEL_DIR DATA.npz [--block_at=N --flag=PATH]
  python recovery_task.py chief  MODEL_DIR DATA.npz [--block_at=N --flag=PATH]

`train` trains the towered, staged v1 model on this machine; `chief` trains it
as the chief of TF_CONFIG's cluster (variables on the ps) with
`tf.estimator.train_and_evaluate`. With --block_at=N, the process prints
`BLOCKED AT STEP N` after global step N has run and waits there until the file
--flag exists (the test kills it, or a parameter server, meanwhile).
--staging_depth sets how many global batches are staged ahead on the towers.

The input is a seeded shuffle + repeat + batch of the data, read from its first
element by the input_fn: the library saves its position (and the batches staged
on the towers) in every checkpoint, so a run killed and restarted, or a session
recovered from a checkpoint, sees the same batches, step by step, as one that was
never interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import testlib  # pylint: disable=g-import-not-at-top
from estimator_towers import make_plan  # pylint: disable=g-import-not-at-top
from estimator_towers import replicate_model_fn  # pylint: disable=g-import-not-at-top
from estimator_towers import staged_input_fn  # pylint: disable=g-import-not-at-top

BATCH = 5
NUM_TOWERS = 3  # Batches of 5 over 3 towers: shards of 2, 2 and 1.
STAGING_DEPTH = 2
SHUFFLE_SEED = 11
BLOCKED = 'BLOCKED AT STEP'


def checkpoint_step(model_dir: str) -> int:
  """The global step of the latest checkpoint in model_dir (0 without one)."""
  checkpoint = tf.train.latest_checkpoint(model_dir)
  return int(tf.train.load_variable(checkpoint, 'global_step')) if checkpoint else 0


def input_fn(x, y):
  """Batches of (x, y), shuffled anew each epoch (seeded), repeated."""
  def fn():
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
        len(x), seed=SHUFFLE_SEED).repeat().batch(BATCH)
  return fn


def towered_estimator(model_dir: str, checkpoint_steps: int,
                      staging_depth: int = STAGING_DEPTH) -> tuple:
  plan = make_plan(devices=testlib.cpu_devices(NUM_TOWERS), staging_depth=staging_depth)
  config = tf.estimator.RunConfig(
      model_dir=model_dir, save_checkpoints_steps=checkpoint_steps, keep_checkpoint_max=100,
      save_summary_steps=10**6, log_step_count_steps=10**6,
      session_config=testlib.quiet_threads(tf.compat.v1.ConfigProto(
          device_count={'CPU': NUM_TOWERS}, allow_soft_placement=True,
          inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)))
  return tf.estimator.Estimator(replicate_model_fn(testlib.v1_model_fn, plan=plan),
                                config=config), plan


class BlockAt(tf.compat.v1.train.SessionRunHook):
  """After global step `step` has run (once per process), waits for `flag` to exist."""

  def __init__(self, step: int, flag: str):
    self._step = step
    self._flag = flag
    self._done = False

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()
    # An op on the global step's device (the ps in a cluster), run once the
    # flag appears: the first contact with a restarted ps then fails in one
    # partition only, as AbortedError, which MonitoredSession recovers from.
    # (A full step's first contact can instead surface the chief's cancelled
    # receives as CancelledError, which it does not recover from: TensorFlow's
    # race, with or without towers.)
    with tf.compat.v1.colocate_with(self._global_step):
      self._probe = tf.no_op(name='ps_probe')

  def after_run(self, run_context, run_values):
    if self._done or run_context.session.run(self._global_step) != self._step:
      return
    self._done = True
    print(f'{BLOCKED} {self._step}', flush=True)
    deadline = time.monotonic() + 300
    while not os.path.exists(self._flag):
      if time.monotonic() > deadline:
        raise RuntimeError(f'{self._flag} did not appear within 300 s.')
      time.sleep(0.05)
    run_context.session.run(self._probe)


def train(model_dir: str, x, y, max_steps: int, checkpoint_steps: int,
          staging_depth: int = STAGING_DEPTH, hooks=(), distributed: bool = False
          ) -> tf.estimator.Estimator:
  """Trains to max_steps (resuming from model_dir's latest checkpoint)."""
  estimator, plan = towered_estimator(model_dir, checkpoint_steps, staging_depth)
  fn = staged_input_fn(input_fn(x, y), plan)
  if distributed:
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(fn, max_steps=max_steps, hooks=list(hooks)),
        tf.estimator.EvalSpec(fn, steps=1, start_delay_secs=0, throttle_secs=0))
  else:
    estimator.train(fn, max_steps=max_steps, hooks=list(hooks))
  return estimator


def run_ps() -> None:
  cluster = tf.estimator.RunConfig().cluster_spec  # From TF_CONFIG.
  server = tf.distribute.Server(cluster, job_name='ps', task_index=0, protocol='grpc')
  print('PS STARTED', flush=True)
  server.join()


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('role', choices=['ps', 'train', 'chief'])
  parser.add_argument('model_dir', nargs='?')
  parser.add_argument('data', nargs='?')
  parser.add_argument('--max_steps', type=int, default=10)
  parser.add_argument('--checkpoint_steps', type=int, default=4)
  parser.add_argument('--block_at', type=int, default=0)
  parser.add_argument('--flag', default='')
  parser.add_argument('--staging_depth', type=int, default=STAGING_DEPTH)
  args = parser.parse_args()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
  if args.role == 'ps':
    run_ps()
    return
  data = np.load(args.data)
  hooks = [BlockAt(args.block_at, args.flag)] if args.block_at else []
  train(args.model_dir, data['x'], data['y'], args.max_steps, args.checkpoint_steps,
        args.staging_depth, hooks=hooks, distributed=args.role == 'chief')
  print('TRAINING DONE', flush=True)


if __name__ == '__main__':
  main()
