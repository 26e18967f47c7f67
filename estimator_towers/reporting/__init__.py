"""Reporting: what a run tells the user.

Examples/sec and an ETA (`throughput`), the bytes that cross devices in a
step (`traffic`), the per-tower summaries and `global_mean`
(`tower_summaries`), the heavy ops per device of a TRAIN graph and the
warning for work run once on one device (`work_share`).

May import: base, cluster, placement, settings, inputs, towers, sync_points, rows, draws, heads, loss, gradients.
"""
