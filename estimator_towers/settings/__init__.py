"""Settings: what the user chose, validated once.

`DevicePlan` (`plan`), the one value the towered model_fn and the staged
input_fn both take; `TowersConfig` with session settings (`config`); the
absl flags, defined only by `define_flags()` (`flags`); the staging
backends' names (`staging_backends`). Every setting, from Python or from
flags, passes `make_plan` / `make_config`, and an error names it as the
user wrote it.

May import: base, cluster, placement.
"""
