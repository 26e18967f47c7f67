"""Issue 33: models whose rows depend on other examples of the batch.

Exact towers: a loss that depends on ops mixing the batch's rows (an in-batch
softmax's matrix product, CLIP's symmetric loss with a trained temperature,
SimCLR's stacked views, a batch top-k, an opaque function, mixup's reverse,
attention over the batch) trains on towers as the plain model_fn on the whole
batch: its head runs on the whole batch's rows (`whole_batch_head`), row-wise
per tower where it is made of rows (`row_wise_head`).

Micro-batches: the head reads the rows of a first pass over the
micro-batches and its gradient seeds each micro-batch's backward pass
(`cached_gradients`), exact as well; a random op before the frontier is
refused.

Never silently wrong: where the library does not compute such an op on the
whole batch (a static batch size whose shape reads the head would take for
constants), one warning at
graph construction names it and says why, not the loss algebra's;
`loss_reduction='exact'` makes it an error, and micro-batches refuse it. A
per-example model gets no warning.
"""

import functools

import numpy as np
import pytest
import tensorflow as tf

import cross_example_models as patterns
import testlib
import estimator_towers as et
from estimator_towers.base import logs
from estimator_towers.heads import whole_batch_head
from estimator_towers.towers import unsplit as towers

ModeKeys = tf.estimator.ModeKeys
BATCH = 10


@pytest.fixture
def warnings(monkeypatch):
  return testlib.logged_warnings(monkeypatch)


def _model_fn(pattern, features, labels, mode):
  loss, _ = pattern(features['x'], labels)
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss)
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


def _build(name, mode=ModeKeys.TRAIN, num_devices=3, static=False, **plan):
  """The towered graph of pattern `name` (built, not run); the batch size unknown unless static."""
  model_fn = functools.partial(_model_fn, patterns.PATTERNS[name][0] if name in patterns.PATTERNS
                               else getattr(patterns, name))
  towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices), **plan)
  x = np.random.RandomState(0).randn(BATCH, patterns.F).astype(np.float32)
  y = np.arange(BATCH, dtype=np.int32) % 3
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    if static:
      return towered({'x': tf.constant(x)}, tf.constant(y), mode, None, None)
    return towered({'x': tf.compat.v1.placeholder_with_default(x, [None, patterns.F])},
                   tf.compat.v1.placeholder_with_default(y, [None]), mode, None, None)


def _ours(found):
  return [w for w in found if 'other examples of the batch' in w or 'loss algebra' in w]


def _two_tensors_model_fn(pattern, features, labels, mode):
  """A gradient request of two tensors: one scalar's gradient (`request_seeds`), exact."""
  loss, _ = pattern(features['x'], labels)
  tvars = tf.compat.v1.trainable_variables()
  grads = tf.gradients([loss, 0.5 * loss], tvars)
  train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).apply_gradients(
      zip(grads, tvars), tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


_STATIC = 'no head here (a stand-in for a head that cannot be built)'


@pytest.fixture
def no_head(monkeypatch):
  """The whole batch's head cannot be built (what remains without one: the message)."""
  monkeypatch.setattr(whole_batch_head, 'build', lambda *a, **k: _STATIC)


@pytest.mark.parametrize('name,op,why', [
    ('in_batch_softmax', "MatMul op 'MatMul'", _STATIC),
    ('top_k', "TopKV2 op 'TopKV2' (a top-k across the batch axis)", _STATIC),
    ('opaque', "PartitionedCall op 'PartitionedCall' (a function call the library cannot see "
               "inside, fed by the batch's rows), which may make a row depend on other "
               "examples of the batch",
     # the function's static shapes are the shard's: its gradient on 10 rows fails
     'building it on the whole batch failed (Incompatible shapes'),
])
def test_without_a_head_a_mixing_op_warns_once_naming_it(name, op, why, warnings, monkeypatch):
  """No head: the opaque function's static shapes; the others, a head that cannot be built."""
  if why == _STATIC:
    monkeypatch.setattr(whole_batch_head, 'build', lambda *a, **k: _STATIC)
  _build(name, static=True)
  found = _ours(warnings)
  assert len(found) == 1, found
  assert op in found[0], found[0]
  assert 'a row depend on other examples of the batch' in found[0]
  assert f"the whole batch's head cannot be built here: {why}" in found[0], found[0]
  assert 'loss algebra' not in found[0] and 'arithmetic on statistics' not in found[0]
  assert "Pass loss_reduction='exact' to make this an error" in found[0]


def test_the_warning_says_why_and_counts_the_other_ops(warnings, no_head):
  _build('simclr', static=True)
  found = _ours(warnings)
  assert len(found) == 1, found
  assert ("a matrix product of two operands that depend on the batch) (and 3 more such ops"
          in found[0]), found[0]


def test_train_with_a_whole_batch_head_does_not_warn(warnings):
  for name in ('in_batch_softmax', 'top_k', 'opaque', 'simclr'):
    _build(name)
    _build(name, loss_reduction='exact')   # exact: no error either
  assert not _ours(warnings), _ours(warnings)


@pytest.mark.parametrize('name', ['in_batch_softmax', 'clip', 'simclr'])
def test_a_static_batch_size_builds_the_head_without_warning(name, warnings):
  """tf.shape(q)[0] of a static shard stays a shape read: the head reads the whole batch's
  size (tests/test_static_batch.py trains it)."""
  _build(name, static=True)
  _build(name, num_devices=1, static=True, micro_batches=3)
  assert not _ours(warnings), _ours(warnings)


def test_loss_reduction_exact_makes_it_an_error(no_head):
  with pytest.raises(ValueError, match=r"depends on TopKV2 op 'TopKV2' \(a top-k across the "
                                       r"batch axis\).*loss_reduction='exact' makes this an error"):
    _build('top_k', static=True, loss_reduction='exact')


def test_micro_batches_without_a_head_is_an_error_saying_why(no_head):
  """No whole-batch head, so micro-batches cannot train it."""
  with pytest.raises(ValueError, match=r"micro_batches > 1 cannot train this model_fn: the "
                                       r"loss .* on MatMul op 'MatMul'.*so such a loss "
                                       r"trains only through its head on the whole batch, which "
                                       r"cannot be built here: no head here.*Use micro_batches=1"):
    _build('in_batch_softmax', num_devices=1, micro_batches=2)


@pytest.mark.parametrize('mode', [ModeKeys.TRAIN, ModeKeys.EVAL])
def test_per_example_model_does_not_warn(mode, warnings):
  _build('per_example', mode=mode)
  _build('per_example', mode=mode, num_devices=1, micro_batches=3)
  assert not _ours(warnings)
  assert not [w for w in warnings if 'on the whole batch' in w], warnings   # towers as ever


# --- Exact towers: the head on the whole batch --------------------------------

NUM_EXAMPLES = 22   # batches of 10, 10 and 2: shards 4/3/3, then 1/1/0 (one empty)


def _data():
  rng = np.random.RandomState(3)
  x = rng.randn(NUM_EXAMPLES, patterns.F).astype(np.float32)
  return x, (np.arange(NUM_EXAMPLES) % 3).astype(np.int32)


def _input_fn(labels=True):
  x, y = _data()
  if not labels:
    return lambda: tf.data.Dataset.from_tensor_slices({'x': x}).batch(BATCH)
  return lambda: tf.data.Dataset.from_tensor_slices(({'x': x}, y)).batch(BATCH)


def _features_only(pattern, features, labels, mode):
  assert labels is None
  return _model_fn(pattern, features, tf.cast(features['x'][:, 0] > 0, tf.int32), mode)


def _pattern(name):
  return patterns.PATTERNS[name][0] if name in patterns.PATTERNS else getattr(patterns, name)


@functools.lru_cache(maxsize=None)
def _plain(name, labels=True):
  model_fn = functools.partial(_model_fn if labels else _features_only, _pattern(name))
  return tuple(testlib.train_and_read(testlib.stepwise_estimator(model_fn), _input_fn(labels)))


def _towered(name, labels=True, num_devices=3, micro_batches=1, **plan):
  model_fn = functools.partial(_model_fn if labels else _features_only, _pattern(name))
  est = testlib.stepwise_estimator(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                            micro_batches=micro_batches, **plan),
      num_cpus=num_devices)
  return tuple(testlib.train_and_read(est, _input_fn(labels)))


EXACT = ('in_batch_softmax', 'clip', 'clip_weighted', 'simclr', 'top_k', 'opaque', 'mixup',
         'attention', 'two_levels')


@pytest.mark.parametrize('name', EXACT)
def test_towers_equal_plain_on_the_whole_batch(name, warnings):
  """3 towers: 1 step on shards 4/3/3, then 2 more, the last on 1/1/0 (an empty shard)."""
  plain_1, plain_3 = _plain(name)
  towered_1, towered_3 = _towered(name)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)   # exact: nothing to warn of


@pytest.mark.parametrize('name', ['simclr', 'attention', 'clip'])
def test_features_only_input_equals_plain(name, warnings):
  """labels=None (self-supervised, BERT-style input): the same, from the features alone."""
  plain_1, plain_3 = _plain(name, labels=False)
  towered_1, towered_3 = _towered(name, labels=False)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)


@functools.lru_cache(maxsize=None)
def _two_tensors(name, num_devices=0, micro_batches=1):
  """Variables after steps 1 and 3 of `_two_tensors_model_fn` (num_devices 0: plain)."""
  model_fn = functools.partial(_two_tensors_model_fn, _pattern(name))
  if num_devices:
    model_fn = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices),
                                     micro_batches=micro_batches)
  est = testlib.stepwise_estimator(model_fn, num_cpus=max(num_devices, 1))
  return tuple(testlib.train_and_read(est, _input_fn()))


@pytest.mark.parametrize('layout', [(3, 1), (1, 2)])
@pytest.mark.parametrize('name', ['in_batch_softmax', 'top_k', 'opaque'])
def test_a_request_of_two_tensors_equals_plain(name, layout, warnings):
  """tf.gradients([loss, 0.5 * loss]): the head of their sum on the whole batch (3 towers,
  1 x 2 micro-batches), no warning (it was: 'the head takes one loss')."""
  plain_1, plain_3 = _two_tensors(name)
  towered_1, towered_3 = _two_tensors(name, *layout)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)


# --- Micro-batches: the head on a first pass's rows (cached_gradients) ----------

LAYOUTS = {'1x3': (1, 3), '2x2': (2, 2)}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
@pytest.mark.parametrize('name', EXACT)
def test_micro_batches_equal_plain_on_the_whole_batch(name, layout, warnings):
  """1 device x 3 micro-batches (4/3/3, then 1/1/0) and 2 x 2 (3/2/3/2, then 1/0/1/0)."""
  num_devices, micro_batches = LAYOUTS[layout]
  plain_1, plain_3 = _plain(name)
  towered_1, towered_3 = _towered(name, num_devices=num_devices, micro_batches=micro_batches)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)


@pytest.mark.parametrize('strategy', ['replicated', 'gpu'])
def test_micro_batches_with_variables_on_the_devices_equal_plain(strategy):
  """CLIP on 2 x 2: the first pass and the head read device 0's values; each device's passes
  its own copies ('replicated'), or variables spread over the devices ('gpu')."""
  plain_1, plain_3 = _plain('clip')
  towered_1, towered_3 = _towered('clip', num_devices=2, micro_batches=2,
                                  variable_strategy=strategy)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)


def test_micro_batches_features_only_input_equal_plain(warnings):
  plain_1, plain_3 = _plain('simclr', labels=False)
  towered_1, towered_3 = _towered('simclr', labels=False, num_devices=1, micro_batches=3)
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)


def _tensor_and_dict_model_fn(features, labels, mode):
  """Features a Tensor, labels a dict."""
  return _model_fn(patterns.clip, {'x': features}, labels['y'], mode)


def _tensor_and_dict_input_fn():
  x, y = _data()
  return lambda: tf.data.Dataset.from_tensor_slices((x, {'y': y})).batch(BATCH)


@functools.lru_cache(maxsize=None)
def _tensor_and_dict_plain():
  est = testlib.stepwise_estimator(_tensor_and_dict_model_fn)
  return tuple(testlib.train_and_read(est, _tensor_and_dict_input_fn()))


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_micro_batches_features_a_tensor_labels_a_dict_equal_plain(layout):
  num_devices, micro_batches = LAYOUTS[layout]
  plain_1, plain_3 = _tensor_and_dict_plain()
  towered = et.replicate_model_fn(_tensor_and_dict_model_fn,
                                  devices=testlib.cpu_devices(num_devices),
                                  micro_batches=micro_batches)
  towered_1, towered_3 = testlib.train_and_read(
      testlib.stepwise_estimator(towered, num_cpus=num_devices), _tensor_and_dict_input_fn())
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)


@pytest.mark.parametrize('plan,layout,shard,fix', [
    (dict(micro_batches=3), r'micro_batches > 1', 'micro-batch', r'Apply it after the mixing ops'),
    # The grid's shards each have a backward pass of their own: the same two passes.
    (dict(shards=2), r'shards=S', 'shard', r'train without shards=S'),
], ids=['micro_batches', 'grid'])
def test_a_random_op_before_the_cut_drawn_per_shard_is_refused(plan, layout, shard, fix):
  """Drawn per shard, the second forward pass would draw anew (keyed draws: the same)."""
  with pytest.raises(ValueError, match=layout + r" cannot train the loss .* exactly: it mixes "
                                       r"the batch's rows, so each " + shard + r"'s rows "
                                       r"of .* are computed twice.*through the stateful op "
                                       r"dropout/random_uniform/RandomUniform \(RandomUniform\)"
                                       r".*" + fix):
    _build('dropout_before_the_cut', num_devices=1, random_draws='per_shard', **plan)


def test_micro_batches_run_after_the_cached_gradient():
  """Every micro-batch's inputs wait for the head's gradient; a device's first passes chain."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    model_fn = functools.partial(_model_fn, patterns.in_batch_softmax)
    towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(2), micro_batches=2)
    x, y = _data()
    towered({'x': tf.compat.v1.placeholder_with_default(x[:BATCH], [None, patterns.F])},
            tf.compat.v1.placeholder_with_default(y[:BATCH], [None]), ModeKeys.TRAIN, None, None)
    ops = graph.get_operations()
  gates = [op for op in ops if op.name.startswith('micro_batch_gates/')]
  assert len(gates) == 8, [op.name for op in gates]   # x and y of 4 micro-batches
  for op in gates:
    assert any('chunked_head' in c.name for c in op.control_inputs), (op.name,
                                                                       op.control_inputs)
  firsts = {op.name: op for op in ops if op.name.startswith('cached_gradients/')
            and op.type == 'Identity' and not op.inputs[0].name.startswith('cached_gradients')}
  assert len(firsts) == 8, sorted(firsts)   # each micro-batch's x and y, before its first pass
  chained = {name for name, op in firsts.items() if op.control_inputs}
  assert chained == {n for n in firsts if n.startswith(('cached_gradients/shard_1/',
                                                        'cached_gradients/shard_3/'))}, firsts
  for name in chained:
    before = 'shard_0' if 'shard_1' in name else 'shard_2'
    assert all(c.type == 'StopGradient' and f'/{before}/' in f'/{c.name}'
               for c in firsts[name].control_inputs), firsts[name].control_inputs


def _head_ops(name):
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    model_fn = functools.partial(_model_fn, patterns.PATTERNS[name][0] if name in patterns.PATTERNS
                                 else getattr(patterns, name))
    towered = et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3))
    x, y = _data()
    towered({'x': tf.compat.v1.placeholder_with_default(x[:BATCH], [None, patterns.F])},
            tf.compat.v1.placeholder_with_default(y[:BATCH], [None]), ModeKeys.TRAIN, None, None)
    return [op for op in graph.get_operations() if op.name.startswith('whole_batch_head/')]


def test_per_example_losses_gather_nothing():
  """The loss algebra's scalars-only path is kept: no head, no gathered rows."""
  assert _head_ops('per_example') == []


def test_a_head_not_made_of_rows_runs_on_the_first_tower_device(warnings, monkeypatch):
  """A penalty on the whole B x B matrix: not row-wise, so the single head (and exact)."""
  said = []
  monkeypatch.setattr(logs, 'info', lambda fmt, *a: said.append(fmt % a))
  ops = _head_ops('in_batch_regularised')
  assert ops and {op.device for op in ops} == {'/device:CPU:0'}, {op.device for op in ops}
  # Gathered: the two encoders' rows, once each (no other tensor is gathered).
  concats = [op for op in ops if op.type == 'ConcatV2' and op.inputs[0].dtype == tf.float32]
  assert len(concats) == 2, [op.name for op in concats]
  assert [m for m in said if 'runs on the whole batch on /device:CPU:0.' in m], said
  plain_1, plain_3 = _plain('in_batch_regularised')
  towered_1, towered_3 = _towered('in_batch_regularised')
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)


def _built_towers_model_fn(pattern, features, labels, mode):
  """Asks for its tower, so that every tower is built by running it (not copied)."""
  et.current_tower()
  return _model_fn(pattern, features, labels, mode)


@pytest.mark.parametrize('name', ['clip', 'clip_weighted'])
def test_a_row_wise_head_on_built_towers_equals_plain(name, warnings):
  """Towers built one by one (not copied): the same seeds, the same update as plain."""
  plain_1, plain_3 = _plain(name)
  hook = _GraphHook()
  est = testlib.stepwise_estimator(
      et.replicate_model_fn(functools.partial(_built_towers_model_fn, _pattern(name)),
                            devices=testlib.cpu_devices(3)), num_cpus=3)
  towered_1, towered_3 = testlib.train_and_read(est, _input_fn(), hooks=[hook])
  assert any(op.name.startswith('tower_2/') for op in hook.graph.get_operations())  # built
  assert any(op.name.startswith('row_wise_head/tower_2/') for op in hook.graph.get_operations())
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)


class _GraphHook(tf.compat.v1.train.SessionRunHook):
  def begin(self):
    self.graph = tf.compat.v1.get_default_graph()


@functools.lru_cache(maxsize=None)
def _row_wise_tensors(name):
  """(op, device, run-time shape) of every tensor the head made, on a batch of 10 (4/3/3);
  one graph per pattern, read by both tests below."""
  with tf.Graph().as_default() as graph:
    tf.compat.v1.train.create_global_step()
    towered = et.replicate_model_fn(functools.partial(_model_fn, _pattern(name)),
                                    devices=testlib.cpu_devices(3))
    x, y = _data()
    towered({'x': tf.compat.v1.placeholder_with_default(x[:BATCH], [None, patterns.F])},
            tf.compat.v1.placeholder_with_default(y[:BATCH], [None]), ModeKeys.TRAIN, None, None)
    made = [t for op in graph.get_operations() for t in op.outputs
            if op.name.startswith(('row_wise_head/', 'whole_batch_head/'))
            and t.dtype.is_floating]
    config = tf.compat.v1.ConfigProto(device_count={'CPU': 3})
    with tf.compat.v1.Session(config=config) as session:
      session.run(tf.compat.v1.global_variables_initializer())
      values = session.run(made)
  return tuple((t.op.name, t.op.device, v.shape) for t, v in zip(made, values))


@pytest.mark.parametrize('name,views', [('in_batch_softmax', 1), ('clip', 1), ('simclr', 2)])
def test_a_head_made_of_rows_holds_no_batch_by_batch_tensor(name, views):
  """Each tower computes its own rows against the gathered columns: n_k x B (SimCLR: n_k x 2B,
  both views' columns), never B x B."""
  found = _row_wise_tensors(name)
  assert found and all(op.startswith('row_wise_head/') for op, _, _ in found), found
  largest = max(int(np.prod(shape)) for _, _, shape in found)
  assert largest == 4 * views * BATCH, sorted(found, key=lambda f: -int(np.prod(f[2])))[:3]
  for k, rows in enumerate((4, 3, 3)):   # the tower's logits, on its own device
    mine = {op.split('/')[1] for op, device, shape in found
            if shape == (rows, views * BATCH) and device == f'/device:CPU:{k}'}
    assert f'tower_{k}' in mine, (k, mine)


@pytest.mark.parametrize('name', ['in_batch_softmax', 'clip'])
def test_a_row_wise_head_gathers_the_columns_on_every_tower(name):
  """An all-gather: each tower concatenates the towers' rows of the columns on its own device
  (each receives the others' rows straight from them), not on the first tower's and sent on."""
  found = _row_wise_tensors(name)
  for k in range(3):
    mine = [op for op, device, shape in found if shape == (BATCH, 4) and 'concat' in op
            and op.startswith(f'row_wise_head/tower_{k}/') and device == f'/device:CPU:{k}']
    assert mine, (k, [f for f in found if f[2] == (BATCH, 4)])


def _ancestors(tensors):
  seen, todo = set(), [t.op for t in tensors]
  while todo:
    op = todo.pop()
    if op.name not in seen:
      seen.add(op.name)
      todo.extend([i.op for i in op.inputs] + list(op.control_inputs))
  return seen


@pytest.mark.parametrize('name,linear', [('in_batch_softmax', True), ('clip', True),
                                         ('clip_weighted', True), ('in_batch_log_loss', False)])
def test_a_linear_tail_lets_each_tower_start_its_backward_alone(name, linear):
  """A mean of the per-row values (CLIP's weighted sum of two, with a trained weight too) seeds
  each tower's rows with coefficients known in advance: no tower's backward pass waits for the
  per-row values of the others (only the loss's value gathers them). A tail that is not linear
  (the log of the mean) must wait for them."""
  graph = _build(name).loss.graph
  gathered = [op.name for op in graph.get_operations()
              if op.name.startswith('row_wise_head/whole/') and op.type == 'ConcatV2'
              and op.outputs[0].shape.rank == 1
              and all(i.op.name.startswith('row_wise_head/tower_') for i in op.inputs[:-1])]
  assert gathered, 'no per-row values gathered'
  backward = [t for op in graph.get_operations()
              if op.name.startswith('row_wise_head/local_gradients/') for t in op.outputs]
  waits = set(gathered) & _ancestors(backward)
  assert (not waits) == linear, (waits, gathered)


def test_a_tail_not_linear_in_the_rows_equals_plain(warnings):
  """The log of the mean: each tower's seeds wait for every per-row value, and stay exact."""
  plain_1, plain_3 = _plain('in_batch_log_loss')
  towered_1, towered_3 = _towered('in_batch_log_loss')
  testlib.assert_variables_close(towered_1, plain_1)
  testlib.assert_variables_close(towered_3, plain_3)
  assert not _ours(warnings), _ours(warnings)


# --- EVAL: loss and metrics of cross-example tensors ----------------------------

def _retrieval_model_fn(features, labels, mode, per_example_loss=False):
  """Two-tower retrieval with in-batch negatives; EVAL: an in-batch retrieval accuracy.

  With `per_example_loss`, the loss is each pair's own score: only the metrics mix rows.
  """
  q, d = patterns.encoders(features['x'])
  logits = tf.matmul(q, d, transpose_b=True) / 0.1
  targets = tf.range(tf.shape(q)[0])
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
  if per_example_loss:
    loss = -tf.reduce_mean(tf.reduce_sum(q * d, 1))
  if mode == ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'retrieval_accuracy': tf.compat.v1.metrics.accuracy(
            targets, tf.argmax(logits, 1, output_type=tf.int32)),
        'positive_logit': tf.compat.v1.metrics.mean(tf.linalg.diag_part(logits)),
        'query_norm': tf.compat.v1.metrics.mean(tf.norm(q, axis=1)),
    })
  optimizer = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
  return tf.estimator.EstimatorSpec(
      mode, loss=loss, train_op=optimizer.minimize(loss, tf.compat.v1.train.get_global_step()))


@pytest.mark.parametrize('per_example_loss', [False, True])
def test_eval_of_cross_example_metrics_equals_plain(per_example_loss, warnings, monkeypatch):
  """Batches 10, 10, 2 (shards 4/3/3 and 1/1/0): loss and metrics as plain's, same checkpoint."""
  monkeypatch.setattr(towers, '_logged', set())   # its log line, said once per process
  model_fn = functools.partial(_retrieval_model_fn, per_example_loss=per_example_loss)
  plain = testlib.make_estimator(model_fn)
  plain.train(_input_fn(), steps=2)
  expected = plain.evaluate(_input_fn(), name='plain')
  towered = testlib.make_estimator(
      et.replicate_model_fn(model_fn, devices=testlib.cpu_devices(3)),
      num_cpus=3, model_dir=plain.model_dir)
  actual = towered.evaluate(_input_fn(), name='towered')
  assert sorted(actual) == sorted(expected)
  for key in expected:
    testlib.assert_close(actual[key], expected[key], err_msg=key)
  assert 0 < expected['retrieval_accuracy'] < 1   # in-batch: not trivially 0 or 1
  said = [w for w in warnings if 'EVAL loss or metrics mix the batch' in w]
  assert len(said) == 1 and 'evaluates on the whole batch on /device:CPU:0' in said[0], warnings
  assert not _ours(warnings), _ours(warnings)
