"""shards=S: the fixed shard grid gives bit-identical checkpoints on any topology.

The reference of every comparison is the same model_fn decorated for one
device with the same grid (`shards=4` on '/cpu:0': four towers side by side
on it), trained by an Estimator on the same global batches: keyed draws make
its dropout the one every topology draws, so the undecorated model_fn is no
reference for a model with dropout. Every variable and optimizer slot after
3 steps must be `np.array_equal` to it (no tolerance) on 2 and 4 devices,
1 device x 2 micro-batches and 2 x 2, for three models:

- dense layers with dropout and a token-weighted loss (fractional weights:
  its normaliser is a sum of non-integers);
- two batch norms (synchronised: the tf.nn.moments path and the fused
  kernel's, each tower's gradient of the statistics summed over the shards in
  the grid's order) before dropout, under the same loss (micro-batches
  excluded: synchronised batch norm refuses them);
- an in-batch softmax of two encoders after dropout (the whole-batch head).

A run stopped after 2 steps on 4 devices and resumed for 1 on 2 equals the
reference too, and so do 4 devices on batches of 14 rows (shards of 4, 4, 3
and 3, the batch size known at run time only) and every variable strategy. The grid's synchronised batch norms, without dropout, train as the undecorated
model_fn to float32 rounding. The control: the same model on 4 devices without the grid
differs from one device (rounding, which training amplifies), so the
comparisons can fail; with the fixed summation order taken out
(`fixed_order.FixedOrder.total` as a device-first AddN) the 4-device run
differs too. EVAL's metrics (weighted means) are bit-identical on every topology
too, their state adding the shards' parts in shard order; the control adds them
in reverse order. Staged input (`staged_input_fn`) is bit-identical too, its
towers staged by the grid's cut. The divisibility error names the divisors of S.
"""

import tempfile

import numpy as np
import pytest
import tensorflow as tf

import testlib
import estimator_towers as et
from estimator_towers.gradients import fixed_order
from estimator_towers.inputs import grid
from estimator_towers.towers import metric_order

B, F, T, S = 16, 6, 3, 4
STEPS = 3
_RNG = np.random.RandomState(0)
X = _RNG.randn(64, T, F).astype(np.float32)
Y = _RNG.randint(0, 4, size=(64, T)).astype(np.int32)
W = ((_RNG.rand(64, T) > 0.3) * _RNG.rand(64, T)).astype(np.float32)


def input_fn(batch=B):
  ds = tf.data.Dataset.from_tensor_slices(({'x': X, 'w': W}, Y)).repeat()
  return ds.batch(batch, drop_remainder=batch == B)


def _const(shape, lo, hi):
  return tf.compat.v1.constant_initializer(np.linspace(lo, hi, np.prod(shape)).reshape(shape))


def _weighted_loss(logits, labels, weights):
  per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  return tf.reduce_sum(per * weights) / tf.reduce_sum(weights)


def _spec(mode, loss, adam=True):
  optimizer = (tf.compat.v1.train.AdamOptimizer(0.05) if adam
               else tf.compat.v1.train.GradientDescentOptimizer(0.5))
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def dense_model(features, labels, mode):
  train = mode == tf.estimator.ModeKeys.TRAIN
  h = tf.compat.v1.layers.dense(features['x'], 8, tf.nn.relu,
                                kernel_initializer=_const((F, 8), -1, 1))
  h = tf.compat.v1.layers.dropout(h, 0.3, training=train)
  logits = tf.compat.v1.layers.dense(h, 4, kernel_initializer=_const((8, 4), -0.5, 0.7))
  return _spec(mode, _weighted_loss(logits, labels, features['w']))


def batch_norm_model(features, labels, mode, dropout=0.3, adam=True):
  """Both synchronised batch norms: the tf.nn.moments path (rank 2) and the fused kernel's
  (rank 4), then dropout."""
  train = mode == tf.estimator.ModeKeys.TRAIN
  x = tf.reshape(features['x'], [-1, T * F])
  # No bias before a batch norm: its gradient is zero up to rounding, which Adam amplifies.
  h = tf.compat.v1.layers.dense(x, 8, use_bias=False,
                                kernel_initializer=_const((T * F, 8), -1, 1))
  h = tf.nn.relu(tf.compat.v1.layers.batch_normalization(h, training=train))
  h = tf.compat.v1.layers.batch_normalization(tf.reshape(h, [-1, 2, 2, 2]), training=train)
  h = tf.compat.v1.layers.dropout(tf.reshape(h, [-1, 8]), dropout, training=train)
  logits = tf.compat.v1.layers.dense(h, 4, kernel_initializer=_const((8, 4), -0.5, 0.7))
  return _spec(mode, _weighted_loss(logits, labels[:, 0], features['w'][:, 0]), adam)


def batch_norm_model_without_dropout(features, labels, mode):
  """Against the undecorated model_fn: plain SGD (Adam's first steps are the gradient's
  sign, which amplifies rounding where a gradient is near zero)."""
  return batch_norm_model(features, labels, mode, dropout=0.0, adam=False)


def in_batch_softmax_model(features, labels, mode):
  del labels
  x = tf.compat.v1.layers.dropout(features['x'][:, 0], 0.2,
                                  training=mode == tf.estimator.ModeKeys.TRAIN)
  q = tf.math.l2_normalize(tf.compat.v1.layers.dense(
      x[:, :3], 4, kernel_initializer=_const((3, 4), -1, 1)), -1)
  d = tf.math.l2_normalize(tf.compat.v1.layers.dense(
      x[:, 3:], 4, kernel_initializer=_const((3, 4), 1, -0.3)), -1)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  rows = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.range(tf.shape(q)[0]), logits)
  return _spec(mode, tf.reduce_mean(rows))


def batch_norm_in_batch_softmax_model(features, labels, mode):
  """A synchronised batch norm before an in-batch softmax: the whole batch's head reads rows
  computed through the batch norm's exchange (its first pass, per shard, reads the step's
  statistics). Plain SGD, no dropout: against the undecorated model_fn."""
  del labels
  train = mode == tf.estimator.ModeKeys.TRAIN
  x = tf.reshape(features['x'], [-1, T * F])
  h = tf.compat.v1.layers.dense(x, 8, use_bias=False, kernel_initializer=_const((T * F, 8), -1, 1))
  h = tf.nn.relu(tf.compat.v1.layers.batch_normalization(h, training=train))
  q = tf.math.l2_normalize(tf.compat.v1.layers.dense(
      h, 4, kernel_initializer=_const((8, 4), -1, 1)), -1)
  d = tf.math.l2_normalize(tf.compat.v1.layers.dense(
      tf.nn.tanh(h), 4, kernel_initializer=_const((8, 4), 1, -0.3)), -1)
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  rows = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.range(tf.shape(q)[0]), logits)
  return _spec(mode, tf.reduce_mean(rows), adam=False)


def channels_first_moments_model(features, labels, mode):
  """A batch norm's tf.nn.moments path over axes [0, 2, 3] (channels first, not fused):
  its statistics and their gradient reshaped around the channel axis. Plain SGD."""
  train = mode == tf.estimator.ModeKeys.TRAIN
  x = tf.reshape(features['x'], [-1, T * F])
  h = tf.compat.v1.layers.dense(x, 8, use_bias=False, kernel_initializer=_const((T * F, 8), -1, 1))
  h = tf.compat.v1.layers.batch_normalization(tf.reshape(h, [-1, 2, 2, 2]), axis=1, fused=False,
                                              training=train)
  logits = tf.compat.v1.layers.dense(tf.nn.relu(tf.reshape(h, [-1, 8])), 4,
                                     kernel_initializer=_const((8, 4), -0.5, 0.7))
  return _spec(mode, _weighted_loss(logits, labels[:, 0], features['w'][:, 0]), adam=False)


MODELS = {'dense': dense_model, 'batch_norm': batch_norm_model,
          'channels_first_moments': channels_first_moments_model,
          'batch_norm_in_batch_softmax': batch_norm_in_batch_softmax_model,
          'in_batch_softmax': in_batch_softmax_model,
          'batch_norm_without_dropout': batch_norm_model_without_dropout}
# (devices, micro_batches); batch norm is synchronised, which refuses micro-batches.
TOPOLOGIES = {'dense': [(2, 1), (4, 1), (1, 2), (2, 2)],
              'batch_norm': [(2, 1), (4, 1)],
              'in_batch_softmax': [(2, 1), (4, 1), (1, 2), (2, 2)]}


def _estimator(model, devices, micro=1, shards=S, model_dir=None, strategy='auto'):
  if isinstance(devices, int):
    devices = testlib.cpu_devices(devices)
  fn = et.replicate_model_fn(MODELS[model], devices=devices,
                             micro_batches=micro, shards=shards, variable_strategy=strategy)
  return testlib.make_estimator(fn, num_cpus=4, model_dir=model_dir,
                                checkpoint_save_graph_def=False)


def _train(model, devices, micro=1, shards=S, steps=STEPS, strategy='auto', batch=B):
  estimator = _estimator(model, devices, micro, shards, strategy=strategy)
  estimator.train(lambda: input_fn(batch), steps=steps)
  return testlib.variables(estimator)


_REFERENCES = {}


def _reference(model, batch=B):
  if (model, batch) not in _REFERENCES:
    _REFERENCES[model, batch] = _train(model, 1, batch=batch)
  return _REFERENCES[model, batch]


def _differing(actual, expected):
  assert set(actual) == set(expected)
  return sorted(name for name in expected if not np.array_equal(actual[name], expected[name]))


@pytest.mark.parametrize('model,devices,micro', [
    (model, devices, micro) for model, layouts in TOPOLOGIES.items()
    for devices, micro in layouts])
def test_bit_identical_on_every_topology(model, devices, micro):
  expected = _reference(model)
  assert any('Adam' in name for name in expected)  # the slots are compared too
  assert _differing(_train(model, devices, micro), expected) == []


@pytest.mark.parametrize('strategy,devices', [
    ('collective', 4), ('gpu', 2), ('replicated', 2), ('cpu', ['/cpu:2', '/cpu:3'])])
def test_bit_identical_under_every_variable_strategy(strategy, devices):
  """'collective' and 'replicated': a copy per tower; 'gpu': variables spread over the
  devices; 'cpu' on towers without /cpu:0: the levels above the devices a fixed-order
  reduce-scatter and a gather on /cpu:0."""
  assert _differing(_train('dense', devices, strategy=strategy), _reference('dense')) == []


def test_uneven_shards_of_a_batch_known_at_run_time():
  """14 rows in 4 shards (4, 4, 3, 3) by the one rule, the batch size a run-time value."""
  assert _differing(_train('dense', 4, batch=14), _reference('dense', batch=14)) == []


@pytest.mark.parametrize('model', ['batch_norm', 'in_batch_softmax'])
def test_stopped_on_4_devices_resumed_on_2(model):
  model_dir = tempfile.mkdtemp(prefix='et_')
  _estimator(model, 4, model_dir=model_dir).train(input_fn, steps=STEPS - 1)
  resumed = _estimator(model, 2, model_dir=model_dir)
  resumed.train(input_fn, steps=1)
  assert _differing(testlib.variables(resumed), _reference(model)) == []


@pytest.mark.parametrize('model', ['batch_norm_without_dropout', 'channels_first_moments',
                                   'batch_norm_in_batch_softmax'])
def test_synchronised_batch_norms_on_the_grid_train_as_plain(model):
  """The grid's batch statistics and their explicit gradients (both paths: tf.nn.moments
  and the fused kernel), and a batch norm under an in-batch softmax (the head's first pass
  per shard), against the undecorated model_fn on the whole batch: every variable within
  float32 rounding."""
  plain = testlib.make_estimator(MODELS[model], num_cpus=4, checkpoint_save_graph_def=False)
  plain.train(input_fn, steps=STEPS)
  # 2e-6: rounding leaves 1.8e-7 here, and M2's gradient 5% off moves a variable 8.5e-6.
  testlib.assert_variables_close(_train(model, 4), testlib.variables(plain), tol=2e-6)


def test_control_without_the_grid_differs():
  one = _train('dense', 1, shards=None)
  four = _train('dense', 4, shards=None)
  assert _differing(four, one)


def test_control_without_the_fixed_order_differs(monkeypatch):
  """Summed by the placement's rule (a device-first AddN, on 4 devices: on 2, the two
  devices' sums added either way are the same bits) instead of the fixed tree."""
  reference = _reference('batch_norm')  # before the patch

  def unordered(self, parts, aggregation_device, on_node=None):
    del self, on_node
    present = [parts[k] for k in sorted(parts) if parts[k] is not None]
    by_device = {}
    for value in present:
      by_device.setdefault(value.device, []).append(value)
    with tf.device(aggregation_device):
      return tf.add_n([tf.add_n(group) for group in by_device.values()][::-1])
  monkeypatch.setattr(fixed_order.FixedOrder, 'total', unordered)
  assert _differing(_train('batch_norm', 4), reference)


def test_divisibility_error_names_the_divisors():
  with pytest.raises(grid.GridError) as raised:
    grid.check_grid(6, 4)
  assert str(raised.value) == (
      'shards=6 cannot be dealt out on 4 device(s) x 1 micro-batch(es) x 1 worker(s) = 4: '
      'devices x micro-batches x workers must divide shards, so that every device runs '
      'the same number of whole shards. The divisors of 6 are [1, 2, 3, 6]; choose a '
      'topology whose product is one of them, or a shards count that 4 divides.')
  with pytest.raises(grid.GridError, match=r'shards=12 on 2 device\(s\) gives 6 shards per '
                     r'device, not a power of two.*\[1, 2, 3, 4, 6, 12\]'):
    grid.check_grid(12, 2)
  grid.check_grid(8, 2, 2)
  grid.check_grid(6, 1, 3)   # one device: any S its micro-batches divide


def test_divisibility_error_at_graph_construction():
  fn = et.replicate_model_fn(dense_model, devices=testlib.cpu_devices(4), shards=6)
  with tf.Graph().as_default():
    tf.compat.v1.train.get_or_create_global_step()
    features, labels = tf.compat.v1.data.make_one_shot_iterator(input_fn()).get_next()
    with pytest.raises(grid.GridError, match=r'The divisors of 6 are \[1, 2, 3, 6\]'):
      fn(features, labels, mode=tf.estimator.ModeKeys.TRAIN,
         config=testlib.run_config(4))


@pytest.mark.parametrize('devices,micro', [(2, 1), (4, 1), (2, 2)])
def test_staged_input_bit_identical(devices, micro):
  """staged_input_fn stages each tower's rows by the grid's cut (14 rows: shards of 4, 4, 3
  and 3; on 2 devices x 2 micro-batches a tower's 8 and 6 rows, split on its device), not
  by the towers' own even cut (7 and 7, which would give shards of 4, 3, 4 and 3)."""
  plan = et.make_plan(devices=testlib.cpu_devices(devices), micro_batches=micro, shards=S)
  estimator = testlib.make_estimator(et.replicate_model_fn(dense_model, plan=plan),
                                     num_cpus=4, checkpoint_save_graph_def=False)
  estimator.train(et.staged_input_fn(lambda: input_fn(14), plan), steps=STEPS)
  assert _differing(testlib.variables(estimator), _reference('dense', batch=14)) == []


@pytest.mark.parametrize('value', [0, -2, 2.0, True, '4'])
def test_shards_must_be_a_positive_integer(value):
  with pytest.raises(ValueError, match='shards must be a positive integer'):
    et.make_plan(shards=value)


def test_shards_in_make_plan_make_config_and_plan_conflicts():
  assert et.make_plan(shards=8).shards == 8
  assert et.make_config(num_cpu_devices=2, shards=8).plan.shards == 8
  with pytest.raises(ValueError, match=r'Give either plan or shards=8'):
    et.replicate_model_fn(dense_model, plan=et.make_plan(), shards=8)


def eval_model(features, labels, mode):
  """The dense model's EVAL with metrics that add fractional values: a weighted mean of
  the per-example losses, a mean of the logits, an accuracy weighted by the tokens."""
  logits = tf.compat.v1.layers.dense(
      tf.compat.v1.layers.dense(features['x'], 8, tf.nn.relu,
                                kernel_initializer=_const((F, 8), -1, 1)),
      4, kernel_initializer=_const((8, 4), -0.5, 0.7))
  per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  loss = _weighted_loss(logits, labels, features['w'])
  if mode == tf.estimator.ModeKeys.TRAIN:
    return _spec(mode, loss)
  return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
      'weighted_loss': tf.compat.v1.metrics.mean(per, weights=features['w']),
      'mean_logit': tf.compat.v1.metrics.mean(logits),
      'accuracy': tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, -1),
                                                weights=features['w'])})


@pytest.fixture(scope='module')
def eval_checkpoint():
  """A model_dir with the eval model trained one step on one device (the metrics' inputs)."""
  estimator = testlib.make_estimator(
      et.replicate_model_fn(eval_model, devices=['/cpu:0'], shards=S), num_cpus=4,
      checkpoint_save_graph_def=False)
  estimator.train(input_fn, steps=1)
  return estimator.model_dir


def _evaluate(model_dir, devices, micro=1, shards=S):
  fn = et.replicate_model_fn(eval_model, devices=testlib.cpu_devices(devices),
                             micro_batches=micro, shards=shards)
  estimator = testlib.make_estimator(fn, num_cpus=4, model_dir=model_dir)
  return estimator.evaluate(lambda: input_fn().take(4), name=f'{devices}x{micro}')


@pytest.fixture(scope='module')
def eval_reference(eval_checkpoint):
  """The metrics of one device (the grid's 4 shards side by side on it), evaluated once."""
  return _evaluate(eval_checkpoint, 1)


@pytest.mark.parametrize('devices,micro', [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_eval_metrics_bit_identical_on_every_topology(eval_checkpoint, eval_reference, devices,
                                                      micro):
  """4 batches of 16: each metric's state adds the 4 shards' parts in shard order, per batch."""
  reference = eval_reference
  metrics = _evaluate(eval_checkpoint, devices, micro)
  assert {k: metrics[k] for k in reference if metrics[k] != reference[k]} == {}
  assert reference['weighted_loss'] != reference['loss']  # the metrics are not the loss


def test_eval_metrics_control_in_reverse_shard_order_differ(eval_checkpoint, eval_reference,
                                                            monkeypatch):
  reference = eval_reference   # evaluated before the patch
  chained = metric_order.in_shard_order
  monkeypatch.setattr(metric_order, 'in_shard_order', lambda updates: chained(updates[::-1]))
  reversed_order = _evaluate(eval_checkpoint, 4)
  assert [k for k in ('weighted_loss', 'mean_logit') if reversed_order[k] != reference[k]]
