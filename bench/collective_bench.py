"""variable_strategy='collective' across workers: bytes between workers and steps/sec.

Trains an MLP (64 -> 512 -> 512 -> 10, 1.2 MB of float32 gradients) with
Estimator on processes of a loopback TF_CONFIG cluster, and prints:

- bytes per step entering each worker's all-reduce (read from the graph: the
  CollectiveReduce inputs), the ring all-reduce bound 2 (W-1)/W x the
  gradient bytes that each worker sends, and the bytes the loopback
  interface carried per step and worker while the steps ran (/proc/net/dev;
  everything on `lo`, TCP/gRPC framing included, so run it on an otherwise
  idle machine);
- steps/sec of 2 workers x 1 tower against 1 worker x 2 towers (virtual
  CPUs) at the same global batch, each the median of the steps after the
  first WARMUP ones.

  python bench/collective_bench.py            # W = 2, 40 steps
  python bench/collective_bench.py --steps=80
  python bench/collective_bench.py --batch_norm   # a batch norm after each hidden
      # layer (moving averages in UPDATE_OPS) and sync_batch_norm=True

TensorFlow runs a CollectiveReduce with communication_hint 'ring' as a ring
all-reduce (RingReducer) on CPUs; with 'nccl' on GPUs it calls NCCL. Here
there are only CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 5
FEATURES, HIDDEN, CLASSES = 64, 512, 10


def _model_fn(features, labels, mode, params):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  x = features
  for _ in range(2):
    if params['batch_norm']:
      x = tf.nn.relu(tf.compat.v1.layers.batch_normalization(
          tf.compat.v1.layers.dense(x, HIDDEN, use_bias=False),
          training=mode == tf.estimator.ModeKeys.TRAIN))
    else:
      x = tf.compat.v1.layers.dense(x, HIDDEN, activation=tf.nn.relu)
  logits = tf.compat.v1.layers.dense(x, CLASSES)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(
        loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _lo_bytes() -> int:
  with open('/proc/net/dev') as f:
    for line in f:
      if line.strip().startswith('lo:'):
        return int(line.split(':', 1)[1].split()[0])
  return 0


def task(args) -> None:
  """One training process: a cluster task (TF_CONFIG) or the single machine."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)
  import estimator_towers as et  # pylint: disable=g-import-not-at-top

  class Timer(tf.compat.v1.train.SessionRunHook):
    def __init__(self):
      self.times, self.lo = [], []

    def begin(self):
      graph = tf.compat.v1.get_default_graph()
      self.reduced = sum(
          op.inputs[0].shape.num_elements() * op.inputs[0].dtype.size
          for op in graph.get_operations() if op.type.startswith('CollectiveReduce')
          and 'broadcast_from_chief' not in op.name and op.inputs[0].shape.is_fully_defined())
      self.gradient_bytes = 4 * sum(v.shape.num_elements()
                                    for v in tf.compat.v1.trainable_variables())

    def after_run(self, run_context, run_values):
      self.times.append(time.perf_counter())
      self.lo.append(_lo_bytes())

  index, count = et.worker_index_and_count()
  batch = args.batch // count

  def input_fn():
    rng = tf.random.stateless_uniform
    x = rng([args.steps * batch, FEATURES], seed=[index, 1])
    y = tf.cast(rng([args.steps * batch], seed=[index, 2]) * CLASSES, tf.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)

  config = et.make_config(num_cpu_devices=args.towers, variable_strategy='collective',
                          sync_batch_norm=args.batch_norm,
                          inter_op_threads=2, intra_op_threads=1)
  estimator = tf.estimator.Estimator(
      et.replicate_model_fn(_model_fn, plan=config.plan), params={'batch_norm': args.batch_norm},
      config=et.make_run_config(config, model_dir=args.model_dir, save_checkpoints_steps=10**6,
                                save_summary_steps=10**6, log_step_count_steps=10**6))
  timer = Timer()
  if 'TF_CONFIG' in os.environ:
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(input_fn, hooks=[timer]),
        tf.estimator.EvalSpec(input_fn, steps=1))
  else:
    estimator.train(input_fn, hooks=[timer])
  gaps = np.diff(timer.times[WARMUP:])
  steps = len(timer.lo) - 1 - WARMUP
  print('RESULT ' + json.dumps({
      'steps_per_sec': 1.0 / statistics.median(gaps), 'steps': len(timer.times),
      'reduced_bytes_per_step': timer.reduced, 'gradient_bytes': timer.gradient_bytes,
      'lo_bytes_per_step': (timer.lo[-1] - timer.lo[WARMUP]) / max(steps, 1)}), flush=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _run(args, towers, tf_config=None) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES='')
  if tf_config:
    env['TF_CONFIG'] = json.dumps(tf_config)
  model_dir = tempfile.mkdtemp(prefix='collective_bench_')
  return subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), '--task', f'--towers={towers}',
       f'--steps={args.steps}', f'--batch={args.batch}', f'--model_dir={model_dir}']
      + (['--batch_norm'] if args.batch_norm else []),
      env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _result(proc: subprocess.Popen) -> dict:
  out, _ = proc.communicate(timeout=600)
  for line in out.splitlines():
    if line.startswith('RESULT '):
      return json.loads(line[len('RESULT '):])
  raise RuntimeError(f'no result (exit {proc.returncode})')


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--task', action='store_true')
  parser.add_argument('--towers', type=int, default=1)
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--batch', type=int, default=256, help='global batch')
  parser.add_argument('--model_dir', default='')
  parser.add_argument('--batch_norm', action='store_true',
                      help='batch norms (UPDATE_OPS) and sync_batch_norm=True')
  args = parser.parse_args()
  if args.task:
    task(args)
    return
  cluster = {'chief': [f'127.0.0.1:{_free_port()}'], 'worker': [f'127.0.0.1:{_free_port()}']}
  procs = [_run(args, 1, {'cluster': cluster, 'task': {'type': t, 'index': 0}})
           for t in ('chief', 'worker')]
  try:
    chief, worker = [_result(p) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  single = _result(_run(args, 2))
  w = 2
  ring = 2 * (w - 1) / w * chief['gradient_bytes']
  print(f'W = {w} workers, global batch {args.batch}, {args.steps} steps'
        f'{", batch norm + sync_batch_norm" if args.batch_norm else ""}; '
        f'gradients {chief["gradient_bytes"]} bytes')
  print(f'bytes per step into each worker\'s all-reduce (graph): '
        f'{chief["reduced_bytes_per_step"]}')
  print(f'ring bound 2(W-1)/W x gradient bytes, sent per worker per step: {ring:.0f}')
  print(f'loopback bytes per step and worker (measured, framing included): '
        f'{chief["lo_bytes_per_step"] / w:.0f} ({chief["lo_bytes_per_step"] / w / ring:.2f} x '
        f'the bound)')
  print(f'steps/sec: 2 workers x 1 tower {chief["steps_per_sec"]:.2f} (worker '
        f'{worker["steps_per_sec"]:.2f}); 1 worker x 2 towers {single["steps_per_sec"]:.2f}')


if __name__ == '__main__':
  main()
