"""One test per error message of replicate_model_fn and make_plan.

Argument errors are raised when the decorator is applied; input errors when the
graph is built (before any session runs), except a batch-size mismatch that is
only known at run time, which fails the step with the same rule in its message.
"""

import inspect
import itertools
import re

import numpy as np
import pytest
import tensorflow as tf

import testlib
from estimator_towers import make_plan
from estimator_towers import replicate_model_fn

ModeKeys = tf.estimator.ModeKeys


@pytest.mark.parametrize('kwargs,message', [
    (dict(num_gpus=2, devices=['/cpu:0', '/cpu:1']), 'Give either num_gpus or devices, not both'),
    (dict(num_gpus=-3), r'num_gpus must be 0 \(train on the CPU\) or a positive integer .* got -3\. '
     r'Use e\.g\. num_gpus=2'),
    (dict(num_gpus=2.0), r'num_gpus must be 0 .* or a positive integer .* got 2.0'),
    (dict(num_gpus=True), r'num_gpus must be 0 .* or a positive integer .* got True'),
    (dict(devices=['/cpu:0', '/device:CPU:0']),
     r"Each tower needs its own device, but '/device:CPU:0' and '/cpu:0' both name /device:CPU:0"),
    (dict(devices=[]), 'devices must name at least one device'),
    (dict(devices='/cpu:0'), "devices must be a list of device strings, got the single string '/cpu:0'"),
    (dict(devices=['/cpu:0', 'not a device']), "Cannot parse device string 'not a device'"),
    (dict(devices=['/cpu:0', None]), 'A device must be a non-empty string'),
    (dict(devices=['/cpu:0'], variable_strategy='nccl'), "variable_strategy must be one of .* got 'nccl'"),
    (dict(devices=['/cpu:0'], loss_reduction='avg'), "loss_reduction must be one of .* got 'avg'"),
])
def test_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    replicate_model_fn(testlib.v1_model_fn, **kwargs)


def test_allow_cpu_fallback_must_be_a_bool():
  with pytest.raises(ValueError, match="allow_cpu_fallback must be True or False, got 'yes'"):
    make_plan(num_gpus=2, allow_cpu_fallback='yes')


@pytest.mark.parametrize('value', [0, -2, 2.0, True, '2', None])
def test_bad_micro_batches(value):
  with pytest.raises(ValueError, match=r'micro_batches must be a positive integer \(the number '
                     r'of micro-batches each device splits its shard into .* got '
                     + repr(value).replace('.', r'\.') + r'\. Use micro_batches=1 for none'):
    replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0'], micro_batches=value)


def test_micro_batches_with_a_plan():
  plan = make_plan(devices=['/cpu:0'])
  with pytest.raises(ValueError, match=r'Give either plan or micro_batches=2, not both.*'
                                       r'make_plan'):
    replicate_model_fn(testlib.v1_model_fn, plan=plan, micro_batches=2)


def test_bad_staging_depth():
  with pytest.raises(ValueError, match='staging_depth must be a non-negative integer .* got -1'):
    make_plan(devices=['/cpu:0'], staging_depth=-1)


def test_bad_staging_backend():
  with pytest.raises(ValueError, match="staging_backend must be one of .* got 'nccl'"):
    make_plan(devices=['/cpu:0'], staging_backend='nccl')


def test_removed_staging_backend():
  with pytest.raises(ValueError, match="staging_backend='multi_device_iterator' is no longer "
                                       "available: it was removed.*MultiDeviceIterator.*"
                                       "Use staging_backend='staging_area'"):
    make_plan(devices=['/cpu:0'], staging_backend='multi_device_iterator')


def test_count_given_positionally_and_by_keyword():
  with pytest.raises(ValueError, match=r'The device count was given twice: positionally \(2\) and as num_gpus=3'):
    replicate_model_fn(2, num_gpus=3)


def test_plan_and_a_plan_setting_together():
  plan = make_plan(devices=['/cpu:0', '/cpu:1'])
  with pytest.raises(ValueError, match=r'Give either plan or sync_batch_norm=True, not both.*'
                                       r'make_plan'):
    replicate_model_fn(lambda features: None, plan=plan, sync_batch_norm=True)


@pytest.mark.parametrize('value', [1, 'yes'])
def test_resume_input_must_be_a_bool(value):
  with pytest.raises(ValueError, match=f'resume_input must be True or False, got {value!r}: use '
                     r'resume_input=True \(the default\) .* or resume_input=False'):
    replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0'], resume_input=value)


def test_resume_input_with_a_plan():
  plan = make_plan(devices=['/cpu:0'])
  with pytest.raises(ValueError, match=r'Give either plan or resume_input=False, not both.*'
                                       r'make_plan'):
    replicate_model_fn(testlib.v1_model_fn, plan=plan, resume_input=False)
  with pytest.raises(ValueError, match='resume_input must be True or False, got 1'):
    replicate_model_fn(testlib.v1_model_fn, plan=plan, resume_input=1)  # 1 == True: still refused
  replicate_model_fn(testlib.v1_model_fn, plan=plan, resume_input=np.True_)  # numpy's bool is one


def test_plan_and_devices_together():
  with pytest.raises(ValueError, match='Give either plan or num_gpus/devices, not both'):
    replicate_model_fn(testlib.v1_model_fn, devices=['/cpu:0'], plan=make_plan(num_gpus=1))


def test_model_fn_must_be_callable():
  with pytest.raises(TypeError, match='model_fn must be callable'):
    replicate_model_fn('model_fn')


def test_model_fn_must_take_features():
  with pytest.raises(ValueError, match='must take a features argument'):
    replicate_model_fn(lambda labels, mode: None, devices=['/cpu:0', '/cpu:1'])


def _build(model_fn, features, labels, mode=ModeKeys.TRAIN, num_devices=3):
  """Builds the towered graph (does not run it)."""
  towered = replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_devices))
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    return towered(features() if callable(features) else features,
                   labels() if callable(labels) else labels, mode, None, None)


def test_feature_without_batch_dimension():
  features = lambda: {'x': tf.zeros([4, testlib.NUM_FEATURES]), 'scale': tf.constant(2.0)}
  with pytest.raises(ValueError, match=r"feature 'scale' has shape \(\) and no batch dimension"):
    _build(testlib.v1_model_fn, features, lambda: tf.zeros([4], tf.int32))


def test_features_and_labels_with_different_static_batch_sizes():
  with pytest.raises(ValueError, match=r"same batch size .* feature 'x' has 4 rows and label '<tensor>' has 5"):
    _build(testlib.v1_model_fn, lambda: {'x': tf.zeros([4, testlib.NUM_FEATURES])},
           lambda: tf.zeros([5], tf.int32))


def test_features_and_labels_with_different_dynamic_batch_sizes_fail_the_step():
  x, _ = testlib.data(6)

  def input_fn():
    features = tf.data.Dataset.from_tensor_slices({'x': x}).batch(3)
    labels = tf.data.Dataset.from_tensor_slices(np.zeros(8, np.int32)).batch(4)
    return tf.data.Dataset.zip((features, labels))

  est = testlib.make_estimator(
      replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(2)), num_cpus=2)
  with pytest.raises(tf.errors.InvalidArgumentError, match='same batch size'):
    est.train(input_fn, steps=1)


def test_feature_of_an_unsupported_type():
  with pytest.raises(TypeError, match=r"feature 'x' is a ndarray; towers can only split Tensor"):
    _build(testlib.v1_model_fn, {'x': np.zeros([4, testlib.NUM_FEATURES])}, None,
           mode=ModeKeys.PREDICT)


def _counting(make_model_fn):
  """A model_fn whose behaviour depends on how many towers were built before."""
  calls = itertools.count()
  def model_fn(features, labels, mode):
    return make_model_fn(next(calls), features, labels, mode)
  return model_fn


def _model_with_variables(names):
  def build(call, features, labels, mode):
    logits = features['x'][:, :testlib.NUM_CLASSES]
    for name, shape in names(call):
      logits += tf.reduce_sum(tf.compat.v1.get_variable(name, shape))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  return _counting(build)


@pytest.mark.parametrize('names,message', [
    (lambda call: [('a', [2]), ('b', [3])] if call else [('a', [2])],
     "Tower 1 created more variables than tower 0: its variable #1 \\('b'\\)"),
    (lambda call: [('a', [2])] if call else [('a', [2]), ('b', [3])],
     "Tower 1 created fewer variables than tower 0 \\(1 instead of 2; the first one it did not create is 'b:0'\\)"),
    (lambda call: [('a', [7])] if call else [('a', [2])],
     r"Tower 1 created a different variable than tower 0: its variable #0 is 'a' \(shape \(7,\)"),
])
def test_towers_that_create_different_variables(names, message):
  features = lambda: {'x': tf.zeros([4, testlib.NUM_FEATURES])}
  with pytest.raises(ValueError, match=message):
    _build(_model_with_variables(names), features, lambda: tf.zeros([4], tf.int32))


def test_towers_that_make_fewer_gradient_requests():
  # Tower 0's second request is of a loss made after its first one, so tower 1
  # is rebuilt up to its second request, and returns after one.
  def build(call, features, labels, mode):
    w = tf.compat.v1.get_variable('w', [testlib.NUM_FEATURES, testlib.NUM_CLASSES])
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, tf.matmul(features['x'], w))
    ops = [tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)]
    if call == 0:
      ops.append(tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss * 2.0))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(*ops))
  features = lambda: {'x': tf.zeros([4, testlib.NUM_FEATURES])}
  with pytest.raises(ValueError, match=r'Tower 1 returned from the model_fn after 1 '
                     r'gradient request\(s\) with respect to variables, but tower 0 made more'):
    _build(_counting(build), features, lambda: tf.zeros([4], tf.int32))


def test_towers_that_make_more_gradient_requests():
  # The spec's loss is not what gradients were asked of, so the other towers
  # run their whole model_fn; tower 1 asks once more than tower 0.
  def build(call, features, labels, mode):
    w = tf.compat.v1.get_variable('w', [testlib.NUM_FEATURES, testlib.NUM_CLASSES])
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, tf.matmul(features['x'], w))
    ops = [tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
           for _ in range(1 if call == 0 else 2)]
    return tf.estimator.EstimatorSpec(mode, loss=tf.identity(loss), train_op=tf.group(*ops))
  features = lambda: {'x': tf.zeros([4, testlib.NUM_FEATURES])}
  with pytest.raises(ValueError, match=r'Tower 1 asked for gradients with respect to '
                     r'variables more often than tower 0 \(2 times, tower 0: 1\)'):
    _build(_counting(build), features, lambda: tf.zeros([4], tf.int32))


def test_towers_whose_gradient_requests_differ():
  def build(call, features, labels, mode):
    a = tf.compat.v1.get_variable('a', [testlib.NUM_FEATURES, testlib.NUM_CLASSES])
    b = tf.compat.v1.get_variable('b', [testlib.NUM_CLASSES])
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
        labels, tf.matmul(features['x'], a) + b)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(
        loss, var_list=[a] if call == 0 else [b])
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)
  features = lambda: {'x': tf.zeros([4, testlib.NUM_FEATURES])}
  with pytest.raises(ValueError, match=r"Gradient request #0 of tower 1 is with respect to "
                     r"\['b:0'\] but the same request of tower 0 is with respect to \['a:0'\]"):
    _build(_counting(build), features, lambda: tf.zeros([4], tf.int32))


def test_model_fn_that_returns_no_estimator_spec():
  features = lambda: {'x': tf.zeros([4, testlib.NUM_FEATURES])}
  with pytest.raises(TypeError, match=r'model_fn must return a tf.estimator.EstimatorSpec \(or a TPUEstimatorSpec\), got dict'):
    _build(lambda features, labels, mode: {'loss': 0.0}, features, None)


def _build_train_graph(towered, config):
  with tf.Graph().as_default():
    tf.compat.v1.train.create_global_step()
    x, y = testlib.data(6)
    towered(tf.constant(x), tf.constant(y), ModeKeys.TRAIN, None, config)


@pytest.mark.parametrize('strategy', ['cpu', 'gpu', 'replicated', 'collective'])
@pytest.mark.parametrize('session_config', [None, tf.compat.v1.ConfigProto(
    allow_soft_placement=True)], ids=['no_session_config', 'no_device_count'])
def test_towers_on_cpu_devices_the_session_lacks(strategy, session_config):
  """Without device_count only CPU:0 exists: an error at graph construction (soft
  placement would put every tower on CPU:0, and a collective group never forms)."""
  towered = replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(3),
                               variable_strategy=strategy)
  with pytest.raises(ValueError, match=re.escape(
      'Towers on /device:CPU:0, /device:CPU:1, /device:CPU:2: /device:CPU:1, /device:CPU:2 '
      'do not exist in the session this RunConfig makes, which has CPU:0 and no GPU.') +
      r".*device_count=\{'CPU': 3\}.*make_config\(num_cpu_devices=3, \.\.\.\)"):
    _build_train_graph(towered, tf.estimator.RunConfig(session_config=session_config))
  _build_train_graph(towered, testlib.run_config(3))  # with the devices: built


def test_towers_on_gpus_the_session_lacks(monkeypatch):
  from estimator_towers.placement import devices as devices_lib
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: ['/device:GPU:0'])
  towered = replicate_model_fn(testlib.v1_model_fn, devices=['/gpu:0', '/gpu:1'])
  with pytest.raises(ValueError, match=r'/device:GPU:1 do not exist .* which has CPU:0 and '
                     r'GPU:0\..*name only GPUs the session sees in replicate_model_fn\('
                     r'devices=\[\.\.\.\]\).*plan=make_plan\(num_gpus=N, allow_cpu_fallback'):
    _build_train_graph(towered, testlib.run_config(1))
  _build_train_graph(replicate_model_fn(testlib.v1_model_fn, devices=['/gpu:0', '/cpu:1']),
                     testlib.run_config(2))  # GPU:0 is seen


def _arguments_named(message: str) -> set:
  """The names a message's fixes give values to ('num_gpus=0', 'devices=[...]')."""
  return set(re.findall(r'(\w+)=', message.split('Fix one of:', 1)[1]))


def test_every_fix_of_missing_gpus_is_an_argument_of_the_function_called(monkeypatch):
  """replicate_model_fn(num_gpus=8) without GPUs: its fixes name arguments of
  replicate_model_fn, make_plan and RunConfig / ConfigProto, and they work."""
  from estimator_towers.placement import devices as devices_lib
  from estimator_towers.settings import config as config_lib
  monkeypatch.setattr(devices_lib, 'visible_gpus', lambda: [])
  with pytest.raises(ValueError, match='num_gpus=8 asks for 8 GPUs') as raised:
    _build_train_graph(replicate_model_fn(testlib.v1_model_fn, num_gpus=8), None)
  accepted = (set(inspect.signature(replicate_model_fn).parameters)
              | set(inspect.signature(make_plan).parameters)
              | set(inspect.signature(tf.estimator.RunConfig).parameters)
              | set(tf.compat.v1.ConfigProto.DESCRIPTOR.fields_by_name))
  named = _arguments_named(str(raised.value))
  assert {'num_gpus', 'devices', 'session_config', 'device_count', 'plan'} <= named
  assert named <= accepted, named - accepted
  # The fixes, as the message writes them, build the graph.
  _build_train_graph(replicate_model_fn(testlib.v1_model_fn, num_gpus=0), None)
  _build_train_graph(replicate_model_fn(testlib.v1_model_fn, devices=testlib.cpu_devices(8)),
                     tf.estimator.RunConfig(session_config=tf.compat.v1.ConfigProto(
                         device_count={'CPU': 8})))
  _build_train_graph(replicate_model_fn(testlib.v1_model_fn, plan=make_plan(
      num_gpus=8, allow_cpu_fallback=True)), testlib.run_config(1))
  # make_config's own fixes are its arguments (num_cpu_devices is one).
  with pytest.raises(ValueError, match='num_gpus=8 asks for 8 GPUs') as raised:
    config_lib.make_config(num_gpus=8)
  named = _arguments_named(str(raised.value))
  assert 'num_cpu_devices' in named and named <= set(config_lib.FIELDS), named
