"""google-research BERT's pre-training model_fn (PyPI bert-tensorflow 1.0.4), tiny, for the tests.

`bert/modeling.py` imports `tensorflow.contrib.layers` (for `layer_norm` only),
which TensorFlow 2 does not have: `_install_contrib` serves tf-slim's layers
under that name before BERT is imported (once: `bert.run_pretraining` defines
absl flags when imported). `model_fn()` is `run_pretraining.model_fn_builder`'s
model_fn on a tiny `BertConfig`, without dropout unless asked (`dropout=True`:
BERT's default, 0.1 on the hidden layers and on the attention probabilities),
its TPUEstimatorSpec turned into an EstimatorSpec, its initializers seeded by
the variable names; it trains with
BERT's own optimizer (AdamWeightDecay, gradients
clipped by their global norm, the global step advanced by hand). `features()`
are what BERT's input_fn gives (labels None).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import zlib

from absl import flags as absl_flags
import numpy as np
import tensorflow as tf

SEQ, MAX_PREDICTIONS, VOCAB = 6, 2, 30
CONFIG = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=16, max_position_embeddings=16, type_vocab_size=2,
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              initializer_range=0.02)
# A learning rate decayed over so many steps that it is the initial one in float32 at
# every step: BERT's `global_step + 1` assignment is not ordered after the update's read
# of the step, on one device too.
NUM_TRAIN_STEPS = 10**9


def _install_contrib():
  if 'tensorflow.contrib' not in sys.modules:
    import tf_slim  # pylint: disable=g-import-not-at-top
    contrib = types.ModuleType('tensorflow.contrib')
    contrib.layers = tf_slim.layers
    sys.modules['tensorflow.contrib'] = contrib


def modules():
  """(bert.modeling, bert.run_pretraining), imported once."""
  _install_contrib()
  from bert import modeling  # pylint: disable=g-import-not-at-top
  with _flags_of_its_own():
    from bert import run_pretraining  # pylint: disable=g-import-not-at-top
  return modeling, run_pretraining


@contextlib.contextmanager
def _flags_of_its_own():
  """`bert.run_pretraining` defines absl flags at import (`--eval_batch_size`, ...): on
  FlagValues of its own, so that a test process that defined them (the CIFAR-10 example's
  tests) can import it too."""
  module = tf.compat.v1.flags
  names = [n for n in dir(module) if n.startswith('DEFINE')]
  saved = {n: getattr(module, n) for n in names}
  own = absl_flags.FlagValues()
  for n in names:
    setattr(module, n, functools.partial(saved[n], flag_values=own))
  try:
    yield
  finally:
    for n, f in saved.items():
      setattr(module, n, f)


def model_fn(learning_rate: float = 1e-2, dropout: bool = False):
  """BERT's pre-training model_fn (an Estimator model_fn giving an EstimatorSpec);
  `dropout`: BertConfig's default dropout probabilities, else none."""
  modeling, run_pretraining = modules()
  config = modeling.BertConfig(**(CONFIG if not dropout else {
      k: v for k, v in CONFIG.items() if not k.endswith('dropout_prob')}))
  bert_fn = run_pretraining.model_fn_builder(
      bert_config=config, init_checkpoint=None, learning_rate=learning_rate,
      num_train_steps=NUM_TRAIN_STEPS, num_warmup_steps=0, use_tpu=False,
      use_one_hot_embeddings=False)

  def fn(features, labels, mode, params, config=None):
    del config
    with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), custom_getter=_seeded):
      spec = bert_fn(features, labels, mode, params)
    return spec.as_estimator_spec()
  return fn


def _seeded(getter, name, *args, **kwargs):
  """BERT's truncated-normal initializers (unseeded) seeded by the variable's name: the
  same initial values on one device and on towers, whatever ops come before."""
  initializer = kwargs.get('initializer')
  stddev = getattr(initializer, 'stddev', None)
  if stddev is not None:
    kwargs['initializer'] = tf.compat.v1.truncated_normal_initializer(
        stddev=stddev, seed=zlib.crc32(name.encode()) % (2**31))
  return getter(name, *args, **kwargs)


def features(batch: int = 12, seed: int = 0) -> dict:
  """A batch as BERT's input_fn gives it (numpy), masks and padded predictions included."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(3, SEQ + 1, size=batch)
  mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int32)
  ids = rng.randint(1, VOCAB, size=(batch, SEQ)).astype(np.int32) * mask
  segments = ((np.arange(SEQ)[None, :] >= lengths[:, None] // 2) * mask).astype(np.int32)
  positions = np.stack([rng.choice(n, MAX_PREDICTIONS, replace=False) for n in lengths])
  weights = np.ones([batch, MAX_PREDICTIONS], np.float32)
  weights[::3, -1] = 0.0   # a padded prediction
  positions = np.where(weights > 0, positions, 0).astype(np.int32)
  return {
      'input_ids': ids, 'input_mask': mask, 'segment_ids': segments,
      'masked_lm_positions': positions,
      'masked_lm_ids': rng.randint(1, VOCAB, size=(batch, MAX_PREDICTIONS)).astype(np.int32),
      'masked_lm_weights': weights,
      'next_sentence_labels': rng.randint(0, 2, size=(batch, 1)).astype(np.int32),
  }


def input_fn(batch: int = 12, static_batch: bool = False, examples: int = 36):
  """Batches of `features` (labels None), repeated; `static_batch`: drop_remainder."""
  data = features(examples)

  def fn():
    ds = tf.data.Dataset.from_tensor_slices(data).repeat()
    return ds.batch(batch, drop_remainder=static_batch)
  return fn
