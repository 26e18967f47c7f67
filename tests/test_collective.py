"""variable_strategy='collective': several machines (processes on loopback), one update.

The reference is the plain single-device model_fn trained on the global
batches (the union of the workers' batches of each step) from the chief's
first checkpoint (with random draws: the model_fn decorated for one device,
whose keyed draws every layout must draw); every worker's variables must be
bit-equal to the chief's.
Each cluster is a set of subprocesses (tests/collective_task.py) with free
127.0.0.1 ports, bounded in time, killed by their own pids. The two-worker
training clusters run one after another in one process per task
(tests/collective_scenarios_task.py, `TogetherRuns`): each still its own
cluster, ports, directory and log, TensorFlow imported once for all of them.

The input's position across workers: tests/test_collective_position.py.
"""

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import collective_task
import testlib
import estimator_towers as et
from estimator_towers.cluster import cross_worker
from estimator_towers.cluster import servers as cross_worker_servers
from estimator_towers.cluster import tf_config as cluster_lib

BATCH = 6
SIZES = {0: 30, 1: 14}  # the worker's input ends after 3 of the chief's 5 batches
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'collective_task.py')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What a task's log says when its gRPC server could not bind its port.
_PORT_TAKEN = 'Address already in use'


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _data(path, sizes, seed=0):
  rng = np.random.RandomState(seed)
  data = {}
  for r, n in list(sizes.items()) + [('e', 9)]:
    data[f'x{r}'] = rng.randn(n, testlib.NUM_FEATURES).astype(np.float32)
    data[f'y{r}'] = rng.randint(0, testlib.NUM_CLASSES, n).astype(np.int32)
    data[f'w{r}'] = (rng.rand(n) < 0.6).astype(np.float32)
  data['w0'][:BATCH] = 0.0  # the chief's first batch has no tokens
  np.savez(path, **data)
  return {k: data[k] for k in data}


class Cluster:
  """The tasks of one TF_CONFIG cluster, as subprocesses of this test."""

  def __init__(self, tmp_path, spec, evaluator=False):
    self.tmp_path = tmp_path
    self.spec_path = str(tmp_path / 'spec.json')
    with open(self.spec_path, 'w') as f:
      json.dump(spec, f)
    self.cluster = {'chief': [f'127.0.0.1:{_free_port()}'],
                    'worker': [f'127.0.0.1:{_free_port()}']}
    self.tasks = [('chief', 0), ('worker', 0)] + ([('evaluator', 0)] if evaluator else [])
    self.procs = {}

  def tf_config(self, task_type, index=0):
    return {'cluster': self.cluster, 'task': {'type': task_type, 'index': index}}

  def start(self, task_type, index=0):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='', PYTHONPATH=ROOT,
               TF_CONFIG=json.dumps(self.tf_config(task_type, index)))
    log = open(self.tmp_path / f'{task_type}{index}.log', 'wb')
    self.procs[task_type] = subprocess.Popen([sys.executable, SCRIPT, self.spec_path], env=env,
                                             stdout=log, stderr=subprocess.STDOUT)

  def log(self, task_type):
    path = self.tmp_path / f'{task_type}0.log'
    return path.read_text(errors='replace') if path.exists() else f'(no {path})'

  def wait(self, task_type, timeout):
    try:
      return self.procs[task_type].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      self.kill()
      raise AssertionError(f'{task_type} did not finish within {timeout} s:\n'
                           + self.log(task_type)[-3000:])

  def kill(self):
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()

  def run(self, timeout=150):
    """Runs every task to its end; once more on fresh ports if a server could not bind its
    port (another process took it between `_free_port` and the task's start)."""
    for attempt in range(2):
      codes = {}
      try:
        for task_type, index in self.tasks:
          self.start(task_type, index)
        for task_type, _ in self.tasks:
          codes[task_type] = self.wait(task_type, timeout)
          if codes[task_type] != 0:
            break
      finally:
        self.kill()
      failed = [t for t, code in codes.items() if code != 0]
      if attempt or not failed or not self.port_taken():
        break
      self.cluster = {t: [f'127.0.0.1:{_free_port()}'] for t in self.cluster}
    for task_type, code in codes.items():
      assert code == 0, f'{task_type} exited with {code}:\n' + self.report(task_type)

  def port_taken(self) -> bool:
    """Whether a task's server could not bind its port (any task's: the others then time
    out waiting for it, and fail first)."""
    return any(_PORT_TAKEN in self.log(task_type) for task_type, _ in self.tasks)

  def report(self, failed):
    """The failed task's log's end, and every task's error lines (a task's own error is
    often far above its log's end, under the op's creation stack)."""
    lines = [f'{task_type}: {line}' for task_type, _ in self.tasks
             for line in self.log(task_type).splitlines()
             if re.match(r'^[\w.]*(Error|Exception|Exceeded)\b', line)]
    return self.log(failed)[-2000:] + '\nerror lines of every task:\n' + '\n'.join(lines[-20:])


RUNS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           'collective_scenarios_task.py')


class TogetherRuns:
  """Clusters run one after another by one process per task type
  (tests/collective_scenarios_task.py): each task process imports TensorFlow once for all
  of them (most of a two-task cluster's CPU when each had processes of its own). Each run
  keeps its own cluster (ports), directory, spec and per-task log, and its tasks' exit status
  (`check`). A run that failed because a port was taken, or that followed a failed run (its
  tasks may have been out of step), runs again alone from a fresh start (`Cluster.run`, fresh
  ports): a failure that stays is the run's own."""

  def __init__(self, clusters, timeout_per_run=150, fresh_starts=None):
    self.clusters = clusters  # {key: Cluster}, run in this order
    self.timeout = timeout_per_run * max(len(clusters), 1)
    self.failures = {}  # {key: why}
    # {key: a callable that puts the run's model_dir back as it was before the run}; by
    # default a run's fresh start is an empty model_dir.
    self.fresh_starts = fresh_starts or {}

  def run(self, tmp):
    plans = {}
    for task_type in ('chief', 'worker', 'evaluator'):
      plan = [{'spec': c.spec_path,
               'tf_config': c.tf_config(task_type) if (task_type, 0) in c.tasks else None}
              for c in self.clusters.values()]
      if any(run['tf_config'] for run in plan):
        plans[task_type] = plan
    procs = {}
    try:
      for task_type, plan in plans.items():
        with open(tmp / f'{task_type}.plan.json', 'w') as f:
          json.dump(plan, f)
        log = open(tmp / f'{task_type}.log', 'wb')
        procs[task_type] = subprocess.Popen(
            [sys.executable, RUNS_SCRIPT, task_type, str(tmp / f'{task_type}.plan.json')],
            env=dict(os.environ, CUDA_VISIBLE_DEVICES='', PYTHONPATH=ROOT),
            stdout=log, stderr=subprocess.STDOUT)
      deadline = time.time() + self.timeout
      for proc in procs.values():
        try:
          proc.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
          break
    finally:
      for proc in procs.values():
        if proc.poll() is None:
          proc.kill()
          proc.wait()
    earlier_failed = False
    for key, cluster in self.clusters.items():
      why = self._failure(cluster, tmp)
      # A run after a failed one may have failed of it (its tasks then out of step): alone.
      if why and (cluster.port_taken() or earlier_failed):
        earlier_failed = True
        with open(cluster.spec_path) as f:
          spec = json.load(f)
        shutil.rmtree(spec['model_dir'], ignore_errors=True)  # a fresh start
        if key in self.fresh_starts:
          self.fresh_starts[key]()
        for name in os.listdir(spec['dump']):
          os.remove(os.path.join(spec['dump'], name))
        try:
          cluster.run()
          why = None
        except AssertionError as e:
          why = str(e)
      elif why:
        earlier_failed = True
      if why:
        self.failures[key] = why

  def _failure(self, cluster, tmp):
    """Why `cluster`'s run failed (None: every task ended with 0)."""
    for task_type, _ in cluster.tasks:
      status = cluster.tmp_path / f'{task_type}0.status'
      if not status.exists():
        process_log = (tmp / f'{task_type}.log').read_text(errors='replace')
        return (f'{task_type} did not end its run within {self.timeout} s (all runs):\n'
                + process_log[-2000:] + '\n' + cluster.log(task_type)[-3000:])
      if status.read_text() != '0':
        return f'{task_type} failed:\n' + cluster.log(task_type)[-3000:]
    return None

  def check(self, key):
    assert key not in self.failures, self.failures[key]
    return self.clusters[key]


def _global_batches(data, sizes, batch=BATCH):
  per_rank = []
  for r in sizes:
    x, y, w = data[f'x{r}'], data[f'y{r}'], data[f'w{r}']
    per_rank.append([(x[i:i + batch], y[i:i + batch], w[i:i + batch])
                     for i in range(0, len(x), batch)])
  steps = max(len(p) for p in per_rank)
  return [tuple(np.concatenate([p[t][i] for p in per_rank if t < len(p)]) for i in range(3))
          for t in range(steps)]


def _batches_input_fn(batches):
  def fn():
    def gen():
      for x, y, w in batches:
        yield {'x': x, 'w': w}, y
    return tf.data.Dataset.from_generator(gen, output_signature=(
        {'x': tf.TensorSpec([None, testlib.NUM_FEATURES], tf.float32),
         'w': tf.TensorSpec([None], tf.float32)},
        tf.TensorSpec([None], tf.int32)))
  return fn


def _plain_from(model_dir, checkpoint, model_fn, params, tmp_path, num_cpus=1, **config_kwargs):
  """A plain (or `num_cpus`) Estimator whose model_dir starts at `checkpoint` of `model_dir`;
  `config_kwargs`: RunConfig's."""
  plain_dir = tmp_path / 'plain'
  plain_dir.mkdir()
  for f in glob.glob(os.path.join(model_dir, f'{checkpoint}.*')):
    shutil.copy(f, plain_dir)
  (plain_dir / 'checkpoint').write_text(f'model_checkpoint_path: "{checkpoint}"\n')
  config_kwargs.setdefault('checkpoint_save_graph_def', False)  # no test reads them
  return testlib.make_estimator(model_fn, num_cpus, model_dir=str(plain_dir), params=params,
                                **config_kwargs)


def _spec(tmp_path, model, towers, micro_batches=1, **extra):
  (tmp_path / 'dump').mkdir(exist_ok=True)
  spec = dict(model_dir=str(tmp_path / 'model'), data=str(tmp_path / 'data.npz'),
              model=model, towers=towers, micro_batches=micro_batches, batch=BATCH,
              timeout=60, dump=str(tmp_path / 'dump'), learning_rate=0.1)
  spec.update(extra)
  return spec


# The two-worker training runs below, each a cluster of its own, are run one after another by
# one chief and one worker process (`together`, `TogetherRuns`): a run's spec, its data's sizes
# and whether an evaluator joins it, by key.
TWO_WORKERS = [
    ('mean', 1, True),        # plain gradient descent on a mean; an evaluator
    ('bert', 2, False),       # a token-weighted ratio + a mean + an L2 penalty (one
                              # machine's two_terms), BERT's AdamWeightDecay, micro-batches,
                              # features only (the labels a feature), as BERT is fed
]
CROSS_EXAMPLE = [('clip_weighted', 1), ('mixup', 1), ('attention', 1), ('clip', 2),
                 ('batch_reductions', 1)]  # a batch top-k's head is CLIP's: on one machine only
# The chief's input ends first: the worker's rows start after the chief's 6, then its 2, then 0.
CHIEF_ENDS_FIRST = {0: 14, 1: 30}
# Two global batches of 12: each worker's 6, then 6.
TWO_STEPS = {0: 12, 1: 12}
# Without synchronised batch norm: smaller batches (4 towers' shards while both have data).
BN_UNSYNCED_SIZES, BN_UNSYNCED_BATCH = {0: 8, 1: 16}, 4


def _run_sizes(key):
  return {'random_draws': CHIEF_ENDS_FIRST, 'loop_draws': TWO_STEPS,
          'bn_False': BN_UNSYNCED_SIZES}.get(key, SIZES)


def _run_spec(key, tmp):
  """(spec, evaluator) of the run `key`, its data written in `tmp`."""
  data = _data(tmp / 'data.npz', _run_sizes(key))
  batches = _global_batches(data, _run_sizes(key))
  for model, micro_batches, evaluator in TWO_WORKERS:
    if key == f'two_workers_{model}':
      return _spec(tmp, model, 2, micro_batches, max_steps=len(batches) if evaluator else None,
                   features_only=model == 'bert'), evaluator
  for model, micro_batches in CROSS_EXAMPLE:
    if key == f'cross_example_{model}':
      return _spec(tmp, model, 2, micro_batches), False
  if key == 'random_draws':
    return _spec(tmp, 'random_draws', 2, save_every=1, keep=0), False
  if key == 'loop_draws':
    return _spec(tmp, 'recurrent_dropout', 2, save_every=1, keep=0), False
  if key in ('bn_True', 'bn_False'):
    sync = key == 'bn_True'
    return _spec(tmp, 'bn', 2, batch=BATCH if sync else BN_UNSYNCED_BATCH,
                 sync_batch_norm=sync), False
  if key == 'finetune':
    return _spec(tmp, 'finetune', 2, pretrained=_pretrained(tmp, batches)), False
  raise KeyError(key)


# Each test that checks a run: its key from its parameters.
RUN_KEYS = {
    'test_two_workers_of_two_towers_train_as_plain_on_the_global_batches':
        lambda p: f"two_workers_{p['model']}",
    'test_cross_example_losses_across_two_workers_of_two_towers':
        lambda p: f"cross_example_{p['model']}",
    'test_random_draws_across_two_workers_of_two_towers_equal_one_device':
        lambda p: 'random_draws',
    'test_loop_draws_across_two_workers_of_two_towers': lambda p: 'loop_draws',
    'test_batch_norm_across_workers_trains_as_on_one_machine': lambda p: f"bn_{p['sync']}",
    'test_warm_starts_across_two_workers_of_two_towers_train_as_plain': lambda p: 'finetune',
}


def _run_key(item):
  callspec = getattr(item, 'callspec', None)
  return RUN_KEYS[item.originalname](callspec.params if callspec else {})


class _Together:
  """The runs of the selected tests, run together at the first test that asks."""

  def __init__(self, items, tmp_path_factory):
    self._keys = list(dict.fromkeys(_run_key(item) for item in items))
    self._factory = tmp_path_factory
    self._runs = None

  def run_of(self, item):
    """(the Cluster of `item`'s run, its data) once every selected run has ended."""
    if self._runs is None:
      clusters = {}
      for key in self._keys:
        tmp = self._factory.mktemp(key)
        spec, evaluator = _run_spec(key, tmp)
        clusters[key] = Cluster(tmp, spec, evaluator=evaluator)
      self._runs = TogetherRuns(clusters)
      started = time.time()
      self._runs.run(self._factory.mktemp('together'))
      print(f'{len(clusters)} clusters: {time.time() - started:.1f} s')
    cluster = self._runs.check(_run_key(item))
    return cluster, dict(np.load(cluster.tmp_path / 'data.npz'))


@pytest.fixture(scope='module')
def together(request, tmp_path_factory):
  items = [item for item in request.session.items
           if item.module is request.module and getattr(item, 'originalname', None) in RUN_KEYS]
  return _Together(items, tmp_path_factory)


# The first test to ask runs them all: its time limit is theirs.
TOGETHER_TIMEOUT = 1800


@pytest.mark.timeout(TOGETHER_TIMEOUT)
@pytest.mark.parametrize('model, micro_batches, evaluator', TWO_WORKERS)
def test_two_workers_of_two_towers_train_as_plain_on_the_global_batches(
    tmp_path, together, request, model, micro_batches, evaluator):
  del micro_batches  # the run's
  cluster, data = together.run_of(request.node)
  run_dir = cluster.tmp_path
  batches = _global_batches(data, SIZES)
  with open(cluster.spec_path) as f:
    spec = json.load(f)

  params = {'learning_rate': 0.1}
  model_fn = collective_task.MODELS[model]
  chief, expected = _chief_against_plain(tmp_path, spec, model, batches)
  first = tf.train.load_checkpoint(os.path.join(spec['model_dir'], 'model.ckpt-0'))
  moved = max(np.max(np.abs(first.get_tensor(n) - expected[n])) for n in expected
              if n != 'global_step')
  assert moved > 1e-2, moved  # training moved the weights far more than the tolerance
  _assert_workers_equal_the_chief(run_dir, chief, SIZES)
  if evaluator:
    with open(run_dir / 'dump' / 'eval.json') as f:
      reported = json.load(f)
    data_e = np.load(run_dir / 'data.npz')
    eval_fn = collective_task.input_fn(data_e, 'e', BATCH)
    final = testlib.make_estimator(model_fn, model_dir=spec['model_dir'], params=params)
    plain_metrics = final.evaluate(eval_fn)
    assert reported['global_step'] == len(batches)
    for key in ('loss', 'accuracy', 'mean_logit'):
      testlib.assert_close(reported[key], plain_metrics[key], err_msg=key)


@pytest.mark.timeout(TOGETHER_TIMEOUT)
@pytest.mark.parametrize('model, micro_batches', CROSS_EXAMPLE)
def test_cross_example_losses_across_two_workers_of_two_towers(tmp_path, together, request,
                                                               model, micro_batches):
  """Issue 33: an in-batch softmax with a trained temperature (and a trained weight of its
  two terms), a batch top-k: the head on the cluster's rows (all-gathered in rank order; CLIP's
  row-wise, each worker its own rows against the cluster's columns; the worker's input ends
  first, so the global batches are 12, 12, 8, 6, 6), every worker's rows and gradients exact.
  Mixup: its input stage on the cluster's rows, each tower reading its own. Attention: a sync
  point on the cluster's hidden rows, their gradient summed over the workers. Batch
  reductions: a max, a min, an arg-max's row and a logsumexp over the cluster's batch.
  With micro-batches the head reads a first pass's rows, gathered across the workers once
  per step."""
  del micro_batches  # the run's
  cluster, data = together.run_of(request.node)
  batches = _global_batches(data, SIZES)
  with open(cluster.spec_path) as f:
    spec = json.load(f)
  chief, _ = _chief_against_plain(tmp_path, spec, model, batches)
  _assert_workers_equal_the_chief(cluster.tmp_path, chief, SIZES)


def _chief_against_plain(tmp_path, spec, model, batches):
  """The chief's variables, checked against plain trained on the global `batches` from the
  chief's first checkpoint; (chief's, plain's)."""
  model_fn = collective_task.MODELS[model]
  plain = _plain_from(spec['model_dir'], 'model.ckpt-0', model_fn, {'learning_rate': 0.1},
                      tmp_path)
  plain.train(_batches_input_fn(batches), steps=len(batches))
  expected = testlib.variables(plain)
  chief = testlib.variables(testlib.make_estimator(model_fn, model_dir=spec['model_dir']))
  assert chief['global_step'] == len(batches) == 5  # one step per global batch
  testlib.assert_variables_close(chief, expected)
  return chief, expected


def _assert_workers_equal_the_chief(tmp_path, chief, sizes):
  """Every rank's variables are the chief's, and it counted every rank's examples."""
  for rank in sizes:
    # ThroughputHook's examples/sec counts the global batch (all workers)
    examples = (tmp_path / 'dump' / f'rank{rank}.npz.examples').read_text()
    assert int(examples) == sum(sizes.values()), rank
    values = np.load(tmp_path / 'dump' / f'rank{rank}.npz')
    assert sorted(values.files) == sorted(chief), rank
    for name in chief:
      np.testing.assert_array_equal(values[name], chief[name], err_msg=f'rank {rank} {name}')


@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_random_draws_across_two_workers_of_two_towers_equal_one_device(tmp_path, together,
                                                                        request):
  """Keyed draws (every common kind: `collective_task.random_draws_model_fn`) on 2
  workers x 2 towers draw what the model_fn decorated for one device draws on the global
  batches, each worker's rows at their global positions (the chief's input ends after 3
  steps: the batches are 12, 12, 8, 6, 6, the worker's rows after 6, 6, 2, 0, 0 of the
  chief's): every variable and slot after steps 1, 3 and 5 (the chief's checkpoint of every
  step, all kept)."""
  cluster, data = together.run_of(request.node)
  batches = _global_batches(data, CHIEF_ENDS_FIRST)
  with open(cluster.spec_path) as f:
    spec = json.load(f)
  one_device = et.replicate_model_fn(collective_task.random_draws_model_fn, devices=['/cpu:0'])
  reference = _plain_from(spec['model_dir'], 'model.ckpt-0', one_device,
                          {'learning_rate': 0.1}, tmp_path, save_checkpoints_steps=1,
                          keep_checkpoint_max=0)
  reference.train(_batches_input_fn(batches), steps=len(batches))
  for step in (1, 3, len(batches)):
    checkpoint = f'model.ckpt-{step}'
    testlib.assert_variables_close(
        testlib.checkpoint_variables(os.path.join(spec['model_dir'], checkpoint)),
        testlib.checkpoint_variables(os.path.join(reference.model_dir, checkpoint)))
  chief = testlib.variables(testlib.make_estimator(collective_task.random_draws_model_fn,
                                                   model_dir=spec['model_dir']))
  assert chief['global_step'] == len(batches) == 5
  _assert_workers_equal_the_chief(cluster.tmp_path, chief, CHIEF_ENDS_FIRST)


@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_loop_draws_across_two_workers_of_two_towers(tmp_path, together, request):
  """An LSTM's input, state and output dropout in `dynamic_rnn` (draws inside its while loop,
  keyed by the iteration too: `draws/loop_keys.py`) on 2 workers x 2 towers draw what the model_fn
  decorated for one device draws on the global batches: every variable and slot after
  steps 1 and 2, and every worker holds the chief's."""
  cluster, data = together.run_of(request.node)
  batches = _global_batches(data, TWO_STEPS)
  with open(cluster.spec_path) as f:
    spec = json.load(f)
  model_fn = collective_task.recurrent_dropout_model_fn
  reference = _plain_from(spec['model_dir'], 'model.ckpt-0',
                          et.replicate_model_fn(model_fn, devices=['/cpu:0']),
                          {'learning_rate': 0.1}, tmp_path, save_checkpoints_steps=1,
                          keep_checkpoint_max=0)
  reference.train(_batches_input_fn(batches), steps=len(batches))
  for step in (1, len(batches)):
    checkpoint = f'model.ckpt-{step}'
    testlib.assert_variables_close(
        testlib.checkpoint_variables(os.path.join(spec['model_dir'], checkpoint)),
        testlib.checkpoint_variables(os.path.join(reference.model_dir, checkpoint)))
  chief = testlib.variables(testlib.make_estimator(model_fn, model_dir=spec['model_dir']))
  assert chief['global_step'] == len(batches) == 2
  _assert_workers_equal_the_chief(cluster.tmp_path, chief, TWO_STEPS)


@pytest.mark.timeout(TOGETHER_TIMEOUT)
@pytest.mark.parametrize('sync', [True, False])
def test_batch_norm_across_workers_trains_as_on_one_machine(tmp_path, together, request, sync):
  """Batch norm, its moving averages (UPDATE_OPS) and a static loss scale across workers.

  sync_batch_norm: plain on the global batches (statistics of the global batch,
  the worker's input ending first). Without it: the same towered model_fn on
  one machine (per-shard statistics, moving averages from the first shard)
  with the same shards: 4 towers while both workers have data, then 2 once
  the chief's input has ended (the moving averages are then the worker's).
  """
  sizes, batch = (SIZES, BATCH) if sync else (BN_UNSYNCED_SIZES, BN_UNSYNCED_BATCH)
  cluster, data = together.run_of(request.node)
  batches = _global_batches(data, sizes, batch)
  with open(cluster.spec_path) as f:
    spec = json.load(f)

  params = {'learning_rate': 0.1}
  model_fn = collective_task.bn_model_fn
  if sync:
    plain = _plain_from(spec['model_dir'], 'model.ckpt-0', model_fn, params, tmp_path)
    plain.train(_batches_input_fn(batches), steps=len(batches))
  else:
    both = 2  # steps in which both workers have data
    plain = _plain_from(spec['model_dir'], 'model.ckpt-0', et.replicate_model_fn(
        model_fn, devices=testlib.cpu_devices(4), sync_batch_norm=False), params, tmp_path,
        num_cpus=4)
    plain.train(_batches_input_fn(batches[:both]), steps=both)
    plain = testlib.make_estimator(
        et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(2), sync_batch_norm=False),
        2, model_dir=plain.model_dir, params=params)
    plain.train(_batches_input_fn(batches[both:]), steps=len(batches) - both)
  expected = testlib.variables(plain)
  chief = testlib.variables(testlib.make_estimator(model_fn, model_dir=spec['model_dir']))
  assert chief['global_step'] == len(batches)
  testlib.assert_variables_close(chief, expected)
  averages = [n for n in chief if 'moving_' in n]
  assert len(averages) == 4, sorted(chief)
  first = tf.train.load_checkpoint(os.path.join(spec['model_dir'], 'model.ckpt-0'))
  for name in averages:  # they moved (the second layer's mean: of tanh of normalised pairs, 0)
    if name != 'batch_normalization_1/moving_mean':
      assert np.max(np.abs(first.get_tensor(name) - chief[name])) > 1e-2, name
  _assert_workers_equal_the_chief(cluster.tmp_path, chief, sizes)


@pytest.mark.timeout(240)
def test_a_dead_worker_stops_the_chief_within_the_timeout_and_a_restart_resumes(tmp_path):
  sizes = {0: 600, 1: 600}
  _data(tmp_path / 'data.npz', sizes)
  timeout = 8
  spec = _spec(tmp_path, 'mean', 1, timeout=timeout, max_steps=20, save_every=5,
               step_sleep={'0': 0.1})
  cluster = Cluster(tmp_path, spec)
  model_dir = spec['model_dir']
  try:
    cluster.start('chief')
    cluster.start('worker')
    deadline = time.time() + 120
    while not glob.glob(os.path.join(model_dir, 'model.ckpt-5.index')):
      assert time.time() < deadline, cluster.log('chief')[-3000:]
      assert cluster.procs['chief'].poll() is None, cluster.log('chief')[-3000:]
      time.sleep(0.2)
    cluster.procs['worker'].kill()
    killed = time.time()
    code = cluster.wait('chief', timeout + 60)
    stopped = time.time() - killed
    print(f'chief stopped {stopped:.1f} s after the worker was killed')
  finally:
    cluster.kill()
  log = cluster.log('chief')
  assert code != 0
  # Which of the library's two messages says so depends on what notices the dead
  # worker first: gRPC (UnavailableError; the session is recreated, and its
  # start refuses to wait for the lost worker) or, on a loaded machine, the
  # step's own timeout (DeadlineExceededError). Both name the cause and the fix.
  lost = ('estimator_towers: the chief (/job:chief/replica:0/task:0/device:CPU:0, rank 0 of 2 '
          'training tasks) failed a training step after')
  named = re.search(r'step\(s\): worker 0 \(127\.0\.0\.1:\d+\) is lost \(no server answers there\)'
                    r'\. variable_strategy=\'collective\' cannot continue', log)
  timed_out = (f'has waited {timeout} s (the step timeout, worker_timeout_secs of make_config '
               'or make_plan) for the other workers\' all-reduce: ')
  assert ((lost in log and named and log.count(lost) == 1) or
          (timed_out in log and 'DeadlineExceededError' in log)), log[-3000:]
  assert stopped < timeout + 30, stopped
  last = tf.train.latest_checkpoint(model_dir)
  resumed_from = int(last.rsplit('-', 1)[1])
  assert 5 <= resumed_from < 20

  restart = Cluster(tmp_path, dict(spec, step_sleep={}))
  restart.run()
  for rank in (0, 1):  # both started from the chief's last checkpoint
    assert (tmp_path / 'dump' / f'rank{rank}.npz.start').read_text() == str(resumed_from)
  final = testlib.variables(testlib.make_estimator(collective_task.mean_model_fn,
                                                   model_dir=model_dir))
  assert final['global_step'] == 20
  worker = np.load(tmp_path / 'dump' / 'rank1.npz')
  for name in final:
    np.testing.assert_array_equal(worker[name], final[name], err_msg=name)


# The chiefs of the two tests below wait for workers that never come (a timeout's
# seconds with nothing to compute), so one fixture starts all three clusters at once
# and each test checks its own: their waits overlap instead of adding up.
NEVER_STARTS_TIMEOUT = 4
# The timeout also bounds the hung case's start (the chief's variables broadcast), which its
# two processes reach at times that differ by their start-up: 12 s, so that a loaded
# machine's start (4 s was once exceeded in CI) fails no start.
HUNG_TIMEOUT = 12


class Stopped:
  """A chief run to its end: its exit code, log, seconds from its start to its end, and
  whether its worker (if any) was still alive then."""

  def __init__(self, cluster, started, stopped):
    self.cluster = cluster
    self.code = cluster.procs['chief'].returncode
    self.log = cluster.log('chief')
    self.seconds = stopped - started
    self.stopped = stopped
    worker = cluster.procs.get('worker')
    self.worker_alive = worker is not None and worker.poll() is None


@pytest.fixture(scope='module')
def waiting_chiefs(tmp_path_factory):
  """{'never_starts': {user_session_config: Stopped}, 'hung': Stopped}: the chiefs of
  `test_a_worker_that_never_starts_...` (no worker started) and of
  `test_a_hung_worker_...` (a worker that sleeps before its first step), side by side;
  a chief that did not stop within 90 s: why, instead of its Stopped."""
  clusters = {}
  for user_session_config in (False, True):
    tmp = tmp_path_factory.mktemp(f'never_starts_{user_session_config}')
    _data(tmp / 'data.npz', SIZES)
    clusters[('never_starts', user_session_config)] = (Cluster(tmp, _spec(
        tmp, 'mean', 1, timeout=NEVER_STARTS_TIMEOUT,
        user_session_config=user_session_config)), ['chief'])
  tmp = tmp_path_factory.mktemp('hung')
  _data(tmp / 'data.npz', SIZES)
  clusters['hung'] = (Cluster(tmp, _spec(tmp, 'mean', 1, timeout=HUNG_TIMEOUT,
                                         step_sleep={'1': 300})), ['chief', 'worker'])
  stopped = {}
  try:
    started = time.time()
    for cluster, tasks in clusters.values():
      for task_type in tasks:
        cluster.start(task_type)
    deadline = started + 90
    while len(stopped) < len(clusters) and time.time() < deadline:
      for key, (cluster, _) in clusters.items():
        if key not in stopped and cluster.procs['chief'].poll() is not None:
          stopped[key] = Stopped(cluster, started, time.time())
      time.sleep(0.1)
  finally:
    for cluster, _ in clusters.values():
      cluster.kill()
  for key, (cluster, _) in clusters.items():  # each test fails on its own chief only
    stopped.setdefault(key, f'{key} did not finish within 90 s:\n' + cluster.log('chief')[-3000:])
  return {'never_starts': {u: stopped[('never_starts', u)] for u in (False, True)},
          'hung': stopped['hung']}


def _stopped(chief):
  assert isinstance(chief, Stopped), chief  # else why not: the chief did not stop in time
  return chief


@pytest.mark.timeout(120)
@pytest.mark.parametrize('user_session_config', [False, True])
def test_a_worker_that_never_starts_stops_the_chief_after_the_timeout(waiting_chiefs,
                                                                      user_session_config):
  """Also with the RunConfig's session_config a ConfigProto of the user's own (no
  device filters: its session would otherwise wait for the worker forever)."""
  chief = _stopped(waiting_chiefs['never_starts'][user_session_config])
  log = chief.log
  assert chief.code != 0
  assert 'DeadlineExceededError' in log and 'broadcast_from_chief' in log, log[-3000:]
  assert (f'has waited {NEVER_STARTS_TIMEOUT} s (worker_timeout_secs of make_config or '
          'make_plan) at its start for the other training tasks (/job:chief/replica:0/task:0, '
          '/job:worker/replica:0/task:0)' in log), log[-3000:]
  print(f'chief stopped {chief.seconds:.1f} s after its start')
  # the process's start and graph, then the timeout
  assert chief.seconds < NEVER_STARTS_TIMEOUT + 60, chief.seconds


@pytest.mark.timeout(120)
def test_a_hung_worker_fails_the_chief_step_after_the_timeout(waiting_chiefs):
  """The worker is alive but never steps (it sleeps before its first step)."""
  chief = _stopped(waiting_chiefs['hung'])
  assert chief.worker_alive  # still alive, hung, when the chief stopped
  log = chief.log
  assert chief.code != 0
  assert 'DeadlineExceededError' in log, log[-3000:]
  assert (f'has waited {HUNG_TIMEOUT} s (the step timeout, worker_timeout_secs of '
          'make_config or make_plan) for the other workers\' all-reduce' in log), log[-3000:]
  # The session had started (the start's broadcast met the worker): a step failed.
  started = os.path.getmtime(chief.cluster.tmp_path / 'dump' / 'rank0.npz.start')
  print(f'chief stopped {chief.stopped - started:.1f} s after its session started')
  assert chief.stopped - started < HUNG_TIMEOUT + 15


# --- TF_CONFIG errors, one per message -------------------------------------------


def _tf_config(monkeypatch, cluster, task_type='worker', index=0):
  monkeypatch.setenv('TF_CONFIG', json.dumps(
      {'cluster': cluster, 'task': {'type': task_type, 'index': index}}))


def test_missing_chief_is_an_error_naming_the_field(monkeypatch):
  _tf_config(monkeypatch, {'worker': ['127.0.0.1:1', '127.0.0.1:2']})
  with pytest.raises(ValueError, match=r"cluster has no 'chief' task.*Add \"chief\""):
    et.make_run_config(et.make_config(variable_strategy='collective'))


def test_ps_with_the_collective_strategy_is_an_error(monkeypatch):
  _tf_config(monkeypatch, {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2'],
                           'ps': ['127.0.0.1:3']})
  with pytest.raises(ValueError, match=r"cluster has a 'ps' job.*Remove cluster.ps"):
    et.make_run_config(et.make_config(variable_strategy='collective'))


def test_task_index_out_of_range_is_an_error(monkeypatch):
  _tf_config(monkeypatch, {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']}, index=1)
  with pytest.raises(ValueError, match=r"task.index is 1, but cluster.worker has 1 "
                                       r"address\(es\), so task.index must be in 0..0"):
    et.worker_index_and_count()


def test_task_type_not_in_the_cluster_is_an_error():
  with pytest.raises(ValueError, match=r"task.type is 'worker', which is not a job"):
    cluster_lib.parse({'cluster': {'chief': ['a:1']}, 'task': {'type': 'worker', 'index': 0}})


def test_worker_index_and_count():
  config = {'cluster': {'chief': ['a:1'], 'worker': ['b:1', 'c:1']},
            'task': {'type': 'worker', 'index': 1}}
  assert et.worker_index_and_count(config) == (2, 3)
  assert et.worker_index_and_count(dict(config, task={'type': 'chief', 'index': 0})) == (0, 3)
  assert et.worker_index_and_count(dict(config, task={'type': 'evaluator', 'index': 0})) == (0, 1)
  assert et.worker_index_and_count('') == (0, 1)


def _train_graph(model_fn, monkeypatch, cluster, strategy='collective', **plan_kwargs):
  """Builds a towered TRAIN graph as one task of `cluster` (TF_CONFIG) would."""
  _tf_config(monkeypatch, cluster)
  towered = et.replicate_model_fn(model_fn, plan=et.make_plan(
      devices=['/cpu:0', '/cpu:1'], variable_strategy=strategy, **plan_kwargs))
  x, y = testlib.data(8)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    features, labels = tf.compat.v1.data.make_one_shot_iterator(
        tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(4)).get_next()
    towered(features, labels, tf.estimator.ModeKeys.TRAIN, None, testlib.run_config(2))
  return graph


CHIEF_AND_WORKER = {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']}


@pytest.mark.parametrize('sync', [True, False])
def test_batch_norm_across_workers_mixes_no_rows(monkeypatch, sync):
  """The all-reduces and gathers of statistics across workers are statistics
  (row_dependence): no whole-batch head is built for a per-example model."""
  def model_fn(features, labels, mode):
    return collective_task.bn_model_fn(features, labels, mode, {'learning_rate': 0.1})
  graph = _train_graph(model_fn, monkeypatch, CHIEF_AND_WORKER, sync_batch_norm=sync)
  assert not [op for op in graph.get_operations()
              if 'whole_batch_head' in op.name or 'row_wise_head' in op.name]


@pytest.mark.parametrize('model, mixing, reduces', [
    ('mixup', 'ReverseV2', 4),      # per input (features, labels): the counts, the rows
    ('attention', 'MatMul', 3),     # the hidden rows' counts, rows and gradient
])
def test_mixing_across_workers_is_cut_on_the_cluster_rows(monkeypatch, model, mixing, reduces):
  """Mixup's input stage, attention's products: on the cluster's rows (all-gathered, the
  hidden rows' gradient summed over the workers); no whole-batch head."""
  def model_fn(features, labels, mode):
    return collective_task.MODELS[model](features, labels, mode, {'learning_rate': 0.1})
  graph = _train_graph(model_fn, monkeypatch, CHIEF_AND_WORKER)
  names = [op.name for op in graph.get_operations()]
  assert not [n for n in names if 'whole_batch_head' in n]
  whole = [op for op in graph.get_operations()
           if op.name.startswith('batch_mixing') and op.type == mixing]
  assert len(whole) == 2
  gathers = [op for op in graph.get_operations() if op.type.startswith('CollectiveReduce')
             and 'batch_mixing' in op.name]
  assert len(gathers) == reduces, [op.name for op in gathers]


@pytest.mark.parametrize('use_resource', [False, True])
def test_a_workers_tower_copies_read_their_variables_after_the_broadcast(monkeypatch,
                                                                         use_resource):
  """A worker initialises its own variables, then takes the chief's (the broadcast): every op
  that reads a variable to initialise a tower's copy of it waits for the broadcast. A ref
  variable's copy reads it through TensorFlow's `cond(is_variable_initialized(v), ...)`,
  whose ops take the variable itself; reading it sooner fails ('uninitialized value') or
  copies the worker's own initial value."""
  def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable('w', initializer=tf.ones([testlib.NUM_FEATURES, 3]),
                                  use_resource=use_resource)
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, features['x'] @ w)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  graph = _train_graph(model_fn, monkeypatch, CHIEF_AND_WORKER)
  variables = {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
  copies = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
            if '/replica_' in v.op.name]
  assert copies
  for copy in copies:
    reads = [op for op in _input_closure(copy.initializer) if any(
        t.op.name in variables for t in op.inputs)]
    assert reads
    for op in reads:
      assert any(a.name.startswith('broadcast_from_chief/') for a in _input_closure(op, True)), (
          f'{op.name} ({op.type}) reads {copy.op.name}\'s variable before the broadcast')


def _input_closure(op, controls=False):
  """The ops `op` waits for through its inputs (and, with `controls`, control inputs)."""
  seen, stack, found = set(), [op], []
  while stack:
    op = stack.pop()
    if op.name not in seen:
      seen.add(op.name)
      found.append(op)
      stack.extend([t.op for t in op.inputs] + (list(op.control_inputs) if controls else []))
  return found[1:]


def test_chief_and_workers_without_ps_need_the_collective_strategy(monkeypatch):
  with pytest.raises(ValueError, match=r"1 worker task\(s\) and no 'ps' job.*"
                                       r"Use variable_strategy='collective'"):
    _train_graph(testlib.v1_model_fn, monkeypatch, CHIEF_AND_WORKER, strategy='cpu')


def test_collective_graph_all_reduces_the_gradients_across_workers(monkeypatch):
  graph = _train_graph(testlib.v1_model_fn, monkeypatch, CHIEF_AND_WORKER)
  reduces = [op for op in graph.get_operations() if op.type.startswith('CollectiveReduce')]
  assert reduces
  across = [op for op in reduces if 'across_workers' in op.name]
  assert len(across) >= 2  # the live inputs, the gradients, ...
  for op in across:
    assert op.get_attr('communication_hint') == b'ring'
    assert op.get_attr('group_size') == 2 and op.device.startswith('/job:worker/replica:0/task:0')
  between = [op for op in reduces if 'across_workers' not in op.name]
  assert between and {op.get_attr('group_key') for op in between} == {
      cross_worker.LOCAL_GROUP_KEY_BASE + 1}  # worker 0 is rank 1
  keys = [(op.get_attr('instance_key'), op.device) for op in reduces]
  assert len(set(keys)) == len(keys)


def test_inputs_not_from_a_dataset_across_workers_are_an_error(monkeypatch):
  _tf_config(monkeypatch, CHIEF_AND_WORKER)
  towered = et.replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0', '/cpu:1'],
                                  variable_strategy='collective')
  x, y = testlib.data(8)
  with tf.Graph().as_default(), pytest.raises(ValueError, match=r"needs the input_fn to "
                                              r"return a tf.data.Dataset"):
    tf.compat.v1.train.create_global_step()
    towered({'x': tf.constant(x)}, tf.constant(y), tf.estimator.ModeKeys.TRAIN, None,
            testlib.run_config(2))


def test_staged_input_across_workers_is_an_error(monkeypatch):
  _tf_config(monkeypatch, CHIEF_AND_WORKER)
  plan = et.make_plan(devices=['/cpu:0', '/cpu:1'], variable_strategy='collective')
  towered = et.replicate_model_fn(testlib.v1_model_fn, plan=plan)
  x, y = testlib.data(8)
  staged = et.staged_input_fn(
      lambda: tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(4), plan)
  with tf.Graph().as_default(), pytest.raises(ValueError, match=r"across 2 workers does not "
                                              r"support staged_input_fn"):
    tf.compat.v1.train.create_global_step()
    features, labels = staged()
    towered(features, labels, tf.estimator.ModeKeys.TRAIN, None, testlib.run_config(2))


def test_a_model_fn_without_gradients_across_workers_is_an_error(monkeypatch):
  def model_fn(features, labels, mode):
    loss = tf.reduce_mean(features['x'])
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=tf.compat.v1.assign_add(
            tf.compat.v1.train.get_global_step(), 1))
  with pytest.raises(ValueError, match=r"asked for no gradient with respect to variables"):
    _train_graph(model_fn, monkeypatch, CHIEF_AND_WORKER)


def test_worker_timeout_must_be_positive():
  with pytest.raises(ValueError, match=r"worker_timeout_secs must be a positive number .*got 0\. The default is 120"):
    et.make_plan(variable_strategy='collective', worker_timeout_secs=0)


# --- One machine: the same strategy between devices ----------------------------


ONE_MACHINE_DATA = testlib.data(21)
ONE_MACHINE_INPUT = testlib.input_fn(*ONE_MACHINE_DATA, 7, epochs=10)
# Plain's runs, each computed once for both cases.
ONE_MACHINE_REFERENCE = testlib.PlainTraining(testlib.v1_model_fn, ONE_MACHINE_INPUT)


@pytest.mark.parametrize('micro_batches', [1, 2])
def test_collective_on_one_machine_trains_as_plain(micro_batches):
  fn, reference = ONE_MACHINE_INPUT, ONE_MACHINE_REFERENCE
  towered = et.replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(2),
                                  variable_strategy='collective', micro_batches=micro_batches)
  testlib.check_towered_training(testlib.v1_model_fn, towered, 2, fn, reference,
                                 resume=micro_batches == 1)


@pytest.mark.parametrize('devices, hint', [(['/cpu:0', '/cpu:1'], b'ring'),
                                            (['/gpu:0', '/gpu:1'], b'nccl')])
def test_collective_on_one_machine_all_reduces_between_the_devices(devices, hint):
  towered = et.replicate_model_fn(testlib.v1_model_fn, devices=devices,
                                  variable_strategy='collective')
  x, y = testlib.data(8)
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    towered({'x': tf.constant(x)}, tf.constant(y), tf.estimator.ModeKeys.TRAIN, None, None)
  reduces = [op for op in graph.get_operations() if op.type.startswith('CollectiveReduce')]
  assert len(reduces) == 2 * 4  # one per device for each of the 4 variables
  for op in reduces:
    assert op.get_attr('communication_hint') == hint, op.name
    assert op.get_attr('group_size') == 2
  spec = tf.DeviceSpec.from_string
  assert sorted({(spec(op.device).device_type, spec(op.device).device_index) for op in reduces}) == \
      sorted({(spec(d).device_type, spec(d).device_index) for d in devices})


def test_session_device_filters_that_see_other_workers_are_an_error():
  cluster = {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2', '127.0.0.1:3']}
  proto = tf.compat.v1.ConfigProto(device_filters=['/job:worker'])
  with pytest.raises(ValueError, match=re.escape(
      "device_filters is ['/job:worker'], which lets the sessions of /job:worker/task:1 see "
      "other training tasks' devices") + r".*Set device_filters to \['/job:worker/task:1'\]"):
    cross_worker_servers.own_devices_only(proto, cluster, 'worker', 1)


def test_a_session_config_without_device_filters_gets_the_task_s_own():
  cluster = {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']}
  proto = tf.compat.v1.ConfigProto(device_count={'CPU': 2})  # as users write it
  cross_worker_servers.own_devices_only(proto, cluster, 'worker', 0)
  assert list(proto.device_filters) == ['/job:worker/task:0']
  chief = tf.compat.v1.ConfigProto(device_filters=['/job:chief', '/job:ps'])  # Estimator's own
  cross_worker_servers.own_devices_only(chief, cluster, 'chief', 0)
  assert list(chief.device_filters) == ['/job:chief', '/job:ps']


# --- TF1 behaviour and warm starts across workers ------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize('behaviour', ['v1', 'tensorshape', 'ref_variables', 'control_flow_v1'])
def test_tf1_behaviour_across_two_workers_of_two_towers_trains_as_plain(tmp_path, behaviour):
  """Every task calls `disable_v2_behavior()` first (TF1 shapes, ref variables, control flow
  v1), or one of those parts alone (testlib.TF1_BEHAVIOURS), then trains
  `collective_task.tf1_mix_model_fn` (a dense layer, an einsum attention and a synchronised
  batch norm: tests/test_tf1_behaviour.py's models, in one) on 2 workers x 2 towers: the
  chief as plain on the global batches (every variable, slot and moving average within
  1e-5), the worker bit-equal to it, and each task's every device holds at least 0.9 x the
  plain TRAIN graph's heavy ops (matrix products and einsums)."""
  data = _data(tmp_path / 'data.npz', SIZES)
  batches = _global_batches(data, SIZES)
  # The session start's broadcast waits worker_timeout_secs for the other task, which under
  # TF1 behaviour builds two graphs (its heavy ops' count): 120 s on a loaded machine.
  spec = _spec(tmp_path, 'tf1_mix', 2, tf1=behaviour, sync_batch_norm=True, heavy_ops=True,
               timeout=120)
  Cluster(tmp_path, spec).run(timeout=210)
  chief, expected = _chief_against_plain(tmp_path, spec, 'tf1_mix', batches)
  assert {'query', 'key', 'batch_normalization/moving_mean',
          'batch_normalization/moving_variance', 'query/Momentum'} <= set(chief)
  first = tf.train.load_checkpoint(os.path.join(spec['model_dir'], 'model.ckpt-0'))
  for name in ('query', 'batch_normalization/moving_variance'):
    assert np.max(np.abs(first.get_tensor(name) - expected[name])) > 1e-3, name
  _assert_workers_equal_the_chief(tmp_path, chief, SIZES)
  for rank in SIZES:
    with open(tmp_path / 'dump' / f'heavy_ops{rank}.json') as f:
      counts = json.load(f)
    assert counts['resource_variables'] == (behaviour not in ('v1', 'ref_variables')), counts
    assert counts['control_flow_v2'] == (behaviour not in ('v1', 'control_flow_v1')), counts
    assert counts['plain'] >= 6, counts  # the forward and backward products
    shares = [counts['per_device'].get(f'CPU:{i}', 0) / counts['plain'] for i in range(2)]
    assert min(shares) >= 0.9, (rank, counts)


def _pretrained(tmp_path, batches):
  estimator = tf.estimator.Estimator(collective_task.pretrain_model_fn, params={},
                                     config=testlib.run_config(
                                         1, model_dir=str(tmp_path / 'pretrained')))
  estimator.train(_batches_input_fn(batches), steps=3)
  return estimator.latest_checkpoint()


@pytest.mark.timeout(TOGETHER_TIMEOUT)
def test_warm_starts_across_two_workers_of_two_towers_train_as_plain(tmp_path, together,
                                                                     request):
  """Fine-tuning from a pre-training checkpoint on 2 workers x 2 towers
  (`collective_task.finetune_model_fn`): `init_from_checkpoint` in the model_fn (BERT's
  pattern), Estimator's `warm_start_from` and a Scaffold's `init_fn`, each for a layer of its
  own, and a new layer. Every task's variables are set to the chief's at session start (the
  broadcast of the local init op): the warm-started values survive it (the chief's first
  checkpoint holds the pre-trained layers), the init_fn runs on the chief only (the worker takes
  its values from the broadcast), and the run equals the plain model_fn warm-started the same
  three ways and trained on the global batches from its own start (not the chief's checkpoint),
  the worker bit-equal to the chief."""
  cluster, data = together.run_of(request.node)
  run_dir = cluster.tmp_path
  batches = _global_batches(data, SIZES)
  with open(cluster.spec_path) as f:
    spec = json.load(f)
  pretrained = spec['pretrained']

  start = testlib.checkpoint_variables(os.path.join(spec['model_dir'], 'model.ckpt-0'))
  source = testlib.checkpoint_variables(pretrained)
  for layer in ('encoder', 'middle', 'pre_head'):  # the three ways, each on the chief's start
    for name in (f'{layer}/kernel', f'{layer}/bias'):
      np.testing.assert_array_equal(start[name], source[name], err_msg=name)
  assert np.max(np.abs(source['encoder/bias'])) > 1e-3  # pre-training moved them
  assert (run_dir / 'dump' / 'init_fn_chief').read_text() == 'ran\n'
  assert not (run_dir / 'dump' / 'init_fn_worker').exists()

  params = {'learning_rate': 0.1, 'pretrained': pretrained,
            'init_fn_marker': str(tmp_path / 'plain_init_fn')}
  plain = tf.estimator.Estimator(
      collective_task.finetune_model_fn, params=params,
      warm_start_from=collective_task.warm_start_settings(pretrained),
      config=testlib.run_config(1, model_dir=str(tmp_path / 'plain')))
  plain.train(_batches_input_fn(batches), steps=len(batches))
  expected = testlib.variables(plain)
  chief = testlib.variables(testlib.make_estimator(collective_task.finetune_model_fn,
                                                   model_dir=spec['model_dir'], params=params))
  assert chief['global_step'] == len(batches) == 5
  testlib.assert_variables_close(chief, expected)
  _assert_workers_equal_the_chief(run_dir, chief, SIZES)
