"""Heads: computations across examples, made exact on towers, micro-batches and workers.

Where the loss mixes the batch's rows, its head (frontier to loss) is built
on the gathered rows: once on the whole batch (`whole_batch_head`), row-wise
per tower where it is made of rows (`row_wise_head`), in row chunks with
micro-batches (`chunked_head`, `cached_gradients`); a mixing op that gives
one row per example (mixup, attention over the batch) computed once on the
whole batch (`batch_mixing`). Each gives the towers' seeds of the backward
pass.

May import: base, cluster, placement, settings, inputs, towers, sync_points, rows, draws.
"""
