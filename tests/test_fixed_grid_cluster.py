"""shards=S across the workers of a cluster: bit-identical to one device.

On W workers each worker's S / W shards are one subtree of the grid's
summation tree, and the sums across workers take the tree above them in rank
order (`cluster/fixed_reduce.py`: an all-to-all, each chunk's W pieces added
over the tree on one worker, an all-gather). The references:

- the fixed-order sum itself, on W members of one process (each a virtual CPU
  device in a collective group, the ranks shuffled against the group's order),
  against numpy's float32 tree; the control: TensorFlow's ring all-reduce of
  the same values differs from the tree (so a sum taken in the ring's order
  would fail the comparison);
- a cluster of 2 workers x 2 devices (`shards=8`, two shards per device) of
  two models, two synchronised batch norms (the tf.nn.moments path and the
  fused kernel's: every shard's statistics gathered, the gradients' sums in
  the grid's order) with dropout (keyed draws) under a token-weighted loss,
  an in-batch softmax of dropped-out features plus a token-weighted loss, and a
  synchronised batch norm and dropout under an in-batch softmax
  (`collective_task.grid_bn_model_fn`, `grid_softmax_model_fn`,
  `grid_bn_softmax_model_fn`), against the same model_fn
  decorated for one device on the same grid trained on the global batches from
  the cluster's first checkpoint: every variable and optimizer slot after 3
  steps `np.array_equal` (the three clusters run one after another by one chief
  and one worker process, `TogetherRuns`).

And the grid's conditions on a cluster, at graph construction: a worker's
shards must be a power of two, and the workers must meet at the collective's
all-reduces every step.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import collective_task
import testlib
import estimator_towers as et
from estimator_towers.base import interception
from estimator_towers.cluster import fixed_reduce
from estimator_towers.inputs import grid
from test_collective import Cluster
from test_collective import TogetherRuns
from test_collective import _batches_input_fn
from test_collective import _data
from test_collective import _global_batches
from test_collective import _plain_from
from test_collective import _spec
from test_collective import _train_graph

_CLUSTER = {'chief': ['127.0.0.1:1'], 'worker': ['127.0.0.1:2']}


def _tree(values):
  """numpy's float32 sum over the grid's tree of len(values) leaves."""
  if len(values) == 1:
    return values[0]
  power = 1
  while power * 2 < len(values):
    power *= 2
  return _tree(values[:power]) + _tree(values[power:])


@pytest.mark.parametrize('ranks', [[2, 0, 3, 1], [1, 2, 0]])
def test_the_fixed_order_sum_adds_the_workers_over_the_tree_in_rank_order(ranks):
  members = len(ranks)
  rng = np.random.RandomState(members)
  values = [(rng.randn(1001) * 10.0 ** rng.uniform(-3, 3, 1001)).astype(np.float32)
            for _ in range(members)]
  with tf.Graph().as_default():
    fixed, ring = [], []
    for member, rank in enumerate(ranks):
      keys = iter(range(100, 200))  # every member's graph counts its instance keys alike
      reduce = fixed_reduce.FixedReduce(members, rank, 9, lambda keys=keys: next(keys),
                                        f'/cpu:{member}', lambda: 0)
      with tf.device(f'/cpu:{member}'):
        fixed.append(reduce(tf.constant(values[rank])))
        ring.append(interception.all_reduce(tf.constant(values[rank]), members, 10, 1,
                                            'Add', 'Id'))
    with tf.compat.v1.Session(config=testlib.session_config(members)) as session:
      fixed, ring = session.run([fixed, ring])
  expected = _tree(values)
  for total in fixed:
    np.testing.assert_array_equal(total, expected)
  # The control: the ring adds each chunk starting at another member.
  assert not all(np.array_equal(total, expected) for total in ring)


GRID_MODELS = ['grid_bn', 'grid_softmax', 'grid_bn_softmax']
GRID_SIZES = {0: 24, 1: 24}  # 3 steps of 8 rows per worker: global batches of 16


@pytest.fixture(scope='module')
def grid_runs(request, tmp_path_factory):
  """The selected models' clusters, run one after another by one chief and one worker
  process (`TogetherRuns`: each run its own cluster, ports, directory and log)."""
  models = [item.callspec.params['model'] for item in request.session.items
            if item.module is request.module and getattr(item, 'originalname', None) ==
            test_two_workers_of_two_devices_equal_one_device_bit_for_bit.__name__]
  clusters = {}
  for model in dict.fromkeys(models):
    tmp = tmp_path_factory.mktemp(model)
    _data(tmp / 'data.npz', GRID_SIZES)
    clusters[model] = Cluster(tmp, _spec(tmp, model, 2, batch=8, shards=8, sync_batch_norm=True))
  runs = TogetherRuns(clusters)
  runs.run(tmp_path_factory.mktemp('together'))
  return runs


# The first test runs every selected model's cluster: its time limit is theirs.
@pytest.mark.timeout(600)
@pytest.mark.parametrize('model', GRID_MODELS)
def test_two_workers_of_two_devices_equal_one_device_bit_for_bit(tmp_path, grid_runs, model):
  run = grid_runs.check(model)
  data = dict(np.load(run.tmp_path / 'data.npz'))
  batches = _global_batches(data, GRID_SIZES, batch=8)
  with open(run.spec_path) as f:
    spec = json.load(f)
  one_device = et.replicate_model_fn(collective_task.MODELS[model], devices=['/cpu:0'],
                                     shards=8)
  reference = _plain_from(spec['model_dir'], 'model.ckpt-0', one_device,
                          {'learning_rate': 0.1}, tmp_path)
  reference.train(_batches_input_fn(batches), steps=len(batches))
  cluster = testlib.checkpoint_variables(tf.train.latest_checkpoint(spec['model_dir']))
  expected = testlib.variables(reference)
  assert cluster['global_step'] == expected['global_step'] == 3
  first = testlib.checkpoint_variables(os.path.join(spec['model_dir'], 'model.ckpt-0'))
  assert any(not np.array_equal(first[name], expected[name]) for name in expected
             if name != 'global_step')  # trained
  assert any('/Adam' in name for name in expected)  # the optimizer's slots compared too
  differing = [name for name in expected if not np.array_equal(cluster[name], expected[name])]
  assert not differing, differing


def test_a_worker_s_shards_must_be_a_power_of_two(monkeypatch):
  # 2 workers x 2 devices divide 12, but a worker's 6 shards are not one subtree.
  with pytest.raises(grid.GridError, match=r'shards=12 on 2 workers gives 6 shards per '
                                           r'worker, not a power of two.*\[1, 2, 3, 4, 6, 12\]'):
    _train_graph(collective_task.mean_model_fn, monkeypatch, _CLUSTER, shards=12)


def test_shards_across_workers_that_do_not_meet_every_step_are_an_error(monkeypatch):
  parameter_servers = dict(_CLUSTER, ps=['127.0.0.1:3'])
  with pytest.raises(grid.GridError, match=r"shards=4 across 2 training tasks needs "
                                           r"variable_strategy='collective' \(got 'cpu'\)"):
    _train_graph(collective_task.mean_model_fn, monkeypatch, parameter_servers,
                 strategy='cpu', shards=4)
