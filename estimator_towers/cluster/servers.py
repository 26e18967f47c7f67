"""The TensorFlow server of a collective cluster's task: its devices and the all-reduce's leader.

Rule: a task's devices, and the leader through which collective ops across
the processes of a cluster resolve their groups
(`ConfigProto.experimental.collective_group_leader`), are set when its server
starts, from the server's config, not from a session's. Estimator's
`train_and_evaluate` starts each task's server with a config of its own (only
the GPU options of RunConfig.session_config: one CPU device, no leader), so
`install()` (called when a plan with variable_strategy='collective' is made)
makes it start the server of a task of a cluster with a chief and no ps from
RunConfig.session_config itself (its device counts, threads, GPU options;
without device filters), with the chief ('/job:chief/replica:0/task:0') as the
leader unless one is set. Other clusters keep Estimator's own server.

Rule: a training task's sessions see only its own devices
(`ConfigProto.device_filters`). Without filters, a session's master waits in
CreateSession for every task of the cluster, with no time limit, so a task
that never starts would hang the others instead of failing their start-up
broadcast after `worker_timeout_secs`. `make_run_config` sets the filter; a
session config of the user's own gets it when the server starts
(`own_devices_only`), or, if its filters name other tasks, an error that says
how to fix them. Private Estimator API, fenced in this module.
"""

from __future__ import annotations

import tensorflow as tf

from estimator_towers.base import interception
from estimator_towers.cluster import tf_config as cluster_lib


def server_config(cluster_spec, session_config: tf.compat.v1.ConfigProto | None
                  ) -> tf.compat.v1.ConfigProto | None:
  """The server config of a task of `cluster_spec`; None: Estimator's own."""
  jobs = tf.train.ClusterSpec(cluster_spec).jobs if cluster_spec else []
  if 'chief' not in jobs or 'ps' in jobs:
    return None
  proto = tf.compat.v1.ConfigProto()
  if session_config is not None:
    proto.CopyFrom(session_config)
  del proto.device_filters[:]
  if not proto.experimental.collective_group_leader:
    proto.experimental.collective_group_leader = cluster_lib.LEADER
  return proto


def own_devices_only(session_config: tf.compat.v1.ConfigProto, cluster_spec, task_type: str,
                     task_index: int) -> None:
  """Limits a training task's `session_config` to its own devices, in place.

  Raises:
    ValueError: if `session_config.device_filters` lets the task's sessions
      see another training task's devices.
  """
  jobs = tf.train.ClusterSpec(cluster_spec).as_dict()
  own = f'/job:{task_type}/task:{task_index}'
  filters = list(session_config.device_filters)
  if not filters:
    tf.compat.v1.logging.info('estimator_towers: the sessions of %s see only its own devices '
                              '(device_filters [%r]).', own, own)
    session_config.device_filters.append(own)
    return

  def own_only(device_filter):
    spec = tf.DeviceSpec.from_string(device_filter)
    if spec.job == task_type:
      return spec.task == task_index or (spec.task is None and len(jobs.get(task_type, ())) == 1)
    return spec.job is not None and spec.job not in cluster_lib.TRAINING_JOBS
  if not all(own_only(f) for f in filters):
    raise ValueError(
        f'variable_strategy=\'collective\': RunConfig.session_config.device_filters is '
        f'{filters}, which lets the sessions of {own} see other training tasks\' '
        f'devices. A training task\'s sessions must see only its own devices, or '
        f'their start waits for every other task with no time limit (a task that '
        f'never starts would hang this one). Set device_filters to [{own!r}] or '
        f'leave them empty (estimator_towers then sets them), or build the '
        f'RunConfig with make_run_config(make_config(...)).')


def install() -> None:
  """Makes Estimator's train_and_evaluate start servers by `server_config` (idempotent)."""
  executor = interception.training_executor()
  original = executor._start_std_server  # pylint: disable=protected-access
  if getattr(original, 'estimator_towers', False):
    return

  def start_std_server(self, config):
    proto = server_config(config.cluster_spec, config.session_config)
    if proto is None or not config.master or config.task_type is None:
      return original(self, config)
    own = getattr(self._estimator, '_session_config', None)  # what its sessions are made with
    if own is not None and config.task_type in cluster_lib.TRAINING_JOBS:
      own_devices_only(own, config.cluster_spec, config.task_type, config.task_id)
    tf.compat.v1.logging.info('estimator_towers: starting the TensorFlow server of %s:%d '
                              'with the collective group leader %s.', config.task_type,
                              config.task_id, proto.experimental.collective_group_leader)
    server = tf.distribute.Server(config.cluster_spec, job_name=config.task_type,
                                  task_index=config.task_id, config=proto, start=False,
                                  protocol=config.protocol)
    server.start()
    return server

  start_std_server.estimator_towers = True
  executor._start_std_server = start_std_server  # pylint: disable=protected-access
