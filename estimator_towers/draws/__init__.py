"""Draws: random draws keyed by the example.

Random draws keyed by the example: a stateless random op of the model gives
every example the draw a single device gives it, whichever device,
micro-batch or worker computes that example. A draw of shape [B, ...] is the
output of TensorFlow's stateless V2 op (key, counter, Philox) asked for the
whole global batch; `streams` draws rows [r, r + n) of it alone, on the
shard that holds those examples, by advancing the Philox counter to the
shard's first row (no whole-batch draw per shard).
"""
