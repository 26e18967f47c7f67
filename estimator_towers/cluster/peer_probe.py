"""A lost training task stops the others within seconds, not after the step timeout.

Rule: while a training step runs, each training task of a collective cluster
asks every other training task, every `INTERVAL_SECS`, to run an empty op
(a separate session of its own server, RunOptions.timeout_in_ms of
`PROBE_TIMEOUT_SECS`). A task that is dead does not answer (gRPC's
UnavailableError at once), nor does a frozen one whose connections stay open
(the probe's deadline; gRPC alone would wait for the step timeout): after two
such probes in
a row within the same step, the hook records the lost task (in the list the
session's start reads), asks the session's coordinator to stop with an
UnavailableError, and closes the step's session, which cancels the step
waiting in its all-reduce. MonitoredSession then recreates the session, whose
start refuses to wait for a lost task (`session._StartOnce`), and training
stops with that error, the one that names the lost task (TensorFlow logs the
coordinator's error, so it does not name it).
Between steps nothing is probed, so a task that ends its training first is
not taken for a lost one while the others save their last checkpoint. A task
hung in Python (its server still runs) answers: the step timeout
(`session.StepTimeoutHook`) bounds that case.
"""

from __future__ import annotations

import sys
import threading
import time

import tensorflow as tf

from estimator_towers.base import logs
from estimator_towers.cluster import tf_config as cluster_lib

INTERVAL_SECS = 0.5
PROBE_TIMEOUT_SECS = 2.0
FAILURES_TO_STOP = 2


class PeerProbeHook(tf.compat.v1.train.SessionRunHook):
  """Stops this task's training within seconds of another training task's death."""

  def __init__(self, cluster: cluster_lib.Cluster, timeout_secs: float, lost: list):
    self._cluster = cluster
    self._lost = lost  # the peers found lost, read by the session's start
    self._peers = [t for t in cluster.training_tasks if not cluster.device.startswith(t + '/')]
    self._probe_timeout = min(PROBE_TIMEOUT_SECS, timeout_secs)
    self._lock = threading.Lock()
    self._step = None       # the number of the step in flight; None between steps
    self._steps = 0
    self._stop = threading.Event()
    self._thread = None

  def after_create_session(self, session, coord):
    self.end(session)
    if not self._peers:
      return
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, args=(session, coord, self._stop),
                                    name='estimator_towers_peer_probe', daemon=True)
    self._thread.start()

  def before_run(self, run_context):
    with self._lock:
      self._steps += 1
      self._step = self._steps

  def after_run(self, run_context, run_values):
    with self._lock:
      self._step = None

  def end(self, session):
    del session
    self._stop.set()
    if self._thread is not None:
      self._thread.join(PROBE_TIMEOUT_SECS + 1)
      self._thread = None

  def _in_flight(self):
    with self._lock:
      return self._step

  def _watch(self, session, coord, stop):
    """Probes the peers while a step runs; on a lost one, stops `session`'s step."""
    probe = _Probe(session.sess_str, self._peers, self._probe_timeout)
    try:
      failures, step = 0, None
      while not stop.wait(INTERVAL_SECS):
        current = self._in_flight()
        if current is None:
          failures = 0
          continue
        lost = probe.lost()
        if lost is None or current != self._in_flight() or (failures and step != current):
          failures = 0
          continue
        failures, step = failures + 1, current
        if failures >= FAILURES_TO_STOP:
          self._stop_training(session, coord, lost)
          return
    finally:
      probe.close()

  def _stop_training(self, session, coord, lost):
    peer, error = lost
    self._lost.append(peer)
    logs.info('estimator_towers: %s lost the training task %s: it did not answer %d probes '
              'in a row during a step (%s); the step is cancelled.', self._cluster.device,
              peer, FAILURES_TO_STOP, type(error).__name__)
    try:  # the coordinator keeps an exception with its traceback
      raise tf.errors.UnavailableError(None, None, (
          f'estimator_towers: a training task did not answer {FAILURES_TO_STOP} probes in a '
          f'row during a step, which is cancelled; the error raised next names the task.'))
    except tf.errors.UnavailableError:
      coord.request_stop(sys.exc_info())
    try:
      session.close()  # cancels the step waiting in its all-reduce
    except Exception as e:  # pylint: disable=broad-except
      logs.warning('estimator_towers: closing the session after losing %s: %s', peer, e)


class _Probe:
  """An empty op on each peer task's host CPU, in a session of its own (`target`'s server)."""

  def __init__(self, target: str, peers: list, timeout_secs: float):
    self._graph = tf.Graph()
    with self._graph.as_default():
      self._ops = []
      for peer in peers:
        with tf.device(peer + '/device:CPU:0'):
          self._ops.append((peer, tf.no_op(name='probe')))
    config = tf.compat.v1.ConfigProto(device_filters=list(peers))
    self._target, self._config = target, config
    self._session = None
    self._options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_secs * 1000))

  def lost(self):
    """(peer, error) of the first peer that does not answer; None if all answer."""
    if self._session is None:
      self._session = tf.compat.v1.Session(self._target, graph=self._graph, config=self._config)
    for peer, op in self._ops:
      started = time.time()
      try:
        self._session.run(op, options=self._options)
      except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
              tf.errors.AbortedError, tf.errors.CancelledError,
              tf.errors.InternalError) as e:
        logs.info('estimator_towers: %s did not answer a probe after %.1f s: %s', peer,
                  time.time() - started, e.message.splitlines()[0] if e.message else e)
        return peer, e
    return None

  def close(self):
    if self._session is not None:
      try:
        self._session.close()
      except tf.errors.OpError:
        pass
