"""Towers: the user's model_fn run on each shard, with one set of variables.

Which tower is being built (`tower_context`), one set of variables whatever
API creates them (`sharing`), building a tower on its device with its own
collections (`builder`), the other towers as copies of tower 0's ops where
that is what building would give (`tower_copies`, `op_templates`), tower
k's counterpart of a tower-0 tensor (`counterparts`), the towers'
EstimatorSpecs merged (`specs`), EVAL and PREDICT (`eval_predict`), a
model_fn that cannot be split run on the whole batch (`whole_batch`) with
its reads before its writes (`ordering`).

May import: base, cluster, placement, settings, inputs.
"""
