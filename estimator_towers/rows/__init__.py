"""Rows: how each tensor of a tower relates to the shard's examples.

The row reader: for each tensor of tower 0's graph, whether it holds one row
per example, stacked or flat rows, a statistic, the batch size, or values
that mix the batch's rows; which ops mix rows and the frontier before them;
the warning or error for a mixing op the library does not compute on the
whole batch. Other stages use `row_dependence` (the entry points, and the
names they need re-exported); the other modules are split by what they
read: `kinds`, `op_tables`, `static_values`, the op families (`sizes`,
`elementwise`, `statistics`, `einsum`, `flat`, `stacked`), the loops (`loops`: While
loops and TensorLists; `frames`: control flow v1's loops and TensorArrays), `reader` (the
walk, the mixing ops and the frontier) and `messages`.

May import: base, cluster, placement, settings, inputs, towers, sync_points.
"""
