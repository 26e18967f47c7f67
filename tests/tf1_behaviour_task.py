"""The core equivalence checks under TF1 behaviour, in a process of their own.

`python tests/tf1_behaviour_task.py BEHAVIOUR CASE...` switches TF1 behaviour
on first (process-global, so never in the pytest process):
`disable_v2_behavior()` ('v1') or one of its parts ('tensorshape',
'ref_variables', 'control_flow_v1'); then, per CASE (a key of `CASES`), trains
the plain model_fn (once per model: each of its cases' reference) and the towered
one (steps 1 and 3, every variable and slot within 1e-5:
`testlib.assert_variables_close`) and counts the heavy ops per device of the
TRAIN graph the towered train() call built over the plain one's
(`heavy_ops.least_share`). Prints one JSON line
per case: {"case", "error" (None if exact), "share"}; case 'hooks_2x2' checks
what hooks and summaries read instead (`run_hooks`), and the cases of REFUSED
that a batch norm with micro-batches stops with the error naming the choice
(`run_refused`). Run by
tests/test_tf1_behaviour.py.
"""

import json
import os
import sys
import traceback

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top

import testlib  # pylint: disable=g-import-not-at-top

BEHAVIOURS = testlib.TF1_BEHAVIOURS


def _dense():
  import testlib  # pylint: disable=g-import-not-at-top
  x, y = testlib.data(30)
  return (testlib.v1_model_fn, testlib.input_fn(x, y, 10, epochs=5), {'x': x[:10]}, y[:10],
          None, {})


def _einsum_attention():
  import test_transformers  # pylint: disable=g-import-not-at-top
  x, _ = test_transformers._data()  # pylint: disable=protected-access
  return (test_transformers.einsum_attention_model_fn, test_transformers._input_fn(False),  # pylint: disable=protected-access
          {'x': x}, None, None, {})


def cond_model_fn(features, labels, mode, params):
  """The dense model with a tf.cond not chosen by the batch (control flow v1: Switch, Merge)."""
  import testlib  # pylint: disable=g-import-not-at-top
  hidden = tf.compat.v1.layers.dense(
      features['x'] if isinstance(features, dict) else features, 4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  hidden = tf.cond(tf.compat.v1.placeholder_with_default(True, []),
                   lambda: hidden * 2.0, lambda: hidden)
  logits = tf.compat.v1.layers.dense(
      hidden, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.MomentumOptimizer(0.3, 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _cond():
  import testlib  # pylint: disable=g-import-not-at-top
  x, y = testlib.data(30)
  return cond_model_fn, testlib.input_fn(x, y, 10, epochs=5), {'x': x[:10]}, y[:10], None, {}


def _batch_norm():
  """Keras BatchNormalization with the library's default settings (synchronised)."""
  import testlib  # pylint: disable=g-import-not-at-top
  x, y = testlib.data(30)
  return (testlib.keras_model_fn, testlib.input_fn(x, y, 10, epochs=5), {'x': x[:10]}, y[:10],
          {'learning_rate': 0.5}, {})


def _v1_batch_norm():
  """tf.compat.v1.layers.batch_normalization(training=True), its defaults, twice (its moving
  averages: ref variables' in-place updates under TF1 behaviour); the library's defaults."""
  import test_batch_norm_default as defaults  # pylint: disable=g-import-not-at-top
  import testlib  # pylint: disable=g-import-not-at-top
  x, y = defaults._vectors(30)  # pylint: disable=protected-access
  return (lambda features, labels, mode, params: defaults.v1_layers_model_fn(
      features, labels, mode), testlib.input_fn(x, y, 10, epochs=5), x[:10], y[:10], None, {})


MODELS = {'dense': _dense, 'einsum_attention': _einsum_attention, 'batch_norm': _batch_norm,
          'v1_batch_norm': _v1_batch_norm, 'cond': _cond}
# case: (model, devices, micro-batches); batch norm with micro-batches is refused (REFUSED).
CASES = {'dense_2': ('dense', 2, 1), 'dense_1x2': ('dense', 1, 2), 'dense_2x2': ('dense', 2, 2),
         'einsum_attention_2': ('einsum_attention', 2, 1),
         'einsum_attention_1x2': ('einsum_attention', 1, 2),
         'einsum_attention_2x2': ('einsum_attention', 2, 2),
         'batch_norm_2': ('batch_norm', 2, 1), 'v1_batch_norm_2': ('v1_batch_norm', 2, 1),
         'cond_2x2': ('cond', 2, 2)}
# With micro-batches and the default settings, a batch norm in TRAIN is an error naming the
# choice (sync_batch_norm=False), under TF1 behaviour as under TF2's: case -> (model, k).
REFUSED = {'batch_norm_1x2': ('batch_norm', 2), 'v1_batch_norm_1x2': ('v1_batch_norm', 2)}


def run_hooks() -> dict:
  """tests/test_hook_values.py's model (summaries of the loss, an accuracy, a max, a count,
  the number of examples, the logits and the inputs' images; a hook fetching the loss) on 2
  towers x 2 micro-batches against plain:
  the summaries read back and the hook's values at every step."""
  import tempfile  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import heavy_ops  # pylint: disable=g-import-not-at-top
  import test_hook_values as hooks  # pylint: disable=g-import-not-at-top
  import testlib  # pylint: disable=g-import-not-at-top
  import estimator_towers as et  # pylint: disable=g-import-not-at-top

  def trained(model_fn, num_cpus):
    model_dir = tempfile.mkdtemp()
    built = TrainGraph()
    tf.estimator.Estimator(model_fn, config=testlib.run_config(
        num_cpus, model_dir=model_dir, save_summary_steps=1)).train(
            hooks._input_fn(True), max_steps=hooks.STEPS, hooks=[built])  # pylint: disable=protected-access
    return hooks._events(model_dir), built.graph  # pylint: disable=protected-access

  result = {'case': 'hooks_2x2', 'error': None, 'share': None}
  plain_fetches, towered_fetches = [], []
  towered_fn = et.replicate_model_fn(hooks._model_fn(towered_fetches),  # pylint: disable=protected-access
                                     devices=testlib.cpu_devices(2), micro_batches=2)
  try:
    plain, plain_graph = trained(hooks._model_fn(plain_fetches), 1)  # pylint: disable=protected-access
    towered, towered_graph = trained(towered_fn, 2)
    for tag in ('loss', 'my_loss', 'accuracy', 'max_logit', 'correct', 'examples', 'logits',
                *(f'inputs/image/{i}' for i in range(12))):
      assert len(plain[tag]) == hooks.STEPS, (tag, plain[tag])
      if tag.startswith('inputs/'):   # an image's PNG bytes
        assert towered[tag] == plain[tag], tag
      else:
        testlib.assert_close(np.array(towered[tag], np.float64),
                             np.array(plain[tag], np.float64), err_msg=tag)
    testlib.assert_close(np.array(towered_fetches[0].values),
                         np.array(plain_fetches[0].values), err_msg='the hook\'s loss')
    result['share'] = heavy_ops.least_share(towered_graph, plain_graph, 2)
  except Exception:  # pylint: disable=broad-except
    result['error'] = traceback.format_exc()[-3000:]
  return result


def run_refused(case: str) -> dict:
  """Case `case` of REFUSED: its error (None if training stops at graph construction with
  the error that names the choice); 'share' is None (nothing runs)."""
  import testlib  # pylint: disable=g-import-not-at-top
  import estimator_towers as et  # pylint: disable=g-import-not-at-top
  from estimator_towers.sync_points import batch_norm  # pylint: disable=g-import-not-at-top
  model, micro_batches = REFUSED[case]
  model_fn, input_fn, _, _, params, options = MODELS[model]()
  towered_fn = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(1),
                                     micro_batches=micro_batches, **options)
  result = {'case': case, 'error': None, 'share': None}
  try:
    testlib.make_estimator(towered_fn, params=params).train(input_fn, steps=1)
    result['error'] = 'trained: no error naming sync_batch_norm=False'
  except batch_norm.BatchNormSyncError as e:
    if 'Choose sync_batch_norm=False' not in str(e):
      result['error'] = f'not the error naming the choice: {e}'
  except Exception:  # pylint: disable=broad-except
    result['error'] = traceback.format_exc()[-3000:]
  return result


class TrainGraph(tf.compat.v1.train.SessionRunHook):
  """The TRAIN graph an Estimator's train() call builds: its heavy ops are counted there
  (`heavy_ops.least_share`), as on a graph built for counting alone."""

  def begin(self):
    self.graph = tf.compat.v1.get_default_graph()


def _train_and_read(model_fn, devices, params, input_fn):
  """(variables after steps 1 and 3 of one train() call, the TRAIN graph it built)."""
  import testlib  # pylint: disable=g-import-not-at-top
  built = TrainGraph()
  steps = testlib.train_and_read(
      testlib.stepwise_estimator(model_fn, num_cpus=devices, params=params), input_fn,
      hooks=[built])
  return steps, built.graph


_PLAIN = {}


def _plain(model: str):
  """The plain model_fn of `model` on one device, trained once per process (the reference of
  each of its layouts): `_train_and_read`'s."""
  if model not in _PLAIN:
    model_fn, input_fn, _, _, params, _ = MODELS[model]()
    _PLAIN[model] = _train_and_read(model_fn, 1, params, input_fn)
  return _PLAIN[model]


def run(case: str) -> dict:
  """Case `case` trained towered and plain; its error (None: exact) and heavy-op share."""
  import heavy_ops  # pylint: disable=g-import-not-at-top
  import testlib  # pylint: disable=g-import-not-at-top
  import estimator_towers as et  # pylint: disable=g-import-not-at-top
  model, devices, micro_batches = CASES[case]
  model_fn, input_fn, _, _, params, options = MODELS[model]()
  towered_fn = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(devices),
                                     micro_batches=micro_batches, **options)
  result = {'case': case, 'error': None, 'share': None}
  try:
    plain, plain_graph = _plain(model)
    towered, towered_graph = _train_and_read(towered_fn, devices, params, input_fn)
    for got, expected in zip(towered, plain):
      testlib.assert_variables_close(got, expected)
    result['share'] = heavy_ops.least_share(towered_graph, plain_graph, devices)
  except Exception:  # pylint: disable=broad-except
    result['error'] = traceback.format_exc()[-3000:]
  return result


def main(argv):
  BEHAVIOURS[argv[1]]()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  for case in argv[2:]:
    print(json.dumps(run_hooks() if case == 'hooks_2x2' else run_refused(case)
                     if case in REFUSED else run(case)), flush=True)


if __name__ == '__main__':
  main(sys.argv)
