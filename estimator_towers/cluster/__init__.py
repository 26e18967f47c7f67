"""Cluster: TensorFlow's own distributed runtime, as the towers see it.

The TF_CONFIG cluster (`tf_config`: training tasks ranked chief first, the
errors that name TF_CONFIG's fields), the server Estimator starts for a
collective task (`servers`), the all-reduces and broadcasts of one TRAIN
step across workers, keyed in graph order (`cross_worker`), and how a
collective task's session starts and bounds a step's wait (`session`),
and a SLURM job step's TF_CONFIG (`slurm`). No
home-made runtime: collective ops over gRPC, parameter servers.

May import: base.
"""
