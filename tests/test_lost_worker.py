"""A killed training task stops the others within seconds, while they step without pause.

2 tasks x 2 towers (virtual CPUs) on loopback, variable_strategy='collective',
worker_timeout_secs=60, no pause between steps: once the survivor has ended
a step, the worker (or the chief) is killed (SIGKILL) mid-training, or the
worker is frozen (SIGSTOP: its sockets stay open and nothing answers, as for
a machine gone without closing its connections), and the survivor must stop
well before the step timeout (`LOST_WITHIN` s). Its log, read as a user
reads it:

- one error names the lost task, by TF_CONFIG's name and its address (the
  library's and TensorFlow's Python lines; TensorFlow's C++ lines of the gRPC
  error name the remote task too, which the library does not print);
- no deprecation warning of the library's making: the library's own calls
  that TensorFlow calls deprecated are Estimator's (every part of
  Estimator is, and a plain Estimator program makes the same warnings).

A killed task's sockets are reset, which gRPC notices in the survivor's step; a
frozen task's are not, and without the probe of
`estimator_towers.cluster.peer_probe` the survivor waits for the whole step
timeout. Each task is a subprocess of this test, bounded in time, killed by
its own pid.
"""

import re
import signal
import time

import pytest

from test_collective import Cluster, _data, _spec
import testlib

TIMEOUT = 60
LOST_WITHIN = 15
# A line of Python's logging (LEVEL:logger:message) or an exception's last traceback line.
_PYTHON_ERROR = re.compile(r'^(?:(?:ERROR|WARNING|CRITICAL):[\w.]+:|\w+(?:Error|Exception): )')


@pytest.mark.timeout(180)
@pytest.mark.parametrize('killed, survivor, how', [
    ('worker', 'chief', signal.SIGKILL), ('chief', 'worker', signal.SIGKILL),
    ('worker', 'chief', signal.SIGSTOP)], ids=['worker_killed', 'chief_killed', 'worker_frozen'])
def test_a_killed_task_stops_the_other_within_seconds_while_stepping(tmp_path, killed,
                                                                     survivor, how):
  _data(tmp_path / 'data.npz', {0: 60000, 1: 60000})  # 10,000 steps: still training when killed
  spec = _spec(tmp_path, 'mean', 2, timeout=TIMEOUT, save_every=100000)
  cluster = Cluster(tmp_path, spec)
  rank = {'chief': 0, 'worker': 1}[survivor]
  try:
    cluster.start('chief')
    cluster.start('worker')
    deadline = time.time() + 120
    while not (tmp_path / 'dump' / f'rank{rank}.npz.stepped').exists():
      assert time.time() < deadline, cluster.log(survivor)[-3000:]
      for task_type in ('chief', 'worker'):
        assert cluster.procs[task_type].poll() is None, cluster.log(task_type)[-3000:]
      time.sleep(0.2)
    time.sleep(1)  # stepping
    assert cluster.procs[survivor].poll() is None, cluster.log(survivor)[-3000:]
    cluster.procs[killed].send_signal(how)
    killed_at = time.time()
    code = cluster.wait(survivor, TIMEOUT + 60)
    stopped = time.time() - killed_at
    print(f'{survivor} stopped {stopped:.1f} s after the {killed} got {how.name}')
  finally:
    cluster.kill()  # SIGKILL, a stopped process too
  log = cluster.log(survivor)
  assert code != 0
  name = {'chief': 'the chief', 'worker': 'worker 0'}[killed]
  address = cluster.cluster[killed][0]
  lost = ('is lost (no server answers there)' if how == signal.SIGKILL else
          'stopped answering (it did not answer 2 probes in a row during a step')
  assert f'{name} ({address}) {lost}' in log, log[-3000:]
  assert 'Restart the job: it resumes from the chief\'s last checkpoint' in log, log[-3000:]
  naming = [line for line in log.splitlines() if _PYTHON_ERROR.match(line)
            and (address in line or f'/job:{killed}/' in line or f'{name} (' in line)]
  assert len(naming) == 1 and naming[0].startswith('RuntimeError: '), naming
  assert stopped < LOST_WITHIN, stopped
  assert not testlib.library_deprecations(log), testlib.library_deprecations(log)
