"""`variable_strategy='auto'`: the strategy recommended for the devices and the cluster.

Rule (the table of the "Choosing a strategy" page): across machines, a
TF_CONFIG cluster of a chief and workers with no `ps` trains with
`collective` (synchronous all-reduce), and one with `ps` tasks with `cpu`
(Estimator's parameter servers); on one machine, towers on 5 or more GPUs
use `collective` (NCCL all-reduce), on 3 or 4 GPUs `gpu` (the variables
spread over the GPUs), on 1 or 2 GPUs, on CPU devices or on a mix `cpu`
(the host adds the towers' gradients). The choice and its reason go into the
device report; any strategy given by name is taken as it is.
"""

from __future__ import annotations

from typing import Any, Sequence

from estimator_towers.cluster import tf_config as cluster_lib
from estimator_towers.placement import devices as devices_lib

__all__ = ['AUTO', 'choose']

AUTO = 'auto'


def choose(strategy: str, devices: Sequence[str], cluster: Any = None) -> tuple[str, str]:
  """(the strategy, why): `strategy` itself, or for 'auto' the recommended one.

  Args:
    strategy: the plan's `variable_strategy`.
    devices: the towers' devices on this machine.
    cluster: this task's TF_CONFIG cluster (`tf_config.Cluster`), or None.
  """
  if strategy != AUTO:
    return strategy, ''
  if cluster is not None and cluster.trains and 'worker' in cluster.jobs:
    if 'ps' in cluster.jobs:
      return 'cpu', 'chosen for a cluster with parameter servers'
    return 'collective', (f'chosen for a cluster of {cluster.num_workers} training tasks '
                          f'without parameter servers: synchronous all-reduce')
  gpus = sum(devices_lib.device_type(d) == 'GPU' for d in devices)
  if gpus < len(devices):
    return 'cpu', 'chosen for towers on CPU devices: the host adds their gradients'
  if gpus <= 2:
    return 'cpu', f'chosen for {gpus} GPU{"s" if gpus > 1 else ""}: the host adds their gradients'
  if gpus <= 4:
    return 'gpu', f'chosen for {gpus} GPUs: the variables spread over them'
  return 'collective', f'chosen for {gpus} GPUs: NCCL all-reduce between them'


def cluster_strategy(strategy: str, tf_config: Any = None) -> str:
  """The strategy a TF_CONFIG cluster trains with, for session settings made before any
  device is known ('auto' in a chief-and-workers cluster without `ps` is `collective`)."""
  if strategy != AUTO:
    return strategy
  cluster = cluster_lib.parse(tf_config)
  if cluster is not None and cluster.trains and 'worker' in cluster.jobs \
      and 'ps' not in cluster.jobs:
    return 'collective'
  return strategy
