"""Base: what every stage uses, and TensorFlow's private API fenced in one module.

`interception` holds the private TensorFlow hooks the library needs (the
gradient functions it answers, control-flow and device contexts, op
imports): a TensorFlow upgrade has this one module to check. `logs` says a
thing once per graph or process, `spelling` names a setting as the user
wrote it (`num_gpus=4` or `--num_gpus=4`), `shapes` reads a static size as an
int or None under TF2 and TF1 shapes, `updates` tells which ops change a
variable, `shared_patch` replaces attributes while any thread needs them,
`tower_parts` records whose part each input of a joined table is (a walk over
one tower's graph skips the others'). Nothing here knows about losses.

May import: nothing.
"""
