"""The input's position across the workers of a collective cluster.

Workers reading `global_batches` of a seeded shuffle, killed after a checkpoint
off an epoch boundary and resumed on 2 workers or on 1 worker x 2
micro-batches, equal the one-device model_fn trained without a break; the
chief's position travels to the workers as bytes through all-reduces (checked
in one process, two ranks on two devices). Workers reading each their own
`shard` of the data, killed after a checkpoint and resumed on 2 workers, equal
it too (every worker's position is in the chief's checkpoint); resumed on
another number of workers, they restore the variables and start their input
from its first element, with a warning. The clusters are
tests/test_collective.py's (`Cluster`: subprocesses on free loopback ports,
bounded in time, killed by their own pids).
"""

import glob
import os
import shutil
import time
import types

import numpy as np
import pytest
import tensorflow as tf

import collective_task
import testlib
import estimator_towers as et
from estimator_towers.cluster import cross_worker
from estimator_towers.inputs import position
from estimator_towers.inputs import worker_positions
from test_collective import Cluster
from test_collective import TogetherRuns
from test_collective import _spec

# 20 examples, global batches of 6 (3 rows a worker): the checkpoint at step 4 is 4 examples
# into the second epoch (a shuffle buffer mid-epoch, reshuffled per epoch), the end at 7.
POSITION_EXAMPLES, POSITION_BATCH, SHUFFLE_SEED = 20, 6, 7
KILLED_AT, RESUMED_TO = 4, 7
POSITION_PARAMS = {'learning_rate': 0.1}


def _examples(path, seed):
  """20 random examples of weight 1 (`xg`, `yg`, `wg`) at `path`."""
  rng = np.random.RandomState(seed)
  np.savez(path, xg=rng.randn(POSITION_EXAMPLES, testlib.NUM_FEATURES).astype(np.float32),
           yg=rng.randint(0, testlib.NUM_CLASSES, POSITION_EXAMPLES).astype(np.int32),
           wg=np.ones(POSITION_EXAMPLES, np.float32))


@pytest.fixture(scope='module')
def killed_after_a_checkpoint(tmp_path_factory):
  """2 workers x 2 towers of `random_draws_model_fn` (dropout and other keyed draws,
  Momentum) on global batches, both SIGKILLed once the chief has written its checkpoint of
  step 4 (each task waits after step 4 to be killed): (tmp, spec, a copy of checkpoint 4)."""
  tmp = tmp_path_factory.mktemp('killed')
  _examples(tmp / 'data.npz', seed=3)
  spec = _spec(tmp, 'random_draws', 2, global_batch=POSITION_BATCH, shuffle_seed=SHUFFLE_SEED,
               save_every=KILLED_AT, keep=0, max_steps=RESUMED_TO, block_at=KILLED_AT)
  return tmp, spec, _killed(tmp, spec)


@pytest.fixture(scope='module')
def uninterrupted(killed_after_a_checkpoint):
  """The one-device decorated model_fn trained to step 7 in one call on the same global
  batches, reading its input as Estimator does (resume_input=False): its variables."""
  tmp, spec, _ = killed_after_a_checkpoint
  one_device = et.replicate_model_fn(collective_task.random_draws_model_fn, devices=['/cpu:0'],
                                     resume_input=False)
  reference = testlib.make_estimator(one_device, model_dir=str(tmp / 'uninterrupted'),
                                     params=POSITION_PARAMS)
  reference.train(collective_task.global_input_fn(np.load(spec['data']), POSITION_BATCH,
                                                  SHUFFLE_SEED), max_steps=RESUMED_TO)
  # The same start as the cluster's (seeded initializers), so one call from scratch.
  testlib.assert_variables_close(
      testlib.checkpoint_variables(os.path.join(reference.model_dir, 'model.ckpt-0')),
      testlib.checkpoint_variables(os.path.join(spec['model_dir'], 'model.ckpt-0')), tol=0)
  expected = testlib.variables(reference)
  assert expected['global_step'] == RESUMED_TO
  return expected


@pytest.fixture(scope='module')
def restarted(request, tmp_path_factory):
  """The restarts on 2 workers from the checkpoint of step 4 of the selected tests' killed
  clusters (global batches: `killed_after_a_checkpoint`; shards: `shards_killed_after_a_
  checkpoint`, its tasks logging INFO), run one after another by one chief and one worker
  process (`TogetherRuns`: each its own cluster, ports and log): {fixture name: Cluster}."""
  wanted = [name for name in ('killed_after_a_checkpoint', 'shards_killed_after_a_checkpoint')
            if any(item.module is request.module and 'restarted' in item.fixturenames and
                   name in item.fixturenames for item in request.session.items)]
  clusters, fresh_starts = {}, {}
  for name in wanted:
    tmp, spec, _ = request.getfixturevalue(name)
    extra = {'log_info': True} if name.startswith('shards') else {}
    clusters[name] = Cluster(tmp, dict(spec, block_at=None, **extra))
    # A run again alone (`TogetherRuns`) starts from the killed cluster's model_dir.
    shutil.copytree(spec['model_dir'], tmp / 'model_when_killed')
    fresh_starts[name] = (lambda spec=spec, tmp=tmp: shutil.copytree(
        tmp / 'model_when_killed', spec['model_dir']))
  runs = TogetherRuns(clusters, fresh_starts=fresh_starts)
  started = time.time()
  runs.run(tmp_path_factory.mktemp('restarts'))
  print(f'{len(clusters)} clusters from step {KILLED_AT} to {RESUMED_TO}: '
        f'{time.time() - started:.1f} s')
  return runs


# The first test to ask runs every selected killed cluster and restart: its time limit is theirs.
@pytest.mark.timeout(900)
def test_two_workers_killed_mid_epoch_resume_as_one_uninterrupted_device(
    killed_after_a_checkpoint, uninterrupted, restarted):
  """Restarted on 2 workers from the checkpoint of step 4: the chief restores the input's
  position, each worker takes it from the chief; every variable and slot at step 7 equals
  the uninterrupted one-device run, and the worker's the chief's."""
  tmp, spec, _ = killed_after_a_checkpoint
  restarted.check('killed_after_a_checkpoint')
  for rank in (0, 1):
    assert (tmp / 'dump' / f'rank{rank}.npz.start').read_text() == str(KILLED_AT)
  chief = testlib.variables(testlib.make_estimator(collective_task.random_draws_model_fn,
                                                   model_dir=spec['model_dir']))
  assert chief['global_step'] == RESUMED_TO
  testlib.assert_variables_close(chief, uninterrupted)
  worker = np.load(tmp / 'dump' / 'rank1.npz')
  for name in chief:
    np.testing.assert_array_equal(worker[name], chief[name], err_msg=name)


@pytest.mark.timeout(240)
def test_two_workers_checkpoint_resumes_on_one_worker_of_two_micro_batches(
    killed_after_a_checkpoint, uninterrupted):
  """The 2-worker checkpoint of step 4 resumed in this process (no TF_CONFIG) on one
  device of 2 micro-batches, the same input_fn: at step 7 the uninterrupted run's
  variables and slots."""
  _, _, copy = killed_after_a_checkpoint
  towered = et.replicate_model_fn(collective_task.random_draws_model_fn, devices=['/cpu:0'],
                                  micro_batches=2)
  resumed = testlib.make_estimator(towered, model_dir=copy, params=POSITION_PARAMS)
  data = np.load(os.path.join(os.path.dirname(copy), 'data.npz'))
  resumed.train(collective_task.global_input_fn(data, POSITION_BATCH, SHUFFLE_SEED),
                max_steps=RESUMED_TO)
  testlib.assert_variables_close(testlib.variables(resumed), uninterrupted)


def _shard_stream(data, steps):
  """The global batches of `shard_input_fn` over `steps` steps (rank 0's rows, then rank
  1's): worker r's j-th example is the seeded shuffle's example 2j + r."""
  half = POSITION_BATCH // 2
  with tf.Graph().as_default():
    examples = tf.data.Dataset.from_tensor_slices(
        ({'x': data['xg'], 'w': data['wg']}, data['yg']))
    stream = examples.shuffle(len(data['yg']), seed=SHUFFLE_SEED).repeat().batch(
        2 * half * steps)
    with tf.compat.v1.Session() as session:
      (features, labels) = session.run(tf.compat.v1.data.make_one_shot_iterator(
          stream).get_next())
  order = np.concatenate([np.concatenate([np.arange(2 * half * s + r, 2 * half * (s + 1), 2)
                                          for r in (0, 1)]) for s in range(steps)])
  return ({k: v[order] for k, v in features.items()}, labels[order])


@pytest.fixture(scope='module')
def shards_killed_after_a_checkpoint(tmp_path_factory):
  """2 workers x 2 towers, each worker reading its own `shard` of a seeded shuffle (3 rows a
  step), both SIGKILLed during step 5, after the chief's checkpoint of step 4: (tmp, spec,
  a copy of checkpoint 4)."""
  tmp = tmp_path_factory.mktemp('shards')
  _examples(tmp / 'data.npz', seed=4)
  spec = _spec(tmp, 'random_draws', 2, shard_batch=POSITION_BATCH // 2,
               shuffle_seed=SHUFFLE_SEED, save_every=KILLED_AT, keep=0, max_steps=RESUMED_TO,
               block_at=KILLED_AT + 1)
  return tmp, spec, _killed(tmp, spec)


def _killed(tmp, spec):
  """Runs the cluster of `spec` until both tasks block, SIGKILLs it: a copy of checkpoint 4."""
  cluster = Cluster(tmp, spec)
  started = time.time()
  try:
    cluster.start('chief')
    cluster.start('worker')
    while not all((tmp / 'dump' / f'blocked{rank}').exists() for rank in (0, 1)):
      for task_type in ('chief', 'worker'):
        assert cluster.procs[task_type].poll() is None, cluster.log(task_type)[-3000:]
      assert time.time() < started + 300, cluster.log('chief')[-3000:]
      time.sleep(0.1)
  finally:
    cluster.kill()  # SIGKILL
  print(f'cluster to step {spec["block_at"]}: {time.time() - started:.1f} s')
  last = tf.train.latest_checkpoint(spec['model_dir'])
  assert last.endswith(f'model.ckpt-{KILLED_AT}'), last
  copy = tmp / 'at_checkpoint'
  copy.mkdir()
  for f in glob.glob(f'{last}.*'):
    shutil.copy(f, copy)
  (copy / 'checkpoint').write_text(f'model_checkpoint_path: "model.ckpt-{KILLED_AT}"\n')
  return str(copy)


@pytest.mark.timeout(400)
def test_workers_reading_their_own_shards_resume_as_one_uninterrupted_device(
    shards_killed_after_a_checkpoint, restarted):
  """Restarted on 2 workers from the checkpoint of step 4, which holds both workers'
  positions: at step 7 every variable and slot equals the one-device model_fn trained in
  one call on the global batches the shards make, and the worker's the chief's; the chief
  logs once what it resumed, each worker's position."""
  tmp, spec, _ = shards_killed_after_a_checkpoint
  restarted = restarted.check('shards_killed_after_a_checkpoint')
  for rank in (0, 1):
    assert (tmp / 'dump' / f'rank{rank}.npz.start').read_text() == str(KILLED_AT)
  # The chief's one INFO line: the checkpoint, its step, each worker's position.
  said = [l for l in restarted.log('chief').splitlines() if 'estimator_towers: resumed' in l]
  assert said == [
      f'INFO:absl:estimator_towers: resumed training from {spec["model_dir"]}/model.ckpt-'
      f'{KILLED_AT} (global step {KILLED_AT}) with the input position of step {KILLED_AT}: '
      'the chief (/job:chief/replica:0/task:0) reads on from its own position; worker 0 '
      '(/job:worker/replica:0/task:0) reads on from its own position.'], said
  assert 'estimator_towers: resumed' not in restarted.log('worker')
  features, labels = _shard_stream(np.load(spec['data']), RESUMED_TO)
  one_device = et.replicate_model_fn(collective_task.random_draws_model_fn, devices=['/cpu:0'],
                                     resume_input=False)
  reference = testlib.make_estimator(one_device, model_dir=str(tmp / 'uninterrupted'),
                                     params=POSITION_PARAMS)
  reference.train(lambda: tf.data.Dataset.from_tensor_slices((features, labels)).batch(
      POSITION_BATCH), max_steps=RESUMED_TO)
  testlib.assert_variables_close(
      testlib.checkpoint_variables(os.path.join(reference.model_dir, 'model.ckpt-0')),
      testlib.checkpoint_variables(os.path.join(spec['model_dir'], 'model.ckpt-0')), tol=0)
  chief = testlib.variables(testlib.make_estimator(collective_task.random_draws_model_fn,
                                                   model_dir=spec['model_dir']))
  assert chief['global_step'] == RESUMED_TO
  testlib.assert_variables_close(chief, testlib.variables(reference))
  worker = np.load(tmp / 'dump' / 'rank1.npz')
  for name in chief:
    np.testing.assert_array_equal(worker[name], chief[name], err_msg=name)


def test_shards_of_two_workers_restart_on_one_with_a_warning(shards_killed_after_a_checkpoint,
                                                              caplog):
  """The 2 workers' checkpoint resumed on one machine (the shard of 1 worker: the whole
  shuffle): the variables of step 4, and the input from its first element, with a
  warning that names the number of workers."""
  tmp, spec, copy = shards_killed_after_a_checkpoint
  towered = et.replicate_model_fn(collective_task.random_draws_model_fn, devices=['/cpu:0'])
  data = np.load(spec['data'])
  resumed = testlib.make_estimator(towered, model_dir=copy, params=POSITION_PARAMS)
  with caplog.at_level('WARNING'):
    resumed.train(collective_task.shard_input_fn(data, POSITION_BATCH, SHUFFLE_SEED),
                  max_steps=KILLED_AT + 1)
  assert 'the positions of 2 workers, each reading its own part' in caplog.text
  assert 'The input starts from its first element' in caplog.text
  assert testlib.variables(resumed)['global_step'] == KILLED_AT + 1


def _as_two_tasks(build):
  """build(across) for rank 0 and rank 1 of a 2-task cluster in this graph, on /cpu:0 and
  /cpu:1, with the same collective instance keys (as two processes would make them)."""
  graph = tf.compat.v1.get_default_graph()
  start = cross_worker.instance_key(graph)
  built = []
  for rank in (0, 1):
    cross_worker._next_key[graph] = start  # pylint: disable=protected-access
    task = types.SimpleNamespace(num_workers=2, rank=rank, device=f'/cpu:{rank}')
    built.append(build(cross_worker.CrossWorker(task, timeout_secs=30)))
  return built


TWO_CPUS = tf.compat.v1.ConfigProto(device_count={'CPU': 2})


def test_strings_travel_from_the_chief_as_bytes():
  """Every byte value, an empty string, zeros, 1001 random bytes: the worker gets the chief's
  strings exactly; only the chief makes them."""
  values = [bytes(range(256)), b'', b'\0' * 9, np.random.RandomState(0).bytes(1001)]
  made_on = []

  def build(across):
    def chiefs():
      made_on.append(across.rank)
      return [tf.constant(v) for v in values]
    return across.strings_from_chief(chiefs, len(values))

  with tf.Graph().as_default():
    both = _as_two_tasks(build)
    with tf.compat.v1.Session(config=TWO_CPUS) as session:
      chief, worker = session.run(both)
  assert made_on == [0]
  assert list(worker) == values and list(chief) == values


def test_a_worker_takes_the_chief_s_iterator_and_pending_batches():
  """The chief has read 5 global batches, of which 2 were handed out but not consumed
  (pending); a worker that had read elsewhere reads after the broadcast what the chief
  does next: the pending 2 then the iterator's, as the dataset itself gives them."""
  x = np.arange(40, dtype=np.float32).reshape(20, 2)
  y = np.arange(20, dtype=np.int32)

  def dataset():
    examples = tf.data.Dataset.from_tensor_slices(({'x': x}, y))
    return et.global_batches(examples.shuffle(20, seed=3).repeat(), 6)

  with tf.Graph().as_default():
    sources = []
    for rank in (0, 1):
      with tf.device(f'/cpu:{rank}'):
        ds = dataset()
        sources.append(position.Source(tf.data.experimental.to_variant(ds), ds.element_spec,
                                       'fingerprint', f'/cpu:{rank}', with_labels=True))
    chief, worker = sources
    expected_next = tf.compat.v1.data.make_one_shot_iterator(dataset()).get_next()
    pending = tf.compat.v1.placeholder(tf.string, [None, 2])
    set_pending = chief.replay_from(pending)
    components = [tf.compat.v1.placeholder(tf.float32), tf.compat.v1.placeholder(tf.int32)]
    serialized = [tf.io.serialize_tensor(c) for c in components]
    broadcast = _as_two_tasks(lambda across: sources[across.rank].broadcast_from_chief(across))
    reads = [s.get_next() for s in sources]
    with tf.compat.v1.Session(config=TWO_CPUS) as session:
      expected = [session.run(expected_next) for _ in range(8)]
      for source in sources:
        source.initialize(session)
      for _ in range(5):
        session.run(reads[0])
      session.run(reads[1])
      rows = [session.run(serialized, {components[0]: expected[i][0]['x'],
                                       components[1]: expected[i][1]}) for i in (3, 4)]
      session.run(set_pending, {pending: np.array(rows, dtype=object)})
      session.run(broadcast)
      assert worker.from_chief and not chief.from_chief
      worker.ensure(session)  # the session start's hook: the chief's position stays
      for i in range(3, 8):
        for read in reads:
          (features, labels) = session.run(read)
          np.testing.assert_array_equal(features['x'], expected[i][0]['x'], err_msg=str(i))
          np.testing.assert_array_equal(labels, expected[i][1], err_msg=str(i))


def test_every_worker_s_own_position_goes_to_the_chief_and_back():
  """Two workers each read their own shard; a gather brings both positions to the chief
  (what its checkpoint saves); after a restart each takes its own back from the chief and
  reads on where it left off. A slot of another dataset (fingerprint) is not taken: that
  worker reads from its first element, and says so (`taken`)."""
  x = np.arange(40, dtype=np.float32).reshape(20, 2)

  def dataset(rank):
    return tf.data.Dataset.from_tensor_slices({'x': x}).shuffle(20, seed=3).repeat().shard(
        2, rank).batch(3)

  def expected(rank, n):
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
      get_next = tf.compat.v1.data.make_one_shot_iterator(dataset(rank)).get_next()
      return [session.run(get_next)['x'] for _ in range(n)]

  def positions(fingerprints):
    sources = []
    for rank in (0, 1):
      with tf.device(f'/cpu:{rank}'):
        ds = dataset(rank)
        sources.append(position.Source(tf.data.experimental.to_variant(ds), ds.element_spec,
                                       fingerprints[rank], f'/cpu:{rank}', with_labels=False))
    built = _as_two_tasks(lambda across: worker_positions.WorkerPositions(
        sources[across.rank], across))
    take = _as_two_tasks(lambda across: built[across.rank].take_from_chief())
    return built, take, [s.get_next()['x'] for s in sources]

  with tf.Graph().as_default():
    built, _, reads = positions(['a', 'b'])
    gather = tf.group(*[p.gather_op for p in built])
    with tf.compat.v1.Session(config=TWO_CPUS) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      for p in built:
        p.initialize(session)
      for _ in range(2):
        session.run(reads[0])
      session.run(reads[1])
      session.run(gather)
      saved = session.run(built[0].ranks)
  for restart_fingerprints, taken in ((['a', 'b'], [1, 1]), (['a', 'c'], [1, 2])):
    with tf.Graph().as_default():
      built, take, reads = positions(restart_fingerprints)
      with tf.compat.v1.Session(config=TWO_CPUS) as session:
        session.run(tf.compat.v1.global_variables_initializer())
        for p in built:
          p.initialize(session)
        session.run(built[0].ranks.assign(saved))  # the chief's restore
        session.run(take)
        assert [session.run(p.taken) for p in built] == taken
        assert all(p.source.from_chief for p in built)
        for rank, read in enumerate(reads):
          start = (2, 1)[rank] if taken[rank] == worker_positions.TAKEN else 0
          for want in expected(rank, start + 3)[start:]:
            np.testing.assert_array_equal(session.run(read), want, err_msg=str(rank))
