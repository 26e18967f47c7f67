"""A collective cluster's task whose peer is lost: one error, naming the lost task.

The session's start is built in-process for a cluster of a chief and two
workers on loopback; which task is lost is set by which addresses have a
listening socket. The reference is the name TF_CONFIG gives the task
(`chief`, or `worker` and its index) and its address, written out here.
"""

import logging
import socket
import traceback

import pytest
import tensorflow as tf

from estimator_towers.cluster import cross_worker
from estimator_towers.cluster import session as cluster_session
from estimator_towers.cluster import tf_config as cluster_lib
from estimator_towers.inputs import resume


@pytest.fixture
def addresses():
  """Three loopback addresses: [0] and [1] accept connections, [2] does not."""
  listening = []
  for _ in range(2):
    s = socket.socket()
    s.bind(('127.0.0.1', 0))
    s.listen()
    listening.append(s)
  closed = socket.socket()
  closed.bind(('127.0.0.1', 0))
  port = closed.getsockname()[1]
  closed.close()
  yield [f'127.0.0.1:{s.getsockname()[1]}' for s in listening] + [f'127.0.0.1:{port}']
  for s in listening:
    s.close()


def cluster(chief: str, workers: list[str], task_type: str, index: int) -> cluster_lib.Cluster:
  return cluster_lib.Cluster({'chief': (chief,), 'worker': tuple(workers)}, task_type, index)


def started_scaffold(task: cluster_lib.Cluster, steps: int, progress=None):
  """The Scaffold of `task`'s session, in a graph of one variable; `steps` steps run."""
  progress = progress or cluster_session._Progress()  # pylint: disable=protected-access
  progress.steps, progress.begun = steps, steps > 0
  tf.compat.v1.get_variable('w', [2], initializer=tf.compat.v1.zeros_initializer())
  return cluster_session.scaffold(None, cross_worker.CrossWorker(task, timeout_secs=5), progress)


def test_a_dead_chief_is_named_in_a_workers_error(addresses):
  alive, other, dead = addresses
  with tf.Graph().as_default():
    built = started_scaffold(cluster(dead, [alive, other], 'worker', 0), steps=3)
    with pytest.raises(RuntimeError) as raised:
      built.finalize()
  message = str(raised.value)
  assert f'the chief ({dead}) is lost' in message, message
  assert 'worker 0 (/job:worker/replica:0/task:0/device:CPU:0, rank 1 of 3' in message
  assert 'after 3 step(s)' in message and 'Restart the job' in message
  assert 'worker 1' not in message


def test_a_dead_worker_is_named_by_its_index_in_the_chiefs_error(addresses):
  alive, other, dead = addresses
  task = cluster(alive, [other, dead], 'chief', 0)
  assert cluster_session.unreachable_tasks(task) == [f'worker 1 ({dead})']
  message = cluster_session.lost_task_message(task, 5, [f'worker 1 ({dead})'])
  assert message.startswith('estimator_towers: the chief (/job:chief/replica:0/task:0/'
                            'device:CPU:0, rank 0 of 3 training tasks) failed a training '
                            f'step after 5 step(s): worker 1 ({dead}) is lost'), message


def test_the_error_is_raised_once_in_python_before_any_op_runs(addresses):
  alive, other, dead = addresses
  progress = cluster_session._Progress()  # pylint: disable=protected-access
  with tf.Graph().as_default() as graph:
    built = started_scaffold(cluster(dead, [alive, other], 'worker', 0), 0, progress)
    # As Estimator gets it: with the input's position (inputs.resume), a copy of it.
    built = resume._scaffold(built, None, built.local_init_op)  # pylint: disable=protected-access
    assert built.finalize() is built   # the first session starts
    progress.steps, progress.begun = 1, True  # a step ran: the session is being recreated
    with pytest.raises(RuntimeError) as raised:
      built.finalize()
    assert not [op for op in graph.get_operations() if 'PyFunc' in op.type]
  text = ''.join(traceback.format_exception(raised.value))
  assert text.count(f'the chief ({dead}) is lost') == 1, text
  assert 'UnknownError' not in text


def test_building_the_session_start_emits_no_deprecation_warning(addresses, caplog,
                                                                 monkeypatch, recwarn):
  from tensorflow.python.util import deprecation  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(deprecation, '_PRINTED_WARNING', {})  # TF warns once per process
  alive, other, _ = addresses
  with caplog.at_level(logging.WARNING), tf.Graph().as_default():
    started_scaffold(cluster(alive, [other], 'worker', 0), steps=0)
  said = [r.getMessage() for r in caplog.records] + [str(w.message) for w in recwarn]
  ours = [m for m in said if 'deprecat' in m.lower() and 'estimator_towers' in m]
  assert not ours, ours


def test_a_first_step_that_fails_stops_the_session_start_too(addresses):
  """The peer lost during this task's first step: no step ended, one began (the hook's
  before_run, no after_run); the recreated session raises instead of starting again."""
  alive, other, dead = addresses
  task = cluster(dead, [alive, other], 'worker', 0)
  progress = cluster_session._Progress()  # pylint: disable=protected-access
  with tf.Graph().as_default():
    built = started_scaffold(task, 0, progress)
    assert built.finalize() is built
    hook = cluster_session.StepTimeoutHook(60, task, progress)
    hook.before_run(None)  # the first step fails: after_run never comes
    with pytest.raises(RuntimeError, match=r'after 0 step\(s\): the chief \(.*\) is lost'):
      built.finalize()
  assert not progress.timer.is_alive() or progress.timer.finished.is_set()


def test_a_task_the_probe_found_lost_is_named_by_its_index_and_address(addresses):
  """Every address accepts connections (a hung task): the probe's finding names it."""
  alive, other, _ = addresses
  task = cluster(alive, [other, alive], 'chief', 0)
  progress = cluster_session._Progress()  # pylint: disable=protected-access
  progress.steps, progress.begun = 4, True
  progress.lost.append('/job:worker/replica:0/task:1')
  with tf.Graph().as_default():
    built = started_scaffold(task, 4, progress)
    with pytest.raises(RuntimeError) as raised:
      built.finalize()
  message = str(raised.value)
  assert (f'after 4 step(s): worker 1 ({alive}) stopped answering (it did not answer 2 probes '
          'in a row during a step') in message, message
  assert 'worker 0' not in message
