"""How the tasks of a collective cluster start and run their steps.

Rule: every training task runs the Scaffold's local init op, which sets its
variables to the chief's (`CrossWorker.broadcast_from_chief`): the chief
after restoring or initialising them, a worker after initialising its own (it
does not wait for the chief to initialise variables it never sees); the
towers' copies are set after it. Every training step runs with
RunOptions.timeout_in_ms (`StepTimeoutHook`), so a lost worker makes the
others fail instead of wait, and a session that MonitoredSession recreates
once a step has begun (a failed first step included) raises instead of
waiting for the lost task again, with one message that names the lost task
(the chief, or worker k).
"""

from __future__ import annotations

import socket
import threading

import tensorflow as tf

from estimator_towers.base import ancestry
from estimator_towers.base import logs
from estimator_towers.base import interception
from estimator_towers.cluster import cross_worker
from estimator_towers.cluster import peer_probe
from estimator_towers.cluster import tf_config as cluster_lib


def attach(spec: tf.estimator.EstimatorSpec, across: cross_worker.CrossWorker
           ) -> tf.estimator.EstimatorSpec:
  """`spec` with the cluster's session start (`scaffold`), the step timeout hook and the
  probe of the other training tasks (`peer_probe`)."""
  progress = _Progress()
  hook = StepTimeoutHook(across.timeout_secs, across.cluster, progress)
  probe = peer_probe.PeerProbeHook(across.cluster, across.timeout_secs, progress.lost)
  return spec._replace(scaffold=scaffold(spec.scaffold, across, progress),
                       training_hooks=tuple(spec.training_hooks) + (hook, probe))


def scaffold(base: tf.compat.v1.train.Scaffold | None, across: cross_worker.CrossWorker,
             progress: '_Progress') -> tf.compat.v1.train.Scaffold:
  """A Scaffold whose local init sets every task's variables to the chief's.

  Every task runs the local init op: the chief after restoring or
  initialising its variables, a worker after initialising its own (it does
  not wait for the chief to initialise them, which it never sees). The
  Scaffold refuses a second session once a step has run (`_StartOnce`).
  """
  base = base or tf.compat.v1.train.Scaffold()
  variables = tf.compat.v1.global_variables()
  first = [] if across.rank == 0 else [tf.compat.v1.variables_initializer(variables)]
  with tf.control_dependencies(first):
    broadcast = across.broadcast_from_chief(variables)
  # Local variables (the towers' copies of the variables) start from the
  # chief's values: their initial values are read after the broadcast.
  before = ancestry.ancestors(broadcast)  # a read the broadcast waits for cannot wait for it
  for v in tf.compat.v1.local_variables():
    for op in [v.initializer] + _variable_reads(v.initializer):
      if broadcast not in op.control_inputs and op not in before:
        interception.add_control_inputs(op, [broadcast])
  local = (base.local_init_op if base.local_init_op is not None
           else tf.compat.v1.train.Scaffold.default_local_init_op())
  with tf.device(across.device):
    # Ready at once: a worker does not wait for the chief's variables.
    ready = tf.constant([], tf.string, name='ready_for_broadcast')
  return _StartOnce(
      across.cluster, progress,
      init_op=base.init_op, init_feed_dict=base.init_feed_dict,
      # Scaffold keeps init_fn bound to itself (a function of the session alone).
      init_fn=_rebound(base._init_fn),  # pylint: disable=protected-access
      ready_op=base.ready_op,
      ready_for_local_init_op=ready,
      local_init_op=tf.group(broadcast, local, name='local_init_from_chief'),
      summary_op=base.summary_op, saver=base.saver,
      local_init_feed_dict=base.local_init_feed_dict)


def _variable_reads(initializer: tf.Operation) -> list[tf.Operation]:
  """The ops computing `initializer`'s value that read a variable.

  A resource variable's copy reads its original with a ReadVariableOp. A ref
  variable's is rebuilt by TensorFlow as `cond(is_variable_initialized(v),
  v, v.initial_value)`, whose IsVariableInitialized and RefSwitch take the
  variable itself, on its device: each of these must wait for the broadcast,
  or a worker's copy is read before its variable is initialised (an error)
  or set (the worker's own initial value, silently).
  """
  reads, seen, stack = [], set(), list(initializer.inputs)
  while stack:
    op = stack.pop().op
    if op.name in seen or op.type in _VARIABLE_OPS:
      continue
    seen.add(op.name)
    if op.type == 'ReadVariableOp' or any(
        t.dtype != t.dtype.base_dtype or t.op.type in _VARIABLE_OPS for t in op.inputs):
      reads.append(op)
    stack.extend(op.inputs)
  return reads


_VARIABLE_OPS = ('VariableV2', 'Variable', 'VarHandleOp')


def _rebound(init_fn):
  """A Scaffold's bound init_fn (session -> None) as a new Scaffold's (scaffold, session)."""
  return None if init_fn is None else lambda scaffold, session: init_fn(session)


class _StartOnce(tf.compat.v1.train.Scaffold):
  """A Scaffold that raises instead of starting a second session after a step ran.

  A peer that dies makes a step fail with UnavailableError, on which
  MonitoredSession recreates the session and runs the local init again,
  whose broadcast fails at once (the process's collectives are aborted),
  again and again. Every session MonitoredSession creates calls `finalize`
  first: once a step has begun in this process (the first one included), it
  raises, in Python (one message, naming the lost task), before any op runs.
  """

  def __init__(self, cluster: cluster_lib.Cluster, progress: '_Progress', **kwargs):
    super().__init__(**kwargs)
    self._cluster = cluster
    self._progress = progress

  def finalize(self):
    if self._progress.begun:
      self._progress.cancel_timer()
      raise RuntimeError(lost_task_message(
          self._cluster, self._progress.steps, unreachable_tasks(self._cluster),
          [named(self._cluster, peer) for peer in self._progress.lost]))
    return super().finalize()


def task_name(job: str, index: int) -> str:
  """'the chief' or 'worker k', as TF_CONFIG names the task."""
  return 'the chief' if job == 'chief' else f'{job} {index}'


def named(cluster: cluster_lib.Cluster, peer: str) -> str:
  """'worker k (address)' for a training task's device name ('/job:worker/replica:0/task:k')."""
  parts = dict(part.split(':', 1) for part in peer.strip('/').split('/'))
  job, index = parts['job'], int(parts['task'])
  return f'{task_name(job, index)} ({cluster.jobs[job][index]})'


def unreachable_tasks(cluster: cluster_lib.Cluster, timeout_secs: float = 2.0) -> list[str]:
  """The other training tasks whose address accepts no connection, by name and address."""
  lost = []
  for job in cluster_lib.TRAINING_JOBS:
    for index, address in enumerate(cluster.jobs.get(job, ())):
      if (job, index) == (cluster.task_type, cluster.task_index):
        continue
      host, _, port = str(address).rpartition(':')
      try:
        socket.create_connection((host.strip('[]'), int(port)), timeout=timeout_secs).close()
      except (OSError, ValueError):
        lost.append(f'{task_name(job, index)} ({address})')
  return lost


def _lost(lost: list[str]) -> str:
  """'worker 0 (host:port) is lost (...)', or '' for none."""
  if not lost:
    return ''
  return f'{" and ".join(lost)} {"is" if len(lost) == 1 else "are"} lost (no server answers there)'


def lost_task_message(cluster: cluster_lib.Cluster, steps: int, lost: list[str],
                      unanswered: list[str] = ()) -> str:
  """The error of a task whose step failed because another training task is lost.

  Args:
    cluster: this task's cluster.
    steps: the training steps this task ran.
    lost: the tasks whose address accepts no connection ('worker k (address)').
    unanswered: the tasks that did not answer the probes (`peer_probe`), by name.
  """
  if unanswered and not lost:
    who = (f'{" and ".join(unanswered)} stopped answering (it did not answer '
           f'{peer_probe.FAILURES_TO_STOP} probes in a row during a step, though its address '
           f'accepts connections: it hangs or restarted)')
  else:
    who = _lost(lost) or ('another training task stopped answering (every task\'s address '
                          'accepts connections: one of them hangs or restarted)')
  return (f'estimator_towers: {task_name(cluster.task_type, cluster.task_index)} '
          f'({cluster.device}, rank {cluster.rank} of {cluster.num_workers} training tasks) '
          f'failed a training step after {steps} step(s): {who}. '
          f'variable_strategy=\'collective\' cannot continue without every training '
          f'task. Restart the job: it resumes from the chief\'s last checkpoint.')


class _Progress:
  """Training steps in this process (shared by the hooks and the scaffold): whether one
  began, how many ended, the step timeout's timer, the tasks the probe found lost."""

  def __init__(self):
    self.begun = False
    self.steps = 0
    self.timer = None
    self.lost = []

  def cancel_timer(self):
    if self.timer is not None:
      self.timer.cancel()


class StepTimeoutHook(tf.compat.v1.train.SessionRunHook):
  """Every training step fails after `timeout_secs` instead of waiting for a lost worker.

  When a worker dies, the others' all-reduces would wait for it forever; the
  step's RunOptions.timeout_in_ms makes them fail with DeadlineExceededError,
  and this hook logs which cluster and bound it was. At the session's start
  (the chief's variables broadcast, whose all-reduce has the same time limit),
  it logs the training tasks the start waits for once it has waited as long.
  """

  def __init__(self, timeout_secs: float, cluster: cluster_lib.Cluster,
               progress: '_Progress'):
    self._timeout_secs = timeout_secs
    self._cluster = cluster
    self._progress = progress
    self._timer = None

  def begin(self):
    self._timer = threading.Timer(self._timeout_secs, self._report_start)
    self._timer.daemon = True
    self._timer.start()

  def after_create_session(self, session, coord):
    del session, coord
    self._timer.cancel()

  def before_run(self, run_context):
    self._progress.begun = True
    self._progress.cancel_timer()  # a failed step's (no after_run)
    self._timer = self._progress.timer = threading.Timer(self._timeout_secs, self._report)
    self._timer.daemon = True
    self._timer.start()
    return tf.compat.v1.train.SessionRunArgs(
        fetches=None, options=tf.compat.v1.RunOptions(
            timeout_in_ms=int(self._timeout_secs * 1000)))

  def after_run(self, run_context, run_values):
    self._timer.cancel()
    self._progress.steps += 1

  def end(self, session):
    if self._timer is not None:
      self._timer.cancel()

  def _report_start(self):
    logs.error(
        'estimator_towers: %s (rank %d of %d training tasks) has waited %.0f s '
        '(worker_timeout_secs of make_config or make_plan) at its start for the other '
        'training tasks (%s) to take the chief\'s variables: one of them has not started, or '
        'cannot reach this one (check TF_CONFIG\'s addresses). If it does not '
        'answer, the start fails with DeadlineExceededError; start every task of '
        'the cluster.', self._cluster.device, self._cluster.rank,
        self._cluster.num_workers, self._timeout_secs,
        ', '.join(self._cluster.training_tasks))

  def _report(self):
    lost = unreachable_tasks(self._cluster)
    logs.error(
        'estimator_towers: %s (rank %d of %d training tasks: %s) has waited %.0f s '
        '(the step timeout, worker_timeout_secs of make_config or make_plan) for the other '
        'workers\' all-reduce: %s. This step fails '
        'with DeadlineExceededError; restart the job, which resumes from the '
        'chief\'s last checkpoint.', self._cluster.device, self._cluster.rank,
        self._cluster.num_workers, ', '.join(self._cluster.training_tasks),
        self._timeout_secs,
        _lost(lost) or 'a worker has died or stopped')
