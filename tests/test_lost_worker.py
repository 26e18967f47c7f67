"""A killed training task stops the others within seconds, while they step without pause.

2 tasks x 2 towers (virtual CPUs) on loopback, variable_strategy='collective',
worker_timeout_secs=60, no pause between steps: the worker (or the chief) is
killed (SIGKILL) mid-training, and the survivor must stop well before the step
timeout (`LOST_WITHIN` s), with an error naming the lost task and the fix.
Without the probe of `estimator_towers.cluster.peer_probe` the survivor waited
for the whole step timeout. Each task is a subprocess of this test, bounded in
time, killed by its own pid.
"""

import time

import pytest

from test_collective import Cluster, _data, _spec

TIMEOUT = 60
LOST_WITHIN = 15


@pytest.mark.timeout(180)
@pytest.mark.parametrize('killed, survivor', [('worker', 'chief'), ('chief', 'worker')])
def test_a_killed_task_stops_the_other_within_seconds_while_stepping(tmp_path, killed,
                                                                     survivor):
  _data(tmp_path / 'data.npz', {0: 60000, 1: 60000})  # 10,000 steps: still training when killed
  spec = _spec(tmp_path, 'mean', 2, timeout=TIMEOUT, save_every=100000)
  cluster = Cluster(tmp_path, spec)
  rank = {'chief': 0, 'worker': 1}[survivor]
  try:
    cluster.start('chief')
    cluster.start('worker')
    deadline = time.time() + 120
    while not (tmp_path / 'dump' / f'rank{rank}.npz.start').exists():
      assert time.time() < deadline, cluster.log(survivor)[-3000:]
      for task_type in ('chief', 'worker'):
        assert cluster.procs[task_type].poll() is None, cluster.log(task_type)[-3000:]
      time.sleep(0.2)
    time.sleep(2)  # stepping
    assert cluster.procs[survivor].poll() is None, cluster.log(survivor)[-3000:]
    cluster.procs[killed].kill()
    killed_at = time.time()
    code = cluster.wait(survivor, TIMEOUT + 60)
    stopped = time.time() - killed_at
    print(f'{survivor} stopped {stopped:.1f} s after the {killed} was killed')
  finally:
    cluster.kill()
  log = cluster.log(survivor)
  assert code != 0
  lost = f'/job:{killed}/replica:0/task:0'
  # What notices first: the probe (which names the lost task), or, when a step's all-reduce
  # had a call to the lost task open, gRPC itself (UnavailableError naming the remote task).
  assert (f'lost the training task {lost}: it did not answer 2 probes in a row during a step'
          in log or f'from remote target {lost}' in log), log[-3000:]
  assert 'Restart the job: it resumes from the chief\'s last checkpoint' in log, log[-3000:]
  assert stopped < LOST_WITHIN, stopped
