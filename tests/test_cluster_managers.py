"""TF_CONFIG from cluster managers: SLURM (tf_config_from_slurm) and Kubeflow's TFJob.

References: the TF_CONFIG written by hand for the job step SLURM describes,
TensorFlow's SlurmClusterResolver where it agrees (node names that sort in
SLURM's order, one GPU per task), the TF_CONFIG the TFJob operator writes,
and Estimator's RunConfig reading each. The SLURM lines run are the ones
docs/clusters.md shows, with a stub `scontrol` on PATH.
"""

from __future__ import annotations

import json
import os
import re
import stat

import pytest
import tensorflow as tf

import estimator_towers as et
from estimator_towers.cluster import tf_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODES = {'node[9-10]': ['node9', 'node10'], 'nodea,nodeb': ['nodea', 'nodeb']}


def _doc_snippet() -> str:
  """The python block of clusters.md's SLURM paragraph."""
  with open(os.path.join(ROOT, 'docs', 'clusters.md'), encoding='utf-8') as f:
    page = f.read()
  slurm = page[page.index('**SLURM: one call.**'):]
  return re.search(r'```python\n(.*?)```', slurm, re.S).group(1)


@pytest.fixture
def slurm(tmp_path, monkeypatch):
  """A stub scontrol on PATH, and a function setting a job step's SLURM variables."""
  stub = tmp_path / 'scontrol'
  lines = ['#!/bin/sh', 'echo "$@" >> "$(dirname "$0")/calls"',
           '[ "$1 $2" = "show hostnames" ] || exit 1', 'case "$3" in']
  lines += [f"  '{nodelist}') printf '%s\\n' {' '.join(hosts)} ;;"
            for nodelist, hosts in NODES.items()]
  lines += ['  *) exit 1 ;;', 'esac']
  stub.write_text('\n'.join(lines) + '\n')
  stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
  monkeypatch.setenv('PATH', f'{tmp_path}{os.pathsep}{os.environ["PATH"]}')
  # Recorded as it is (absent, most often), so that the TF_CONFIG the code under test
  # sets in os.environ is undone after the test: a TF_CONFIG left behind makes every
  # later Estimator of the process a worker waiting for its chief.
  monkeypatch.setenv('TF_CONFIG', '{}')
  monkeypatch.delenv('TF_CONFIG')

  def step(procid, nodelist='node[9-10]', tasks_per_node='1(x2)', ntasks=2):
    for name in [n for n in os.environ if n.startswith('SLURM_')]:
      monkeypatch.delenv(name)
    monkeypatch.setenv('SLURM_PROCID', str(procid))
    monkeypatch.setenv('SLURM_STEP_NODELIST', nodelist)
    monkeypatch.setenv('SLURM_JOB_NODELIST', nodelist)
    monkeypatch.setenv('SLURM_STEP_TASKS_PER_NODE', tasks_per_node)
    monkeypatch.setenv('SLURM_NTASKS', str(ntasks))
    return tmp_path / 'calls'
  return step


@pytest.mark.parametrize('procid, task', [(1, {'type': 'worker', 'index': 0}),
                                          (0, {'type': 'chief', 'index': 0})])
def test_the_documented_slurm_lines_set_tf_config_for_run_config(slurm, procid, task):
  calls = slurm(procid)
  namespace = {}
  exec(_doc_snippet(), namespace)  # pylint: disable=exec-used

  want = {'cluster': {'chief': ['node9:2222'], 'worker': ['node10:2222']}, 'task': task}
  assert json.loads(os.environ['TF_CONFIG']) == want
  assert calls.read_text().split('\n')[0] == 'show hostnames node[9-10]'
  run_config = namespace['run_config']
  assert (run_config.task_type, run_config.task_id) == (task['type'], task['index'])
  assert run_config.is_chief == (procid == 0)
  assert run_config.cluster_spec.as_dict() == want['cluster']
  assert et.worker_index_and_count() == (procid, 2)
  plain = tf.estimator.RunConfig()
  assert (plain.task_type, plain.task_id) == (task['type'], task['index'])


def test_slurm_tasks_per_node_agree_with_tensorflows_resolver(slurm):
  """Two tasks on each of two nodes: ports counted per node, ranks in SLURM's order."""
  for procid in range(4):
    slurm(procid, 'nodea,nodeb', '2(x2)', 4)
    ours = et.tf_config_from_slurm(port=2222, set_environ=False)
    resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
        jobs={'chief': 1, 'worker': 3}, port_base=2222, gpus_per_node=2, gpus_per_task=1,
        auto_set_gpu=False)
    assert ours['cluster'] == resolver.cluster_spec().as_dict()
    assert (ours['task']['type'], ours['task']['index']) == resolver.get_task_info()
  assert ours['cluster']['worker'] == ['nodea:2223', 'nodeb:2222', 'nodeb:2223']
  assert 'TF_CONFIG' not in os.environ  # set_environ=False


def test_slurm_outside_a_job_step_is_a_clear_error(slurm, monkeypatch):
  slurm(0)
  monkeypatch.delenv('SLURM_PROCID')
  with pytest.raises(ValueError, match=r'reads SLURM_PROCID .* Start the program with srun'):
    et.tf_config_from_slurm()
  slurm(0, 'other[1-2]')
  with pytest.raises(ValueError, match=r"node list 'other\[1-2\]' with `scontrol show "
                                       r"hostnames`, which failed"):
    et.tf_config_from_slurm()
  slurm(0, tasks_per_node='1(x3)', ntasks=3)
  with pytest.raises(ValueError, match=r'names 2 node\(s\).*give 3'):
    et.tf_config_from_slurm()


def _tfjob_tf_config(task_type: str, index: int) -> str:
  """TF_CONFIG as Kubeflow's TFJob operator writes it for a Chief and 2 Workers."""
  service = 'towers-{}-{}.default.svc:2222'
  return json.dumps({
      'cluster': {'chief': [service.format('chief', 0)],
                  'worker': [service.format('worker', i) for i in range(2)]},
      'task': {'type': task_type, 'index': index},
      'environment': 'cloud'})


@pytest.mark.parametrize('task_type, index, rank', [('chief', 0, 0), ('worker', 1, 2)])
def test_a_tfjob_tf_config_is_read_by_run_config_and_the_library(monkeypatch, task_type,
                                                                  index, rank):
  monkeypatch.setenv('TF_CONFIG', _tfjob_tf_config(task_type, index))
  run_config = et.make_run_config(et.make_config(num_cpu_devices=2,
                                                 variable_strategy='collective'),
                                  model_dir='model')
  assert (run_config.task_type, run_config.task_id) == (task_type, index)
  assert run_config.is_chief == (task_type == 'chief')
  assert run_config.cluster_spec.as_dict()['worker'] == [
      'towers-worker-0.default.svc:2222', 'towers-worker-1.default.svc:2222']
  assert et.worker_index_and_count() == (rank, 3)
  cluster = tf_config.from_run_config(run_config)
  assert cluster.training_tasks == ['/job:chief/replica:0/task:0', '/job:worker/replica:0/task:0',
                                    '/job:worker/replica:0/task:1']
  tf_config.check(cluster, 'collective')  # no error: a chief and workers, no ps
