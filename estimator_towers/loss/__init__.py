"""Loss: the whole batch's loss from the shards' statistics, and the backward passes' seeds.

The loss read as a function of the batch's additive statistics (sums, means,
counts, `loss_denominator` declarations) and shard-independent terms
(`loss_algebra`); the shards' statistics and their totals (`statistics`);
what each shard's backward pass starts from (`request_seeds` picks the rule;
`seeds`, and `micro_batch_seeds` with micro-batches); the loss Estimator
reports (`reported`).

May import: base, cluster, placement, settings, inputs, towers, sync_points, rows, draws, heads.
"""
