"""variable_strategy='auto' (the default): the strategy "Choosing a strategy" recommends.

The rule (`placement/recommended.py`) is checked per device kind and count
and per cluster against the page's table, read from docs/choosing-a-strategy.md
itself (1 and 2 GPUs `cpu`, 4 `gpu`, 8 `collective`; a chief and workers
without ps `collective`, with ps `cpu`); a towered graph on GPUs (pretended
visible) places its variables as that strategy does and the device report
names it; and every snippet of the docs and the example that names a GPU
count and a strategy names the recommended one.
"""

from __future__ import annotations

import glob
import re

import pytest
import tensorflow as tf

import testlib
import estimator_towers as et
from estimator_towers.base import logs
from estimator_towers.cluster import tf_config as cluster_lib
from estimator_towers.placement import recommended

PAGE = 'docs/choosing-a-strategy.md'


def _page_table() -> dict:
  """{'2 GPUs': 'cpu', ...}: the recommendation table's first two columns."""
  rows = {}
  for line in open(PAGE, encoding='utf-8'):
    cells = [c.strip() for c in line.split('|')[1:-1]]
    if len(cells) == 3 and cells[0].endswith('GPUs'):
      rows[cells[0]] = re.findall(r'`(\w+)`', cells[1])[0]
  return rows


@pytest.mark.parametrize('count', [1, 2, 3, 4, 5, 8, 16])
def test_the_default_on_gpus_is_the_page_s_recommendation(count):
  chosen, why = recommended.choose('auto', [f'/gpu:{i}' for i in range(count)])
  table = _page_table()
  assert table['2 GPUs'] == 'cpu' and table['4 GPUs'] == 'gpu' and table['8 GPUs'] == 'collective'
  expected = 'cpu' if count <= 2 else 'gpu' if count <= 4 else 'collective'
  assert chosen == expected, (count, chosen)
  assert f'{count} GPU' in why


@pytest.mark.parametrize('devices', [['/cpu:0'], testlib.cpu_devices(4), testlib.cpu_devices(8),
                                     ['/gpu:0', '/gpu:1', '/gpu:2', '/cpu:0']])
def test_the_default_on_cpu_devices_or_a_mix_is_cpu(devices):
  assert recommended.choose('auto', devices)[0] == 'cpu'


@pytest.mark.parametrize('jobs, expected', [
    ({'chief': ['h0:1'], 'worker': ['h1:1']}, 'collective'),
    ({'chief': ['h0:1'], 'worker': ['h1:1'], 'ps': ['h2:1']}, 'cpu')])
def test_the_default_across_machines(jobs, expected):
  cluster = cluster_lib.parse({'cluster': jobs, 'task': {'type': 'worker', 'index': 0}})
  assert recommended.choose('auto', testlib.cpu_devices(2), cluster)[0] == expected
  assert recommended.choose('gpu', testlib.cpu_devices(2), cluster) == ('gpu', '')


@pytest.mark.parametrize('count, device_of_kernel', [(2, '/device:CPU:0'), (4, 'GPU')])
def test_a_towered_graph_places_variables_by_the_default(monkeypatch, count, device_of_kernel):
  """num_gpus=2: `cpu` (the kernel on the host); num_gpus=4: `gpu` (spread over the GPUs);
  the device report names the strategy and why."""
  from estimator_towers.placement import devices as devices_lib
  monkeypatch.setattr(devices_lib, 'visible_gpus',
                      lambda: [f'/device:GPU:{i}' for i in range(count)])
  infos = []
  monkeypatch.setattr(logs, 'info_once_per_graph', lambda message, graph=None: infos.append(message))
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    x, y = testlib.data(8)
    et.replicate_model_fn(testlib.v1_model_fn, num_gpus=count)(
        tf.constant(x), tf.constant(y), tf.estimator.ModeKeys.TRAIN, None, None)
  kernels = [v.device for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
             if 'kernel' in v.op.name or 'weights' in v.op.name]
  assert kernels and all(device_of_kernel in d for d in kernels), kernels
  strategy = 'cpu' if count == 2 else 'gpu'
  assert any(f'variable_strategy={strategy}, chosen for {count} GPU' in m for m in infos), infos


_SNIPPET_FILES = sorted(glob.glob('docs/**/*.md', recursive=True)) + ['README.md'] + sorted(
    glob.glob('examples/**/*.py', recursive=True))
# A page that runs two candidates to compare them names a strategy other than the default.
_COMPARISONS = ('--variable_strategy=gpu --train_steps=300',)


def _named_pairs() -> list:
  """(file, line, GPU count, strategy) of every line naming both."""
  found = []
  for path in _SNIPPET_FILES:
    for number, line in enumerate(open(path, encoding='utf-8'), 1):
      count = re.search(r'num_gpus[= ](\d+)', line)
      strategy = re.search(r'variable_strategy[= ]\'?(\w+)', line)
      if count and strategy and not any(c in line for c in _COMPARISONS):
        found.append((path, number, int(count.group(1)), strategy.group(1)))
  return found


def test_every_snippet_names_the_recommended_strategy_for_its_gpus():
  pairs = _named_pairs()
  assert len(pairs) >= 5, pairs   # the 8-GPU snippets at least
  wrong = [(path, number, count, strategy) for path, number, count, strategy in pairs
           if strategy != recommended.choose('auto', ['/gpu:0'] * count)[0]]
  assert not wrong, wrong
