"""Inputs: the global batch split into shards, and staged onto devices.

The split rule (`sharding`: shard k gets B // N examples, plus one if
k < B % N), a shard borrowing a row when empty at run time, the join back;
a shard as a (device, micro-batch) pair and the gates that run a device's
micro-batches one after another (`micro_batches`); the shards of one step
(`shards`); prefetching shards onto their devices (`staging`); a tower
whose shard is empty at run time running nothing in EVAL and PREDICT
(`empty_shards`).

May import: base, cluster, placement, settings.
"""
