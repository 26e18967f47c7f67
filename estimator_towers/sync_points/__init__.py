"""Sync points: values that need the whole batch, joined once in the graph.

A value of every tower joined on the first tower's device (`join`), and
synchronised batch norm built on it (`batch_norm`): the towers' moments
combined into the global batch's (`moments`), and a gradient that exchanges
the two per-channel sums (`batch_norm_kernels`).

May import: base, cluster, placement, settings, inputs, towers.
"""
