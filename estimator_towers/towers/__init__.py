"""Towers: the user's model_fn run on each shard, with one set of variables.

Which tower is being built (`tower_context`), one set of variables whatever
API creates them (`sharing`), one tower built on its shard and device with
its own collections, stopped at a gradient request (`builder`), the other
towers as copies of tower 0's ops where that is what building would give
(`tower_copies`, `op_templates`), tower k's counterpart of a tower-0 tensor
(`counterparts`), the towers' EstimatorSpecs merged (`specs`), and a
model_fn that cannot be split run once on the whole batch (`unsplit`), its
reads before its writes (`ordering`).

May import: base, cluster, placement, settings, inputs.
"""
