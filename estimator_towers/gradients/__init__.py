"""Gradients: a gradient request answered with the whole batch's gradient.

A request read (`request`), the other towers made at it and the request
answered (`whole_batch`, `other_towers`), the backward passes (one over
every tower's seeds, per copied tower or per micro-batch:
`backward_passes`) and the parts summed or all-reduced per variable
(`gradient_sync`). What the model_fn does with the answer (clipping, its
optimizer's update) runs once.

May import: base, cluster, placement, settings, inputs, towers, sync_points, rows, draws, heads, loss.
"""
