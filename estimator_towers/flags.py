"""Command-line flags for towered training scripts.

Nothing is defined at import time: a script calls `define_flags()` (once or
more), lets absl parse argv, then `config_from_flags()`:

  define_flags()
  ...  # inside main(argv), after app.run parsed the flags:
  config = config_from_flags()
  estimator = tf.estimator.Estimator(
      replicate_model_fn(model_fn, plan=config.plan),
      config=make_run_config(config, model_dir=...))

Each flag is named after the `TowersConfig` field it sets, and
`config_from_flags` hands the values to `make_config`, so flags and Python
callers go through the same validation.
"""

from __future__ import annotations

from typing import Callable

from absl import flags

from estimator_towers import config as config_lib
from estimator_towers import placement
from estimator_towers import plan as plan_lib
from estimator_towers import staging


def _definitions() -> dict[str, Callable[[flags.FlagValues], object]]:
  """One definer per TowersConfig field, keyed by the flag (= field) name."""
  return {
      'num_gpus': lambda fv: flags.DEFINE_integer(
          'num_gpus', None,
          'Towers on /gpu:0 .. /gpu:N-1. At most one of --num_gpus, --devices '
          'and --num_cpu_devices; with none, every visible GPU (the CPU when '
          'there is none).', flag_values=fv),
      'devices': lambda fv: flags.DEFINE_list(
          'devices', None,
          'Explicit comma-separated tower devices, e.g. /gpu:0,/gpu:2 or '
          '/cpu:0,/cpu:1 (CPU devices beyond /cpu:0 are created as virtual '
          'devices).', flag_values=fv),
      'num_cpu_devices': lambda fv: flags.DEFINE_integer(
          'num_cpu_devices', None,
          'Towers on N virtual CPU devices /cpu:0 .. /cpu:N-1, for machines '
          'without GPUs (CI, laptops, tests).', flag_values=fv),
      'variable_strategy': lambda fv: flags.DEFINE_enum(
          'variable_strategy', 'cpu', sorted(placement.STRATEGIES),
          'Where variables live and gradients are combined.', flag_values=fv),
      'staging_depth': lambda fv: flags.DEFINE_integer(
          'staging_depth', 1,
          'Input shards kept in flight per device (0 turns staging off).',
          flag_values=fv),
      # A string, not an enum: make_config's check explains a removed value.
      'staging_backend': lambda fv: flags.DEFINE_string(
          'staging_backend', 'staging_area',
          f'How staged_input_fn prefetches shards onto the devices, one of '
          f'{list(staging.BACKENDS)}: a StagingArea per device.',
          flag_values=fv),
      'loss_reduction': lambda fv: flags.DEFINE_enum(
          'loss_reduction', 'auto', list(plan_lib.LOSS_REDUCTIONS),
          'How the model_fn\'s loss reduces the batch: auto (the reduction '
          'its tf.compat.v1.losses / Keras loss records; v1 canned heads sum; '
          'mean when none is recorded), mean (towers weighted by their share '
          'of the batch) or sum (towers add up).',
          flag_values=fv),
      'log_device_placement': lambda fv: flags.DEFINE_bool(
          'log_device_placement', False,
          'Log the device of every op when the session starts.', flag_values=fv),
      'allow_soft_placement': lambda fv: flags.DEFINE_bool(
          'allow_soft_placement', True,
          'Let TensorFlow move ops without a kernel for their device (e.g. '
          'summaries on a GPU) elsewhere. With --noallow_soft_placement, '
          'towers asked for on missing GPUs are an error instead of a warning.',
          flag_values=fv),
      'gpu_memory_fraction': lambda fv: flags.DEFINE_float(
          'gpu_memory_fraction', 0.0,
          'Share of each GPU\'s memory to take, in (0, 1]; 0 keeps '
          'TensorFlow\'s default.', flag_values=fv),
      'allow_growth': lambda fv: flags.DEFINE_bool(
          'allow_growth', False,
          'Allocate GPU memory as needed instead of up front.', flag_values=fv),
      'visible_gpus': lambda fv: flags.DEFINE_string(
          'visible_gpus', '',
          'GPU indices the session sees, e.g. "0,1" (they become /gpu:0, '
          '/gpu:1); empty for every GPU.', flag_values=fv),
      'intra_op_threads': lambda fv: flags.DEFINE_integer(
          'intra_op_threads', 0,
          'Threads used inside one op; 0 lets TensorFlow choose.', flag_values=fv),
      'inter_op_threads': lambda fv: flags.DEFINE_integer(
          'inter_op_threads', 0,
          'Ops run in parallel; 0 lets TensorFlow choose.', flag_values=fv),
  }


def define_flags(flag_values: flags.FlagValues | None = None) -> None:
  """Defines the towering flags on `flag_values` (default `absl.flags.FLAGS`).

  Safe to call more than once: flags already defined are left alone.
  """
  flag_values = flags.FLAGS if flag_values is None else flag_values
  for name, define in _definitions().items():
    if name not in flag_values:
      define(flag_values)


def config_from_flags(flag_values: flags.FlagValues | None = None
                      ) -> config_lib.TowersConfig:
  """The TowersConfig of the parsed flags, validated by `make_config`.

  Raises:
    ValueError: if `define_flags` was not called on `flag_values`, or for any
      value `make_config` rejects.
  """
  flag_values = flags.FLAGS if flag_values is None else flag_values
  missing = [name for name in config_lib.FIELDS if name not in flag_values]
  if missing:
    raise ValueError(
        f'config_from_flags needs the flags of define_flags(), but {missing} '
        f'are not defined. Call define_flags() (with the same FlagValues) '
        f'before the flags are parsed.')
  return config_lib.make_config(
      **{name: flag_values[name].value for name in config_lib.FIELDS})
