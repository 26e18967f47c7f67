"""BERT's pre-training model_fn, small, for the time-to-first-step benches.

google-research BERT's own `run_pretraining.model_fn_builder` (PyPI
bert-tensorflow, through tests/bert_model.py's import shim), unchanged: the
masked-LM and next-sentence heads, AdamWeightDecay with gradients clipped by
their global norm. The config is BERT-Tiny's shape (2 layers, hidden 128, 2
heads, intermediate 512, BERT's 30,522-word vocabulary) at sequence length
128 with 20 predictions per sequence; dropout 0.1 as BERT's default. The
input: one fixed synthetic batch of `batch_size` sequences (ids, masks,
segments, masked positions, ids and weights, next-sentence labels) repeated,
its batch dimension unknown to shape inference as in towers_bench's input.

`model_fn()` and `input_fn(batch_size)` are what `towers_bench.make_estimator`
uses for --models=bert (or sync_bn_bench.py's --first_step_model=bert).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'tests'))
import bert_model  # pylint: disable=g-import-not-at-top,wrong-import-position

SEQ, PREDICTIONS, VOCAB = 128, 20, 30522
CONFIG = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=512, max_position_embeddings=512, type_vocab_size=2,
              hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
              initializer_range=0.02)


def model_fn():
  """BERT's pre-training model_fn on `CONFIG` (an Estimator model_fn)."""
  modeling, run_pretraining = bert_model.modules()
  bert_fn = run_pretraining.model_fn_builder(
      bert_config=modeling.BertConfig(**CONFIG), init_checkpoint=None, learning_rate=1e-4,
      num_train_steps=10000, num_warmup_steps=100, use_tpu=False,
      use_one_hot_embeddings=False)

  def fn(features, labels, mode, params):
    return bert_fn(features, labels, mode, params).as_estimator_spec()
  return fn


def _batch(batch_size: int) -> dict:
  rng = np.random.RandomState(0)
  lengths = rng.randint(SEQ // 2, SEQ + 1, size=batch_size)
  mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int32)
  positions = np.stack([rng.choice(n, PREDICTIONS, replace=False) for n in lengths])
  return {
      'input_ids': rng.randint(1, VOCAB, size=(batch_size, SEQ)).astype(np.int32) * mask,
      'input_mask': mask,
      'segment_ids': ((np.arange(SEQ)[None, :] >= lengths[:, None] // 2) * mask).astype(
          np.int32),
      'masked_lm_positions': positions.astype(np.int32),
      'masked_lm_ids': rng.randint(1, VOCAB, size=(batch_size, PREDICTIONS)).astype(np.int32),
      'masked_lm_weights': np.ones([batch_size, PREDICTIONS], np.float32),
      'next_sentence_labels': rng.randint(0, 2, size=(batch_size, 1)).astype(np.int32),
  }


def input_fn(batch_size: int):
  """One fixed batch, repeated, its first dimension unknown (labels None)."""
  data = _batch(batch_size)

  def fn():
    constants = {k: tf.constant(v) for k, v in data.items()}

    def element(i):
      n = tf.cast(batch_size + 0 * i, tf.int32)  # batch_size, unknown to shape inference
      return {k: v[:n] for k, v in constants.items()}
    return tf.data.Dataset.range(1).repeat().map(element)
  return fn
