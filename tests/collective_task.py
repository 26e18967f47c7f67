"""One task of a local TF_CONFIG cluster under variable_strategy='collective'.

Usage: python collective_task.py SPEC.json   (TF_CONFIG in the environment)

SPEC: model_dir, data (an .npz with x<r>, y<r>, w<r> per training rank r, and
xe, ye, we for the evaluator), model (a key of MODELS), towers, micro_batches,
batch (per worker), sync_batch_norm, timeout (worker_timeout_secs), max_steps (None: until the
inputs end), dump (a directory: each training task writes its variables there
as rank<r>.npz at the end, its global_step at session start in
rank<r>.npz.start, and rank<r>.npz.stepped once its first step has ended),
step_sleep (seconds each step of this task waits, to let a test kill it
mid-training), eval (the evaluator writes its metrics to dump/eval.json),
features_only (the input_fn yields features only, the labels among them as
'y', as BERT's pre-training input_fn does),
user_session_config (the RunConfig's session_config is a ConfigProto built by
hand, not make_run_config's), save_every and keep (the chief's checkpoints: every so many
steps, so many kept; 0 keeps all), shards (make_plan's fixed shard grid), random_draws and
resume_input (make_plan's; 'keyed' and
True unless given), global_batch (every task reads `global_input_fn`'s global batches of that
size, from the data's xg, yg, wg, shuffled with shuffle_seed), block_at (each training task
stops after that global step, writes dump/blocked<rank> and waits to be killed), tf1 (the task
first switches on that TF1 behaviour, a name of testlib.TF1_BEHAVIOURS: 'v1' is
tf.compat.v1.disable_v2_behavior()), heavy_ops (each training task writes the plain
model_fn's heavy ops and its TRAIN graph's per device to dump/heavy_ops<rank>.json), pretrained
(a checkpoint of `pretrain_model_fn`: `finetune_model_fn` warm-starts from it, the Estimator's
warm_start_from `warm_start_settings`; its Scaffold's init_fn writes dump/init_fn_<task type>),
log_info (absl's verbosity INFO: the library's INFO lines in the task's log),
summary_every (the chief's summaries: every so many steps).
"""

import json
import os
import sys
import time

from absl import logging as absl_logging
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import testlib  # pylint: disable=g-import-not-at-top
import estimator_towers as et  # pylint: disable=g-import-not-at-top
from estimator_towers.reporting.throughput import GLOBAL_BATCH_KEY  # pylint: disable=g-import-not-at-top


def _dense(x):
  hidden = tf.compat.v1.layers.dense(
      x, 4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  return tf.compat.v1.layers.dense(
      hidden, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2),
      bias_initializer=tf.compat.v1.random_normal_initializer(seed=3))


def _spec(mode, loss, logits, labels, optimizer, clip=None):
  if mode == tf.estimator.ModeKeys.EVAL:
    return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
        'accuracy': tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1)),
        'mean_logit': tf.compat.v1.metrics.mean(logits)})
  grads_and_vars = optimizer.compute_gradients(loss)
  if clip is not None:
    grads, variables = zip(*grads_and_vars)
    grads, _ = tf.clip_by_global_norm(grads, clip)
    grads_and_vars = list(zip(grads, variables))
  train_op = optimizer.apply_gradients(grads_and_vars, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def mean_model_fn(features, labels, mode, params):
  """A mean cross-entropy, plain gradient descent."""
  logits = _dense(features['x'])
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return _spec(mode, loss, logits, labels,
               tf.compat.v1.train.GradientDescentOptimizer(params['learning_rate']))


def _two_terms_loss(features, labels):
  """A token-weighted ratio plus a mean, plus an L2 penalty; and the logits."""
  logits = _dense(features['x'])
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  w = features['w']
  ratio = tf.reduce_sum(xent * w) / (tf.reduce_sum(w) + 1e-5)
  second = tf.reduce_mean(tf.square(logits[:, 0] - features['x'][:, 0]))
  kernels = [v for v in tf.compat.v1.trainable_variables() if 'kernel' in v.name]
  loss = ratio + 0.5 * second + 1e-2 * tf.add_n([tf.nn.l2_loss(k) for k in kernels])
  return loss, logits


def two_terms_model_fn(features, labels, mode, params):
  """BERT's loss shape (`_two_terms_loss`); Adam with active clipping."""
  loss, logits = _two_terms_loss(features, labels)
  return _spec(mode, loss, logits, labels,
               tf.compat.v1.train.AdamOptimizer(params['learning_rate']), clip=0.05)


def bert_model_fn(features, labels, mode, params):
  """BERT's optimizer: AdamWeightDecay, global-norm clipping, global_step by hand;
  features only (the labels a feature), as BERT's pre-training is fed."""
  if labels is None:
    labels = features['y']
  loss, logits = _two_terms_loss(features, labels)
  if mode == tf.estimator.ModeKeys.EVAL:
    return _spec(mode, loss, logits, labels, None)
  variables = tf.compat.v1.trainable_variables()
  grads, _ = tf.clip_by_global_norm(tf.gradients(loss, variables), 0.05)
  optimizer = testlib.AdamWeightDecayOptimizer(params['learning_rate'])
  train_op = optimizer.apply_gradients(zip(grads, variables))
  step = tf.compat.v1.train.get_global_step()
  train_op = tf.group(train_op, step.assign(step + 1))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


LOSS_SCALE = 128.0


def bn_model_fn(features, labels, mode, params):
  """Two batch norms (tf.nn.moments on 2-D, fused on 4-D), moving averages in UPDATE_OPS;
  Momentum under a static loss scale (loss * 128, gradients / 128)."""
  training = mode == tf.estimator.ModeKeys.TRAIN
  init = tf.compat.v1.glorot_uniform_initializer
  h = tf.compat.v1.layers.dense(features['x'], 4, kernel_initializer=init(seed=1))
  h = tf.nn.tanh(tf.compat.v1.layers.batch_normalization(h, training=training, fused=False,
                                                           momentum=0.8))
  h4 = tf.compat.v1.layers.batch_normalization(tf.reshape(h, [-1, 1, 1, 4]), training=training,
                                               fused=True, momentum=0.8)
  logits = tf.compat.v1.layers.dense(tf.nn.tanh(tf.reshape(h4, [-1, 4])), testlib.NUM_CLASSES,
                                     kernel_initializer=init(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  if mode == tf.estimator.ModeKeys.EVAL:
    return _spec(mode, loss, logits, labels, None)
  optimizer = tf.compat.v1.train.MomentumOptimizer(params['learning_rate'], 0.9)
  scaled = optimizer.compute_gradients(loss * LOSS_SCALE)
  grads_and_vars = [(g / LOSS_SCALE, v) for g, v in scaled]
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.apply_gradients(grads_and_vars, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _minimize(loss, params):
  optimizer = tf.compat.v1.train.MomentumOptimizer(params['learning_rate'], 0.9)
  return optimizer.minimize(loss, tf.compat.v1.train.get_global_step())


def clip_model_fn(features, labels, mode, params):
  return _clip(features, mode, params, weighted=False)


def clip_weighted_model_fn(features, labels, mode, params):
  return _clip(features, mode, params, weighted=True)


def _clip(features, mode, params, weighted):
  """CLIP's symmetric in-batch softmax with a trained temperature: rows mix (issue 33).

  `weighted`: the two terms weighted by a trained scalar, a variable only the mean over
  the rows reads (the row-wise head's tail).
  """
  init = tf.compat.v1.glorot_uniform_initializer
  x = features['x']
  q = tf.math.l2_normalize(tf.compat.v1.layers.dense(x[:, :3], 4, kernel_initializer=init(1)), -1)
  d = tf.math.l2_normalize(tf.compat.v1.layers.dense(x[:, 2:], 4, kernel_initializer=init(2)), -1)
  log_scale = tf.compat.v1.get_variable('log_scale', [],
                                        initializer=tf.compat.v1.constant_initializer(1.0))
  logits = tf.exp(log_scale) * tf.matmul(q, d, transpose_b=True)
  targets = tf.range(tf.shape(q)[0])
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits
  loss = (tf.reduce_mean(xent(targets, logits)) +
          tf.reduce_mean(xent(targets, tf.transpose(logits)))) / 2
  if weighted:
    w = tf.sigmoid(tf.compat.v1.get_variable(
        'term_weight', [], initializer=tf.compat.v1.constant_initializer(0.5)))
    loss = (w * tf.reduce_mean(xent(targets, logits)) +
            (1 - w) * tf.reduce_mean(xent(targets, tf.transpose(logits))) + 0.1 * w * w)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(loss, params))


def top_k_model_fn(features, labels, mode, params):
  """A mean cross-entropy plus the mean of the batch's 3 largest: rows mix (issue 33)."""
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, _dense(features['x']))
  hardest = tf.math.top_k(xent, tf.minimum(3, tf.shape(xent)[0])).values
  loss = tf.reduce_mean(xent) + tf.reduce_mean(hardest)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(loss, params))


def mixup_model_fn(features, labels, mode, params):
  """Mixup of the inputs and labels with the batch reversed: rows mix at the input."""
  x = features['x']
  onehot = tf.one_hot(labels, testlib.NUM_CLASSES)
  logits = _dense(0.7 * x + 0.3 * tf.reverse(x, [0]))
  targets = 0.7 * onehot + 0.3 * tf.reverse(onehot, [0])
  loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(targets, logits))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(loss, params))


def attention_model_fn(features, labels, mode, params):
  """Attention over the batch's hidden rows between two layers: rows mix mid-network."""
  init = tf.compat.v1.glorot_uniform_initializer
  h = tf.compat.v1.layers.dense(features['x'], 4, kernel_initializer=init(1))
  mixed = h + tf.matmul(tf.nn.softmax(tf.matmul(h, h, transpose_b=True)), h)
  logits = tf.compat.v1.layers.dense(mixed, testlib.NUM_CLASSES, kernel_initializer=init(2))
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(loss, params))


def batch_reductions_model_fn(features, labels, mode, params):
  """A max, a min, the row an arg-max picks and a logsumexp over the batch: rows mix.

  Two gradient requests, summed: the max and the min alone in the first (no other op mixes
  its rows there), the arg-max's row and the logsumexp in the second.
  """
  logits = _dense(features['x'])
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
  first = tf.reduce_mean(xent) + 0.3 * tf.reduce_max(xent) + 0.2 * tf.reduce_min(xent)
  second = 0.2 * tf.gather(xent, tf.argmax(logits[:, 0])) + 0.1 * tf.reduce_logsumexp(xent)
  optimizer = tf.compat.v1.train.MomentumOptimizer(params['learning_rate'], 0.9)
  grads = [(a + b, v) for (a, v), (b, _) in zip(optimizer.compute_gradients(first),
                                                optimizer.compute_gradients(second))]
  train_op = optimizer.apply_gradients(grads, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=first + second, train_op=train_op)


def random_draws_model_fn(features, labels, mode, params):
  """Random draws of every common kind: Gaussian, truncated normal and stateless noise of
  tf.shape(x), an integer scale per example, Keras' GaussianNoise, dropout (v1 keep_prob and
  v2 rate), a categorical and a gamma draw per example, and one scalar drawn per step."""
  x = features['x']
  rows = tf.shape(x)[:1]
  noisy = (x + 0.5 * tf.random.normal(tf.shape(x)) + 0.1 * tf.random.truncated_normal(tf.shape(x))
           + 0.1 * tf.random.stateless_uniform(tf.shape(x), seed=[3, 4]))
  noisy *= tf.cast(tf.random.uniform(rows, 1, 3, dtype=tf.int32), tf.float32)[:, None]
  hidden = tf.compat.v1.layers.dense(
      noisy, 4, activation=tf.nn.tanh,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
  hidden = tf.keras.layers.GaussianNoise(0.1)(hidden, training=True)
  hidden = tf.compat.v1.nn.dropout(hidden, keep_prob=0.8)
  hidden = tf.nn.dropout(hidden, rate=0.5) * tf.random.uniform([], 0.5, 1.5)
  picked = tf.random.categorical(tf.zeros(tf.concat([rows, [2]], 0)), 1)    # [n, 1]
  hidden *= 1.0 + 0.5 * tf.cast(picked, tf.float32)
  logits = tf.compat.v1.layers.dense(
      hidden, testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  weights = tf.random.gamma(rows, 2.0)
  loss = tf.reduce_mean(weights * tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(loss, params))


def tf1_mix_model_fn(features, labels, mode, params):
  """A dense layer, an einsum self-attention over each example's 3 tokens (BERT's einsums,
  per example: no rows mix) and a batch norm (tf.compat.v1.layers, its moving averages in
  UPDATE_OPS; exact across workers with sync_batch_norm), Momentum: the models of
  tests/test_tf1_behaviour.py in one model_fn, trained under disable_v2_behavior()."""
  init = tf.compat.v1.glorot_uniform_initializer
  training = mode == tf.estimator.ModeKeys.TRAIN
  h = tf.compat.v1.layers.dense(features['x'], 12, tf.nn.tanh, kernel_initializer=init(seed=1))
  tokens = tf.reshape(h, [-1, 3, 4])
  query, key = (tf.compat.v1.get_variable(n, [4, 4], initializer=init(seed=s))
                for n, s in (('query', 4), ('key', 5)))
  scores = tf.einsum('bfe,bte->bft', tf.einsum('bfd,de->bfe', tokens, query),
                     tf.einsum('btd,de->bte', tokens, key)) / 2.0
  context = tf.einsum('bft,btd->bfd', tf.nn.softmax(scores), tokens)
  normed = tf.compat.v1.layers.batch_normalization(tf.reshape(context, [-1, 12]),
                                                   training=training, fused=False, momentum=0.8)
  logits = tf.compat.v1.layers.dense(tf.nn.tanh(normed), testlib.NUM_CLASSES,
                                     kernel_initializer=init(seed=2))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  optimizer = tf.compat.v1.train.MomentumOptimizer(params['learning_rate'], 0.9)
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _layer(x, units, name, seed, activation=None):
  return tf.compat.v1.layers.dense(
      x, units, activation, name=name,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))


def pretrain_model_fn(features, labels, mode, params):
  """The pre-training model whose checkpoint `finetune_model_fn` starts from."""
  hidden = _layer(_layer(features['x'], 6, 'encoder', 1, tf.nn.tanh), 6, 'middle', 2, tf.nn.tanh)
  logits = _layer(hidden, testlib.NUM_CLASSES, 'pre_head', 3)
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.compat.v1.train.
                                    GradientDescentOptimizer(0.5).minimize(
                                        loss, tf.compat.v1.train.get_global_step()))


def finetune_model_fn(features, labels, mode, params):
  """Fine-tuning from params['pretrained'] (a pretrain_model_fn checkpoint) three ways at
  once: `encoder/` by `init_from_checkpoint` in the model_fn (BERT's pattern), `middle/` by
  Estimator's `warm_start_from` (the task's WarmStartSettings), `pre_head/` by the Scaffold's
  `init_fn` (which writes params['init_fn_marker'] where it runs); `new_head/` new."""
  checkpoint = params['pretrained']
  encoded = _layer(features['x'], 6, 'encoder', 11, tf.nn.tanh)
  tf.compat.v1.train.init_from_checkpoint(checkpoint, {'encoder/': 'encoder/'})
  hidden = _layer(encoded, 6, 'middle', 12, tf.nn.tanh)
  logits = (_layer(hidden, testlib.NUM_CLASSES, 'pre_head', 13) +
            _layer(encoded, testlib.NUM_CLASSES, 'new_head', 14))
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  train_op = tf.compat.v1.train.MomentumOptimizer(params['learning_rate'], 0.9).minimize(
      loss, tf.compat.v1.train.get_global_step())
  saver = tf.compat.v1.train.Saver({v.op.name: v for v in tf.compat.v1.global_variables()
                                    if v.op.name in ('pre_head/kernel', 'pre_head/bias')})

  def init_fn(scaffold, session):
    del scaffold
    saver.restore(session, checkpoint)
    with open(params['init_fn_marker'], 'a') as f:
      f.write('ran\n')
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                    scaffold=tf.compat.v1.train.Scaffold(init_fn=init_fn))


def warm_start_settings(checkpoint):
  """`finetune_model_fn`'s WarmStartSettings: `middle/` from `checkpoint`."""
  return tf.estimator.WarmStartSettings(checkpoint, vars_to_warm_start='middle/.*')


def recurrent_dropout_model_fn(features, labels, mode, params):
  """An LSTM cell with input, state and output dropout (`DropoutWrapper`) run by
  `dynamic_rnn` over the features read as a sequence: its draws are inside the loop, keyed
  by the step, the example and the iteration."""
  x = tf.reshape(features['x'], [-1, testlib.NUM_FEATURES, 1])
  cell = tf.compat.v1.nn.rnn_cell.DropoutWrapper(
      tf.compat.v1.nn.rnn_cell.LSTMCell(
          3, initializer=tf.compat.v1.glorot_uniform_initializer(seed=1)),
      input_keep_prob=0.7, output_keep_prob=0.8, state_keep_prob=0.6)
  outputs, _ = tf.compat.v1.nn.dynamic_rnn(cell, x, dtype=tf.float32)
  logits = tf.compat.v1.layers.dense(
      outputs[:, -1], testlib.NUM_CLASSES,
      kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=_minimize(loss, params))


def _grid_spec(mode, loss, logits, labels):
  if mode == tf.estimator.ModeKeys.EVAL:
    return _spec(mode, loss, logits, labels, None)
  optimizer = tf.compat.v1.train.AdamOptimizer(0.05)
  with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
    train_op = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def _token_weighted(features, labels, h):
  logits = tf.compat.v1.layers.dense(h, testlib.NUM_CLASSES,
                                     kernel_initializer=tf.compat.v1.glorot_uniform_initializer(2))
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
  return tf.reduce_sum(xent * features['w']) / (tf.reduce_sum(features['w']) + 1e-5), logits


def _in_batch_softmax_and_weighted(features, labels, mode, h):
  """The grid models' loss on rows `h`: an in-batch softmax of two projections (the
  whole-batch head) plus a token-weighted loss; Adam."""
  init = tf.compat.v1.glorot_uniform_initializer
  q = tf.math.l2_normalize(tf.compat.v1.layers.dense(h, 4, kernel_initializer=init(seed=3)), -1)
  d = tf.math.l2_normalize(tf.compat.v1.layers.dense(tf.nn.tanh(h), 4,
                                                     kernel_initializer=init(seed=4)), -1)
  in_batch = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.range(tf.shape(q)[0]), logits=tf.matmul(q, d, transpose_b=True) / 0.1))
  weighted, logits = _token_weighted(features, labels, h)
  return _grid_spec(mode, weighted + in_batch, logits, labels)


def grid_bn_model_fn(features, labels, mode, params):
  """A fixed shard grid's test model: two batch norms (the tf.nn.moments path on rank 2,
  the fused kernel's on rank 4) and dropout (keyed draws) under a token-weighted loss;
  Adam."""
  del params
  train = mode == tf.estimator.ModeKeys.TRAIN
  h = tf.compat.v1.layers.dense(features['x'], 8, use_bias=False,
                                kernel_initializer=tf.compat.v1.glorot_uniform_initializer(1))
  h = tf.nn.relu(tf.compat.v1.layers.batch_normalization(h, training=train))
  h = tf.compat.v1.layers.batch_normalization(tf.reshape(h, [-1, 2, 2, 2]), training=train)
  loss, logits = _token_weighted(features, labels, tf.compat.v1.layers.dropout(
      tf.reshape(h, [-1, 8]), 0.3, training=train))
  return _grid_spec(mode, loss, logits, labels)


def grid_softmax_model_fn(features, labels, mode, params):
  """A fixed shard grid's test model: an in-batch softmax of two projections (the whole-batch
  head) of dropped-out features (keyed draws, which the head's first pass draws again) plus a
  token-weighted loss; Adam."""
  del params
  x = tf.compat.v1.layers.dropout(features['x'], 0.2,
                                  training=mode == tf.estimator.ModeKeys.TRAIN)
  return _in_batch_softmax_and_weighted(features, labels, mode, x)


def grid_bn_softmax_model_fn(features, labels, mode, params):
  """A fixed shard grid's test model: a synchronised batch norm, then dropout, feeding an
  in-batch softmax (the whole-batch head reads rows computed through the batch norm's
  exchange) plus a token-weighted loss; Adam."""
  del params
  train = mode == tf.estimator.ModeKeys.TRAIN
  init = tf.compat.v1.glorot_uniform_initializer
  h = tf.compat.v1.layers.dense(features['x'], 8, use_bias=False, kernel_initializer=init(5))
  h = tf.compat.v1.layers.dropout(
      tf.nn.relu(tf.compat.v1.layers.batch_normalization(h, training=train)), 0.2,
      training=train)
  return _in_batch_softmax_and_weighted(features, labels, mode, h)


def summaries_model_fn(features, labels, mode, params):
  """mean_model_fn with scalar summaries of batch values (the loss, an accuracy, the max
  and min logit, a count of correct predictions, the number of examples, a token-weighted
  mean) and a histogram of the logits (rows: this task's across workers)."""
  logits = _dense(features['x'])
  loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
  correct = tf.cast(tf.equal(tf.argmax(logits, 1, output_type=labels.dtype), labels),
                    tf.float32)
  tf.compat.v1.summary.scalar('my_loss', loss)
  tf.compat.v1.summary.scalar('accuracy', tf.reduce_mean(correct))
  tf.compat.v1.summary.scalar('max_logit', tf.reduce_max(logits))
  tf.compat.v1.summary.scalar('min_logit', tf.reduce_min(logits))
  tf.compat.v1.summary.scalar('correct', tf.reduce_sum(correct))
  tf.compat.v1.summary.scalar('examples', tf.cast(tf.size(labels), tf.float32))
  tf.compat.v1.summary.scalar('weighted', tf.reduce_sum(correct * features['w']) /
                              (tf.reduce_sum(features['w']) + 1e-5))
  tf.compat.v1.summary.histogram('logits', logits)
  return _spec(mode, loss, logits, labels,
               tf.compat.v1.train.GradientDescentOptimizer(params['learning_rate']))


MODELS = {'mean': mean_model_fn, 'two_terms': two_terms_model_fn, 'bert': bert_model_fn,
          'bn': bn_model_fn, 'clip': clip_model_fn, 'top_k': top_k_model_fn,
          'clip_weighted': clip_weighted_model_fn, 'mixup': mixup_model_fn,
          'attention': attention_model_fn, 'batch_reductions': batch_reductions_model_fn,
          'random_draws': random_draws_model_fn,
          'recurrent_dropout': recurrent_dropout_model_fn, 'tf1_mix': tf1_mix_model_fn,
          'finetune': finetune_model_fn, 'grid_bn': grid_bn_model_fn,
          'summaries': summaries_model_fn,
          'grid_softmax': grid_softmax_model_fn, 'grid_bn_softmax': grid_bn_softmax_model_fn}


def input_fn(data, suffix, batch, features_only=False):
  def fn():
    features = {'x': data['x' + suffix], 'w': data['w' + suffix]}
    if features_only:
      features['y'] = data['y' + suffix]
      return tf.data.Dataset.from_tensor_slices(features).batch(batch)
    return tf.data.Dataset.from_tensor_slices((features, data['y' + suffix])).batch(batch)
  return fn


def global_input_fn(data, batch, seed):
  """Every worker's input: global batches of `batch` examples, a seeded shuffle, repeated."""
  def fn():
    examples = tf.data.Dataset.from_tensor_slices(
        ({'x': data['xg'], 'w': data['wg']}, data['yg']))
    return et.global_batches(examples.shuffle(len(data['yg']), seed=seed).repeat(), batch)
  return fn


def shard_input_fn(data, batch, seed):
  """Each worker's own part of the data: a seeded shuffle, repeated, `shard`ed by the
  worker's index, in batches of `batch` (the cluster's global batch: rank 0's, then 1's)."""
  def fn():
    index, count = et.worker_index_and_count()
    examples = tf.data.Dataset.from_tensor_slices(
        ({'x': data['xg'], 'w': data['wg']}, data['yg']))
    return examples.shuffle(len(data['yg']), seed=seed).repeat().shard(count, index).batch(batch)
  return fn


class BlockAfter(tf.compat.v1.train.SessionRunHook):
  """After global step `step` has run, writes `flag` and waits (up to 300 s) to be killed."""

  def __init__(self, step, flag):
    self._step, self._flag = step, flag

  def begin(self):
    self._global_step = tf.compat.v1.train.get_global_step()

  def after_run(self, run_context, run_values):
    if run_context.session.run(self._global_step) < self._step:
      return
    with open(self._flag, 'w') as f:
      f.write(str(self._step))
    time.sleep(300)
    sys.exit(3)


class DumpVariables(tf.compat.v1.train.SessionRunHook):
  """Writes every global variable's value to `path` at the end of training.

  Also the sum over the steps of the global batch size the towered model_fn
  records for ThroughputHook, to `path`.examples.
  """

  def __init__(self, path, sleep=0.0):
    self._path, self._sleep = path, sleep
    self._examples = 0

  def begin(self):
    self._variables = tf.compat.v1.global_variables()
    self._step = tf.compat.v1.train.get_global_step()
    (self._batch,) = tf.compat.v1.get_collection(GLOBAL_BATCH_KEY)

  def after_create_session(self, session, coord):
    with open(self._path + '.start', 'w') as f:
      f.write(str(int(session.run(self._step))))

  def before_run(self, run_context):
    if self._sleep:
      time.sleep(self._sleep)
    return tf.compat.v1.train.SessionRunArgs(self._batch)

  def after_run(self, run_context, run_values):
    if not self._examples:
      open(self._path + '.stepped', 'w').close()
    self._examples += int(run_values.results)

  def end(self, session):
    with open(self._path + '.examples', 'w') as f:
      f.write(str(self._examples))
    values = session.run(self._variables)
    np.savez(self._path, **{v.op.name: x for v, x in zip(self._variables, values)})


class MetricsExporter(tf.estimator.Exporter):
  """Writes the evaluator's final metrics to `path` as JSON."""

  def __init__(self, path):
    self._path = path

  @property
  def name(self):
    return 'metrics'

  def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
    if is_the_final_export:
      with open(self._path, 'w') as f:
        json.dump({k: float(v) for k, v in eval_result.items()}, f)


def heavy_ops_per_device(path, plain_fn, features, labels, params):
  """Writes to `path` (JSON) the plain model_fn's heavy ops (its TRAIN graph, built here) and
  a hook that adds the towered TRAIN graph's heavy ops per device as the task builds it."""
  import heavy_ops  # pylint: disable=g-import-not-at-top
  plain = heavy_ops.total(heavy_ops.train_graph(
      lambda f, l, mode, p, config=None: plain_fn(f, l, mode, p), features, labels, params))

  class HeavyOps(tf.compat.v1.train.SessionRunHook):

    def begin(self):
      with open(path, 'w') as f:
        json.dump({'plain': plain, 'per_device': heavy_ops.per_device(
            tf.compat.v1.get_default_graph()),
                   'resource_variables': tf.compat.v1.resource_variables_enabled(),
                   'control_flow_v2': tf.compat.v1.control_flow_v2_enabled()}, f)
  return HeavyOps()


def main(spec_path):
  with open(spec_path) as f:
    spec = json.load(f)
  if spec.get('tf1'):  # before any graph: TF1 behaviour is process-global
    testlib.TF1_BEHAVIOURS[spec['tf1']]()
  if spec.get('log_info'):
    absl_logging.set_verbosity(absl_logging.INFO)
  data = np.load(spec['data'])
  tf_config = json.loads(os.environ['TF_CONFIG'])
  task = tf_config['task']
  rank, _ = et.worker_index_and_count()
  params = {'learning_rate': spec.get('learning_rate', 0.1)}
  if spec.get('pretrained'):
    params.update(pretrained=spec['pretrained'], init_fn_marker=os.path.join(
        spec['dump'], f'init_fn_{task["type"]}'))
  config = et.make_config(num_cpu_devices=spec['towers'], variable_strategy='collective',
                          micro_batches=spec.get('micro_batches', 1),
                          inter_op_threads=2, intra_op_threads=1)
  plan = et.make_plan(devices=[f'/cpu:{i}' for i in range(spec['towers'])],
                      variable_strategy='collective',
                      micro_batches=spec.get('micro_batches', 1),
                      sync_batch_norm=spec.get('sync_batch_norm', False),
                      worker_timeout_secs=spec.get('timeout', 60),
                      random_draws=spec.get('random_draws', 'keyed'),
                      resume_input=spec.get('resume_input', True),
                      shards=spec.get('shards'))
  model_fn = et.replicate_model_fn(MODELS[spec['model']], plan=plan)
  settings = dict(model_dir=spec['model_dir'], save_checkpoints_steps=spec.get('save_every', 1000),
                  keep_checkpoint_max=spec.get('keep', 5),
                  save_summary_steps=spec.get('summary_every', 1000),
                  log_step_count_steps=1000,
                  # no graph.pbtxt, no .meta beside each checkpoint: no test reads them
                  checkpoint_save_graph_def=False)
  if spec.get('user_session_config'):  # the usual hand-made ConfigProto: no device filters
    run_config = tf.estimator.RunConfig(session_config=testlib.quiet_threads(
        tf.compat.v1.ConfigProto(device_count={'CPU': spec['towers']},
                                 inter_op_parallelism_threads=2,
                                 intra_op_parallelism_threads=1)), **settings)
  else:
    run_config = et.make_run_config(config, **settings)
    testlib.quiet_threads(run_config.session_config)
  estimator = tf.estimator.Estimator(
      model_fn, config=run_config, params=params,
      warm_start_from=warm_start_settings(spec['pretrained']) if spec.get('pretrained') else None)
  hooks = []
  if task['type'] != 'evaluator' and spec.get('heavy_ops'):
    hooks.append(heavy_ops_per_device(
        os.path.join(spec['dump'], f'heavy_ops{rank}.json'), MODELS[spec['model']],
        {'x': data['x0'][:spec['batch']], 'w': data['w0'][:spec['batch']]},
        data['y0'][:spec['batch']], params))
  if task['type'] != 'evaluator':
    hooks.append(DumpVariables(os.path.join(spec['dump'], f'rank{rank}.npz'),
                               spec.get('step_sleep', {}).get(str(rank), 0.0)))
  if task['type'] != 'evaluator' and spec.get('block_at'):
    hooks.append(BlockAfter(spec['block_at'], os.path.join(spec['dump'], f'blocked{rank}')))
  suffix = str(rank) if task['type'] != 'evaluator' else 'e'
  if spec.get('global_batch'):
    train_input_fn = global_input_fn(data, spec['global_batch'], spec['shuffle_seed'])
  elif spec.get('shard_batch'):
    train_input_fn = shard_input_fn(data, spec['shard_batch'], spec['shuffle_seed'])
  else:
    train_input_fn = input_fn(data, suffix, spec['batch'], spec.get('features_only', False))
  train_spec = tf.estimator.TrainSpec(train_input_fn, max_steps=spec.get('max_steps'),
                                      hooks=hooks)
  # throttle_secs: the evaluator looks for a new checkpoint once a second (0 polls without
  # pause, a core busy for the whole of the chief's run).
  eval_spec = tf.estimator.EvalSpec(
      input_fn(data, 'e', spec['batch']), steps=None, start_delay_secs=0, throttle_secs=1,
      exporters=[MetricsExporter(os.path.join(spec['dump'], 'eval.json'))])
  tf.estimator.train_and_evaluate(estimator, train_spec, eval_spec)


if __name__ == '__main__':
  main(sys.argv[1])
