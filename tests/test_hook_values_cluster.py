"""Across workers, the summaries a model_fn builds show the whole cluster's values.

A chief and a worker of 2 towers each (`collective`) train
`collective_task.summaries_model_fn` on 3 global batches, the chief writing
its summaries every step. Each scalar summary of a batch value (the model_fn's
loss, an accuracy, the max and min logit, a count of correct predictions, the
number of examples, a token-weighted mean) equals, at every step, the one the
model_fn writes plain on one device trained on the global batches from the
cluster's first checkpoint. The histogram of the logits (rows) shows the
chief's own rows (its count is the chief's half of the batch), with one
warning naming it. Across workers the views' all-reduces run in every step
on every task: the cluster finishes (a summary only the chief ran would wait
for the worker forever).
"""


import numpy as np
import pytest
import tensorflow as tf

import collective_task
import testlib
from test_collective import Cluster
from test_collective import _batches_input_fn
from test_collective import _data
from test_collective import _global_batches
from test_collective import _plain_from
from test_collective import _spec

SCALARS = ('loss', 'my_loss', 'accuracy', 'max_logit', 'min_logit', 'correct', 'examples',
           'weighted')


@pytest.mark.timeout(240)
def test_the_chief_s_summaries_show_the_cluster_s_values(tmp_path):
  sizes = {0: 24, 1: 24}   # 3 global batches of 16: 8 rows per task
  data = _data(tmp_path / 'data.npz', sizes)
  batches = _global_batches(data, sizes, batch=8)
  spec = _spec(tmp_path, 'summaries', 2, batch=8, summary_every=1)
  Cluster(tmp_path, spec).run()
  plain = _plain_from(spec['model_dir'], 'model.ckpt-0', collective_task.summaries_model_fn,
                      {'learning_rate': 0.1}, tmp_path, save_summary_steps=1)
  plain.train(_batches_input_fn(batches), steps=len(batches))
  cluster, expected = (testlib.summary_values(d, histogram=lambda h: h.num)
                       for d in (spec['model_dir'], plain.model_dir))
  for tag in SCALARS:
    steps = sorted(expected[tag])
    assert steps == [1, 2, 3] and sorted(cluster[tag]) == steps, (tag, cluster.get(tag))
    testlib.assert_close(np.array([cluster[tag][s] for s in steps]),
                         np.array([expected[tag][s] for s in steps]), err_msg=tag)
  assert expected['examples'][1] == 16 and expected['logits'][1] == 16 * 3
  assert [cluster['logits'][s] for s in (1, 2, 3)] == [8 * 3] * 3   # the chief's rows
  log = (tmp_path / 'chief0.log').read_text()
  warned = [line for line in log.splitlines() if 'rows of the batch: it shows this task' in line]
  assert len(warned) == 1 and 'the summary logits' in warned[0], warned or log[-3000:]
