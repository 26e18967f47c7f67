"""Draws: random ops keyed by the example, not by the device that computes it.

Every random op a model_fn builds draws each example's values by the
example's position in the global batch and the global step (`keyed`, the
rule), through Philox streams read at a row's offset (`streams`), so that one
device, N devices, micro-batches and workers draw the same values, and a
resumed run draws what an uninterrupted one does.

May import: base, cluster, placement, settings, inputs, towers, sync_points, rows.
"""
