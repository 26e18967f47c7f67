"""The TF_CONFIG of a SLURM job step: SLURM task 0 is the chief, task i the worker i - 1.

Rule: every task of `srun` builds the same cluster from SLURM's variables,
with each node's tasks on consecutive ports from `port` and the tasks ranked
as SLURM places them by default (block distribution: the first node's tasks
first, nodes in the order `scontrol show hostnames` gives). Its own task is
`SLURM_PROCID`. TensorFlow's `SlurmClusterResolver` is not used: it orders
the nodes by name (node10 before node9, where SLURM's task 0 runs on node9),
asks nvidia-smi for GPUs and rewrites CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Mapping


def _variable(env: Mapping[str, str], *names: str) -> str:
  for name in names:
    if env.get(name):
      return env[name]
  raise ValueError(
      f'tf_config_from_slurm reads {" or ".join(names)} from the environment, which has '
      f'none of them: it runs in each task of a SLURM job step (`srun python train.py`), '
      f'not in the batch script itself. Start the program with srun.')


def hostnames(nodelist: str) -> list[str]:
  """`scontrol show hostnames <nodelist>`: the node names, in SLURM's order."""
  try:
    out = subprocess.run(['scontrol', 'show', 'hostnames', nodelist], capture_output=True,
                         text=True, check=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e:
    raise ValueError(
        f'tf_config_from_slurm expands the node list {nodelist!r} with `scontrol show '
        f'hostnames`, which failed ({e}). Run it on a SLURM node, where scontrol is on '
        f'PATH.') from e
  return out.split()


def tasks_per_node(spec: str) -> list[int]:
  """SLURM's tasks-per-node list, e.g. '2(x3),1' -> [2, 2, 2, 1]."""
  counts = []
  for part in spec.split(','):
    match = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
    if match is None:
      raise ValueError(f'SLURM_STEP_TASKS_PER_NODE is {spec!r}: expected counts such as '
                       f'"2(x3),1". Check the job step\'s environment.')
    counts += [int(match.group(1))] * int(match.group(2) or 1)
  return counts


def tf_config_from_slurm(port: int = 8888, set_environ: bool = True,
                         env: Mapping[str, str] | None = None) -> dict:
  """This SLURM task's TF_CONFIG: task 0 the chief, the others its workers.

  Call it first in the program `srun` starts on every task, before the
  RunConfig is made (`make_run_config` or `tf.estimator.RunConfig` read
  `TF_CONFIG`). Each node's tasks listen on `port`, `port + 1`, ...

  Args:
    port: the first port of each node.
    set_environ: also set `os.environ['TF_CONFIG']` to the result's JSON.
    env: the SLURM variables (default: `os.environ`): SLURM_PROCID,
      SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) and
      SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE).

  Returns:
    The TF_CONFIG as a dict: `{'cluster': {'chief': [...], 'worker': [...]},
    'task': {'type': 'chief' or 'worker', 'index': ...}}`, without a
    `worker` job for a single task.

  Raises:
    ValueError: outside a SLURM job step (a variable missing), when
      `scontrol show hostnames` fails, or when the node list and the tasks
      per node disagree.

  Example:
      ```python
      estimator_towers.tf_config_from_slurm(port=2222)  # sets TF_CONFIG
      config = estimator_towers.make_config(num_gpus=4, variable_strategy='collective')
      run_config = estimator_towers.make_run_config(config, model_dir='/shared/model')
      ```
  """
  env = os.environ if env is None else env
  rank = int(_variable(env, 'SLURM_PROCID'))
  nodes = hostnames(_variable(env, 'SLURM_STEP_NODELIST', 'SLURM_JOB_NODELIST'))
  counts = tasks_per_node(_variable(env, 'SLURM_STEP_TASKS_PER_NODE', 'SLURM_TASKS_PER_NODE'))
  if len(counts) != len(nodes):
    raise ValueError(
        f'SLURM\'s node list names {len(nodes)} node(s) ({nodes}) but its tasks per node '
        f'give {len(counts)} ({counts}); they must agree. Check SLURM_STEP_NODELIST and '
        f'SLURM_STEP_TASKS_PER_NODE.')
  addresses = [f'{node}:{port + k}' for node, count in zip(nodes, counts) for k in range(count)]
  if not 0 <= rank < len(addresses):
    raise ValueError(f'SLURM_PROCID is {rank}, but the job step has {len(addresses)} '
                     f'task(s): it must be in 0..{len(addresses) - 1}.')
  cluster = {'chief': addresses[:1]}
  if len(addresses) > 1:
    cluster['worker'] = addresses[1:]
  task = {'type': 'chief', 'index': 0} if rank == 0 else {'type': 'worker', 'index': rank - 1}
  tf_config = {'cluster': cluster, 'task': task}
  if set_environ:
    os.environ['TF_CONFIG'] = json.dumps(tf_config)
  return tf_config
