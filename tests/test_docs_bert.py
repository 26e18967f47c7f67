"""docs/bert.md tells the truth: its CPU recipe, its log lines and its plain-Estimator claim.

- "Try it on CPU" runs as written in a fresh process: 5 steps of a tiny BERT
  on two virtual CPU devices, and the log shows the two lines the page
  prints (the library's INFO lines, which it turns on with absl's verbosity).
  The same process then checks the page's other two claims about it: with
  only `tf.compat.v1.logging.set_verbosity(INFO)` the library's INFO lines do
  not print; without the RunConfig's `device_count`, building the graph fails
  with an error that says the towers' devices do not exist.
- BERT's model_fns return a `TPUEstimatorSpec`: a plain Estimator refuses it
  undecorated ("model_fn should return an EstimatorSpec"), trains the
  page's `plain_model_fn` wrapper and the decorated model_fn.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import estimator_towers as et
import testlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BERT_MD = os.path.join(ROOT, 'docs', 'bert.md')

# Run after the recipe, in its process: the page's claims about verbosity and device_count.
_CHECKS = '''
import estimator_towers.base.logs as _logs
logging.set_verbosity(logging.WARNING)
tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
_logs.info_once_per_graph('estimator_towers: a line at TensorFlow INFO only', tf.Graph())
try:
  tf.estimator.Estimator(replicate_model_fn(model_fn, devices=['/cpu:0', '/cpu:1']),
                         config=tf.estimator.RunConfig(model_dir=tempfile.mkdtemp()),
                         params={'batch_size': 16}).train(input_fn, max_steps=1)
except ValueError as error:
  print('REFUSED:', error)
'''


def _section(heading: str) -> tuple[str, list[str]]:
  """The first python block under `heading` in bert.md, and its text blocks."""
  with open(BERT_MD, encoding='utf-8') as f:
    section = f.read().split(f'\n## {heading}\n', 1)[1].split('\n## ', 1)[0]
  return (re.search(r'```python\n(.*?)```', section, re.S).group(1),
          re.findall(r'```text\n(.*?)```', section, re.S))


def test_try_it_on_cpu_runs_as_written_and_logs_what_the_page_shows(tmp_path):
  code, texts = _section('Try it on CPU')
  done, output = testlib.run_script(code + _CHECKS, tmp_path, 300, 'bert_on_cpu.py')
  assert done.returncode == 0, output[-3000:]
  trained = [d for d in tmp_path.iterdir() if (d / 'model.ckpt-5.index').exists()]
  assert len(trained) == 1, list(tmp_path.iterdir())   # the recipe's 5 steps
  shown = [line for line in texts[0].splitlines() if line.strip()]
  assert len(shown) == 2 and all(line in output.splitlines() for line in shown), (
      shown, [line for line in output.splitlines() if 'estimator_towers' in line])
  assert 'at TensorFlow INFO only' not in output
  assert re.search(r"REFUSED: Towers on /device:CPU:0, /device:CPU:1: /device:CPU:1 do not "
                   r"exist .*device_count=\{'CPU': 2\}", done.stdout), done.stdout[-2000:]


def _tpu_spec_model_fn(features, labels, mode, params):
  """A one-layer model_fn returning a TPUEstimatorSpec, as BERT's model_fn_builder's do."""
  del params
  logits = tf.compat.v1.layers.dense(features['x'], 2, kernel_initializer=tf.ones_initializer())
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.compat.v1.estimator.tpu.TPUEstimatorSpec(mode, loss=loss, train_op=train_op)


def _input_fn():
  x = np.arange(16, dtype=np.float32).reshape(8, 2) / 16
  return tf.data.Dataset.from_tensor_slices(({'x': x}, np.arange(8) % 2)).batch(8).repeat()


def _trained_kernel(model_fn, tmp_path, name):
  estimator = tf.estimator.Estimator(model_fn, model_dir=str(tmp_path / name))
  estimator.train(_input_fn, max_steps=1)
  return estimator.get_variable_value('dense/kernel')


def test_a_plain_estimator_runs_bert_s_spec_decorated_or_wrapped_not_bare(tmp_path):
  """The page's refusal message and its `plain_model_fn` (its first block, run on a
  TPUEstimatorSpec model_fn), against a plain Estimator."""
  with open(BERT_MD, encoding='utf-8') as f:
    intro = f.read().split('\n## ', 1)[0]
  refusal = ' '.join(re.search(r'refuses it with\s+"([^"]+)"', intro).group(1).split())
  with pytest.raises(ValueError, match=re.escape(refusal)):
    tf.estimator.Estimator(_tpu_spec_model_fn, model_dir=str(tmp_path / 'bare')).train(
        _input_fn, max_steps=1)
  page = {'model_fn': _tpu_spec_model_fn}
  exec(re.search(r'```python\n(.*?)```', intro, re.S).group(1), page)  # pylint: disable=exec-used
  wrapped = _trained_kernel(page['plain_model_fn'], tmp_path, 'wrapped')
  decorated = _trained_kernel(et.replicate_model_fn(_tpu_spec_model_fn, devices=['/cpu:0']),
                              tmp_path, 'decorated')
  assert not np.allclose(wrapped, 1.0)   # trained one step
  np.testing.assert_allclose(decorated, wrapped, rtol=1e-6)
