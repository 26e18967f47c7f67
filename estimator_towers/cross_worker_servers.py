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
leader unless one is set. Other clusters keep Estimator's own server. Private
Estimator API, fenced in this module.
"""

from __future__ import annotations

import tensorflow as tf

from estimator_towers import cluster as cluster_lib


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


def install() -> None:
  """Makes Estimator's train_and_evaluate start servers by `server_config` (idempotent)."""
  from tensorflow_estimator.python.estimator import training  # pylint: disable=g-import-not-at-top
  executor = training._TrainingExecutor  # pylint: disable=protected-access
  original = executor._start_std_server  # pylint: disable=protected-access
  if getattr(original, 'estimator_towers', False):
    return

  def start_std_server(self, config):
    proto = server_config(config.cluster_spec, config.session_config)
    if proto is None or not config.master or config.task_type is None:
      return original(self, config)
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
