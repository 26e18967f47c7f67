"""The training cluster a TF_CONFIG describes, as the collective strategy sees it.

Rule: under `variable_strategy='collective'` every training task (the chief
and each worker) keeps a full copy of the variables and the tasks all-reduce
their gradients; there is no parameter server. The tasks of the all-reduce
are ranked chief first (rank 0), then worker 0, 1, ...; an evaluator (and any
other task) takes no part in training. `worker_index_and_count()` gives a
training task's rank and the number of training tasks, for
`tf.data.Dataset.shard(count, index)` in an input_fn.

Errors name the TF_CONFIG field at fault: a cluster without a chief, a `ps`
job together with the collective strategy, a task index beyond its job's
addresses, and (under any other strategy) a chief and workers without a ps,
which Estimator would run as a chief training alone while the workers wait.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

TRAINING_JOBS = ('chief', 'worker')
LEADER = '/job:chief/replica:0/task:0'


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A TF_CONFIG cluster.

  Attributes:
    jobs: job name -> list of addresses.
    task_type: this task's job ('chief', 'worker', 'evaluator', 'ps', ...).
    task_index: this task's index in its job.
  """
  jobs: Mapping[str, tuple]
  task_type: str
  task_index: int

  @property
  def training_tasks(self) -> list[str]:
    """'/job:chief/replica:0/task:0', then each worker's, in rank order."""
    return [f'/job:{job}/replica:0/task:{i}'
            for job in TRAINING_JOBS for i in range(len(self.jobs.get(job, ())))]

  @property
  def num_workers(self) -> int:
    """W: the training tasks (the chief and the workers)."""
    return len(self.training_tasks)

  @property
  def trains(self) -> bool:
    return self.task_type in TRAINING_JOBS

  @property
  def rank(self) -> int:
    """This training task's rank: 0 for the chief, 1 + i for worker i."""
    if self.task_type == 'chief':
      return self.task_index
    return len(self.jobs.get('chief', ())) + self.task_index

  @property
  def device(self) -> str:
    """This task's host CPU."""
    return f'/job:{self.task_type}/replica:0/task:{self.task_index}/device:CPU:0'


def parse(tf_config: str | Mapping | None = None) -> Cluster | None:
  """The cluster of `tf_config` (default: the TF_CONFIG variable); None if it has none.

  Raises:
    ValueError: for a task index out of range, or a task type not in the
      cluster (naming the field).
  """
  if tf_config is None:
    tf_config = os.environ.get('TF_CONFIG', '')
  if isinstance(tf_config, str):
    tf_config = json.loads(tf_config) if tf_config.strip() else {}
  jobs = {name: tuple(addresses if isinstance(addresses, (list, tuple)) else
                      sorted(addresses.values()))
          for name, addresses in (tf_config.get('cluster') or {}).items()}
  if not jobs:
    return None
  task = tf_config.get('task') or {}
  task_type, task_index = task.get('type', ''), task.get('index', 0)
  if task_type != 'evaluator':
    if task_type not in jobs:
      raise ValueError(
          f'TF_CONFIG\'s task.type is {task_type!r}, which is not a job of '
          f'TF_CONFIG\'s cluster ({sorted(jobs)}). Set task.type to one of them '
          f'(or to \'evaluator\').')
    if not isinstance(task_index, int) or not 0 <= task_index < len(jobs[task_type]):
      raise ValueError(
          f'TF_CONFIG\'s task.index is {task_index!r}, but cluster.{task_type} '
          f'has {len(jobs[task_type])} address(es), so task.index must be in '
          f'0..{len(jobs[task_type]) - 1}. Give each {task_type} task its own '
          f'index, counting from 0.')
  return Cluster(jobs, task_type, task_index)


def check(cluster: Cluster | None, strategy: str) -> None:
  """Raises for a cluster `strategy` cannot train on (see the module docstring)."""
  if cluster is None:
    return
  if strategy == 'collective':
    if 'ps' in cluster.jobs:
      raise ValueError(
          f'TF_CONFIG\'s cluster has a \'ps\' job ({len(cluster.jobs["ps"])} '
          f'task(s)) but variable_strategy=\'collective\' keeps the variables on '
          f'every worker and has no parameter server. Remove cluster.ps from '
          f'TF_CONFIG, or use another variable_strategy (\'cpu\', \'gpu\', '
          f'\'replicated\') to train with parameter servers.')
    if 'chief' not in cluster.jobs:
      raise ValueError(
          f'TF_CONFIG\'s cluster has no \'chief\' task (jobs: '
          f'{sorted(cluster.jobs)}); variable_strategy=\'collective\' needs one '
          f'chief, which starts the variables, writes checkpoints and leads '
          f'the all-reduce. Add "chief": ["host:port"] to cluster (a former '
          f'worker 0 can become the chief).')
    return
  if 'ps' not in cluster.jobs and 'worker' in cluster.jobs and cluster.trains:
    raise ValueError(
        f'TF_CONFIG\'s cluster has {len(cluster.jobs["worker"])} worker task(s) '
        f'and no \'ps\' job, but variable_strategy={strategy!r} keeps the '
        f'variables on parameter servers: Estimator would train on the chief '
        f'alone while every worker waits. Use variable_strategy=\'collective\' '
        f'(every worker keeps a copy of the variables; gradients are '
        f'all-reduced), or add a \'ps\' job to cluster.')


def worker_index_and_count(tf_config: str | Mapping | None = None) -> tuple[int, int]:
  """(index, count) of this training task among the training tasks, for `Dataset.shard`.

  `dataset.shard(count, index)` gives each training task (the chief and the
  workers) its own part of the data. The chief is 0 and worker i is i + 1;
  count is the number of training tasks (parameter servers and the
  evaluator do not count). Without a TF_CONFIG cluster (one machine) or on
  an evaluator: (0, 1).

  Args:
    tf_config: the cluster as TF_CONFIG's JSON text or as its parsed dict;
      None reads the `TF_CONFIG` environment variable.

  Returns:
    (index, count): this task's index among the training tasks, and their
    number.

  Raises:
    ValueError: for a TF_CONFIG that is not valid JSON or names a task that
      is not in its cluster, or a chief-and-workers cluster (no 'ps') that
      `variable_strategy='collective'` cannot run.

  Example:
      ```python
      def input_fn():
        index, count = estimator_towers.worker_index_and_count()
        return (tf.data.TFRecordDataset(files).shard(count, index)
                .map(parse).batch(per_worker_batch))
      ```
  """
  cluster = parse(tf_config)
  if cluster is None or not cluster.trains:
    return 0, 1
  if 'ps' not in cluster.jobs:
    check(cluster, 'collective')
  return cluster.rank, cluster.num_workers


def from_run_config(config: Any) -> Cluster | None:
  """The cluster of an Estimator RunConfig (the model_fn's `config`), else TF_CONFIG's."""
  spec = getattr(config, 'cluster_spec', None)
  if config is None or spec is None:
    return parse()
  jobs = spec.as_dict() if spec else {}
  if not jobs:
    return None
  return parse({'cluster': jobs, 'task': {'type': config.task_type or '',
                                          'index': config.task_id or 0}})
