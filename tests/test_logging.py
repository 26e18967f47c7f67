"""What a run prints: each of TensorFlow's lines and each of the library's once.

The reference is a plain Estimator's run of the same model_fn in a fresh
process: the towered run prints TensorFlow's lines as often as it does, and
the library's own lines (absl's verbosity INFO) once each, with no
deprecation warning of the library's making.
"""

import os
import subprocess
import sys
import textwrap

import testlib

SCRIPT = textwrap.dedent('''
    import sys, tempfile
    import numpy as np
    import tensorflow as tf
    from absl import logging
    from estimator_towers import replicate_model_fn

    logging.set_verbosity(logging.INFO)
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)

    def model_fn(features, labels, mode):
      logits = tf.compat.v1.layers.dense(features['x'], 2)
      loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
          loss, tf.compat.v1.train.get_global_step())
      return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    def input_fn():
      x = np.random.RandomState(0).randn(64, 4).astype(np.float32)
      return tf.data.Dataset.from_tensor_slices(({'x': x}, (x[:, 0] > 0).astype(np.int32))).batch(16)

    if sys.argv[1] == 'towered':
      model_fn = replicate_model_fn(model_fn, devices=['/cpu:0', '/cpu:1'])
    config = tf.estimator.RunConfig(model_dir=tempfile.mkdtemp(),
        session_config=tf.compat.v1.ConfigProto(device_count={'CPU': 2}))
    tf.estimator.Estimator(model_fn, config=config).train(input_fn, max_steps=2)
''')


def run(kind: str, tmp_path) -> list[str]:
  env = dict(os.environ, TMPDIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL='2')
  done = subprocess.run([sys.executable, '-c', SCRIPT, kind], env=env, capture_output=True,
                        text=True, timeout=240, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stderr.splitlines()


def test_tensorflow_lines_print_once_as_with_a_plain_estimator(tmp_path):
  plain, towered = run('plain', tmp_path), run('towered', tmp_path)
  for line in ['Loss for final step', 'Saving checkpoints for 2 into']:
    assert sum(line in l for l in plain) == 1, plain
    assert sum(line in l for l in towered) == 1, towered


def test_the_library_lines_print_once_at_absl_info(tmp_path):
  lines = run('towered', tmp_path)
  placement = [l for l in lines if 'estimator_towers: train graph: 2 tower(s)' in l]
  assert placement == [
      'INFO:absl:estimator_towers: train graph: 2 tower(s) on /device:CPU:0, /device:CPU:1; '
      'variables on /device:CPU:0 (variable_strategy=cpu, chosen for towers on CPU devices: '
      'the host adds their gradients, loss_reduction=auto).'], placement
  assert sum('Loss for final step' in l for l in lines) == 1
  # and no deprecation warning of its making (Estimator's own aside: a plain run makes them)
  log = '\n'.join(lines)
  assert not testlib.library_deprecations(log), testlib.library_deprecations(log)


def test_the_library_logs_only_through_base_logs():
  """absl's `logging.info` (and the standard `logging.info`) install a handler on the root
  logger when it has none, after which each of TensorFlow's lines prints twice: every
  module logs through `estimator_towers.base.logs`."""
  import re  # pylint: disable=g-import-not-at-top
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      'estimator_towers')
  calls = re.compile(r'^\s*(?:from absl import logging|import absl\.logging|from absl\.logging '
                     r'import)|(?<![.\w])logging\.(?:debug|info|warning|warn|error|exception|log|'
                     r'fatal|critical)\(', re.M)
  found = []
  for folder, _, names in os.walk(root):
    for name in names:
      path = os.path.join(folder, name)
      if name.endswith('.py') and path != os.path.join(root, 'base', 'logs.py'):
        with open(path, encoding='utf-8') as f:
          found += [f'{os.path.relpath(path, root)}: {m.group(0).strip()}'
                    for m in calls.finditer(f.read())]
  assert not found, found
