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
callers go through the same validation. The flags are key flags of the module
that calls `define_flags()`, so the script's `--help` lists them; validators
check them while absl parses argv, so a bad value stops the script with a
message in flag syntax before `main` runs.
"""

from __future__ import annotations

import inspect
from typing import Callable

from absl import flags

from estimator_towers.base import spelling
from estimator_towers.placement import strategies as placement
from estimator_towers.settings import config as config_lib
from estimator_towers.settings import plan as plan_lib
from estimator_towers.settings import staging_backends

# Flags that define_flags() defines belong to its caller (the training script),
# which makes them key flags of that script: its --help lists them.
flags.disclaim_key_flags()

# Flags checked together (each is also checked on its own).
_COMBINED = ('num_gpus', 'devices', 'num_cpu_devices', 'visible_gpus',
             'allow_cpu_fallback')

_STAGING_BACKEND_HELP = {
    'staging_area': 'a StagingArea per device, filled in the same session.run '
                    'as the step (tf_cnn_benchmarks\' scheme)',
}
_LOSS_REDUCTION_HELP = {
    'auto': 'the whole batch\'s loss rebuilt from the shards\' statistics '
            '(sums, means, sizes, batch sizes and sums of weights combined by '
            'elementwise arithmetic: token-weighted losses, BERT\'s two terms, a '
            'loss plus a regulariser); a loss it cannot rebuild gets one warning '
            'naming the op and the recorded reduction (mean when none is)',
    'exact': 'auto, but a loss the towers cannot rebuild exactly is an error',
    'mean': 'the loss averages over the batch: towers are weighted by their '
            'share of the batch',
    'sum': 'the loss adds up per-example losses: the towers\' gradients add up',
}


def _first_paragraph(cls: type) -> str:
  doc = inspect.getdoc(cls) or cls.__name__
  text = ' '.join(doc.split('\n\n')[0].split()).rstrip('.')
  return text[:1].lower() + text[1:]


def _choices(descriptions: dict[str, str]) -> str:
  return '; '.join(f'{name}: {text}' for name, text in descriptions.items())


def _definitions() -> dict[str, Callable[[flags.FlagValues], object]]:
  """One definer per TowersConfig field, keyed by the flag (= field) name."""
  strategies = {'auto': 'the strategy recommended for the towers\' devices and the cluster '
                        '(cpu on CPUs and 1-2 GPUs, gpu on 3-4, collective on 5 or more and '
                        'across a chief and workers)'}
  strategies.update({name: _first_paragraph(cls)
                     for name, cls in sorted(placement.STRATEGIES.items())})
  backends = {name: _STAGING_BACKEND_HELP.get(name, name) for name in sorted(staging_backends.BACKENDS)}
  return {
      'num_gpus': lambda fv: flags.DEFINE_integer(
          'num_gpus', None,
          'Towers on GPUs /gpu:0 .. /gpu:N-1; 0 trains on the CPU (one tower). '
          'Asking for more GPUs than are visible is an error unless '
          '--allow_cpu_fallback. Give at most one of --num_gpus, --devices and '
          '--num_cpu_devices; with none, the towers are every visible GPU (the '
          'CPU when there is none).', flag_values=fv),
      'devices': lambda fv: flags.DEFINE_list(
          'devices', None,
          'Explicit comma-separated tower devices, one tower each, e.g. '
          '/gpu:0,/gpu:2 or /cpu:0,/cpu:1 (CPU devices beyond /cpu:0 are '
          'created as virtual devices).', flag_values=fv),
      'num_cpu_devices': lambda fv: flags.DEFINE_integer(
          'num_cpu_devices', None,
          'Towers on N virtual CPU devices /cpu:0 .. /cpu:N-1: towered '
          'training on machines without GPUs (CI, laptops, tests). N >= 1.',
          flag_values=fv),
      'allow_cpu_fallback': lambda fv: flags.DEFINE_bool(
          'allow_cpu_fallback', False,
          'When --num_gpus asks for more GPUs than are visible, run the '
          'missing towers on the host CPU (one warning says so) instead of '
          'stopping with an error.', flag_values=fv),
      'variable_strategy': lambda fv: flags.DEFINE_enum(
          'variable_strategy', 'auto', list(strategies),
          'Where variables live and where gradients are combined. '
          + _choices(strategies) + '.', flag_values=fv),
      'staging_depth': lambda fv: flags.DEFINE_integer(
          'staging_depth', 1,
          'Input shards staged_input_fn keeps in flight per device: 0 turns '
          'staging off (the towers split each batch themselves); 1 overlaps '
          'the copy of the next batch with the current step; more buffers more '
          'batches.', flag_values=fv),
      'micro_batches': lambda fv: flags.DEFINE_integer(
          'micro_batches', 1,
          'Micro-batches per device: each device splits its shard of the '
          'global batch into this many parts and runs them one after another '
          'within one step (peak activation memory of about one part); the '
          'model_fn still gets the whole batch\'s gradient and makes one '
          'update per global batch. 1: none.', flag_values=fv),
      'shards': lambda fv: flags.DEFINE_integer(
          'shards', None,
          'The fixed shard grid: the global batch is always cut into this many '
          'shards, whatever the devices, and every sum across them is taken in '
          'one fixed order, so that checkpoints are bit-identical on any '
          'devices x micro-batches that divides it (with shards / devices a '
          'power of two). Unset: no grid (the update equals one device\'s to '
          'float32 rounding).', flag_values=fv),
      'worker_timeout_secs': lambda fv: flags.DEFINE_float(
          'worker_timeout_secs', 120.0,
          'With --variable_strategy=collective across a chief and workers: how '
          'long a training step, and the start, wait for the other training '
          'tasks before failing with DeadlineExceededError (seconds, > 0).',
          flag_values=fv),
      # A string, not an enum: make_config's check explains a removed value.
      'staging_backend': lambda fv: flags.DEFINE_string(
          'staging_backend', 'staging_area',
          'How staged_input_fn prefetches shards onto the devices, one of '
          + _choices(backends) + '.', flag_values=fv),
      'loss_reduction': lambda fv: flags.DEFINE_enum(
          'loss_reduction', 'auto', list(plan_lib.LOSS_REDUCTIONS),
          'How the model_fn\'s loss reduces the batch. '
          + _choices({name: _LOSS_REDUCTION_HELP.get(name, name)
                      for name in plan_lib.LOSS_REDUCTIONS}) + '.',
          flag_values=fv),
      'cross_example': lambda fv: flags.DEFINE_enum(
          'cross_example', 'auto', list(plan_lib.CROSS_EXAMPLE),
          'A computation across examples that cannot be split per tower (an op '
          'the library does not know, say): auto: it runs once on the whole '
          'batch on the first device, exact, with a warning giving that '
          'device\'s share of the step\'s heavy ops; refuse: an error when the '
          'graph is built, so the towers stay data-parallel.', flag_values=fv),
      'random_draws': lambda fv: flags.DEFINE_enum(
          'random_draws', 'keyed', list(plan_lib.RANDOM_DRAWS),
          'How random ops (dropout, noise) draw: keyed: each example\'s values '
          'are set by its position in the global batch and the global step, the '
          'same on any device count, micro-batch or worker and after a restart; '
          'per_shard: each tower draws its shard on its own (the result depends '
          'on the device count).', flag_values=fv),
      'resume_input': lambda fv: flags.DEFINE_bool(
          'resume_input', True,
          'In training, save the position of a tf.data input (its iterator and '
          'the batches prefetched or staged on devices) in every checkpoint, so '
          'a resumed train() or restarted job continues the same sequence of '
          'global batches on any number of devices, micro-batches or workers. '
          '--noresume_input: every train() call and restart reads its input '
          'from the first element again (examples seen twice, others never).',
          flag_values=fv),
      'sync_batch_norm': lambda fv: flags.DEFINE_bool(
          'sync_batch_norm', None,
          'Unset (the default): in training, every batch norm normalises with '
          'the mean and variance of the global batch (all towers\' shards), so '
          'a towered step equals the single-device step; with --micro_batches '
          'above 1 a batch norm is an error that asks for a choice. '
          '--sync_batch_norm: the same, and an error with micro-batches. '
          '--nosync_batch_norm: each tower (or micro-batch) normalises with '
          'its own shard\'s statistics; one warning names the batch norms.',
          flag_values=fv),
      'log_device_placement': lambda fv: flags.DEFINE_bool(
          'log_device_placement', False,
          'Log the device of every op when the session starts (very verbose).',
          flag_values=fv),
      'allow_soft_placement': lambda fv: flags.DEFINE_bool(
          'allow_soft_placement', True,
          'Let TensorFlow move ops without a kernel for their device (e.g. '
          'summaries on a GPU) to another device; on by default, as in '
          'Estimator. Missing GPUs are not hidden by it (see '
          '--allow_cpu_fallback).', flag_values=fv),
      'gpu_memory_fraction': lambda fv: flags.DEFINE_float(
          'gpu_memory_fraction', 0.0,
          'Share of each GPU\'s memory to take, in (0, 1]; 0 keeps '
          'TensorFlow\'s default (almost all of it).', flag_values=fv),
      'allow_growth': lambda fv: flags.DEFINE_bool(
          'allow_growth', False,
          'Allocate GPU memory as needed instead of up front.', flag_values=fv),
      'visible_gpus': lambda fv: flags.DEFINE_string(
          'visible_gpus', '',
          'GPU indices the session sees, e.g. 0,1 or 2,3 (they become /gpu:0, '
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

  The flags become key flags of the calling module (its `--help` lists them)
  and get validators: a bad value, alone or in combination (say
  `--num_gpus=2` on a machine without GPUs), fails the parse with absl's
  "FATAL Flags parsing error" and a message in flag syntax.

  Safe to call more than once: flags already defined are left alone. Every
  flag, with its default and choices, is listed on the flags page.

  Args:
    flag_values: the absl FlagValues to define the flags on; None for
      `absl.flags.FLAGS`.

  Example:
      ```python
      from absl import app
      import estimator_towers

      estimator_towers.define_flags()   # --num_gpus, --devices, --variable_strategy, ...

      def main(argv):
        config = estimator_towers.config_from_flags()
        ...

      if __name__ == '__main__':
        app.run(main)
      ```
  """
  flag_values = flags.FLAGS if flag_values is None else flag_values
  defined = []
  for name, define in _definitions().items():
    if name not in flag_values:
      define(flag_values)
      defined.append(name)
      flags.register_validator(name, _field_checker(name), flag_values=flag_values)
  if set(_COMBINED) <= set(defined):
    flags.register_multi_flags_validator(
        list(_COMBINED), _combined_checker(flag_values), flag_values=flag_values)


def _field_checker(name: str) -> Callable[[object], bool]:
  def check(value: object) -> bool:
    with spelling.flag_syntax():
      try:
        config_lib.check_field(name, value)
      except ValueError as e:
        raise flags.ValidationError(str(e)) from e
    return True
  return check


def _combined_checker(flag_values: flags.FlagValues) -> Callable[[dict], bool]:
  def check(unused_values: dict) -> bool:
    del unused_values  # Every field is read: make_config checks them together.
    for name in config_lib.FIELDS:  # A bad field is reported by its own validator.
      try:
        with spelling.flag_syntax():
          config_lib.check_field(name, flag_values[name].value)
      except ValueError:
        return True
    try:
      config_from_flags(flag_values)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from e
    return True
  return check


def config_from_flags(flag_values: flags.FlagValues | None = None
                      ) -> config_lib.TowersConfig:
  """The TowersConfig of the parsed flags, validated by `make_config`.

  Call it after absl has parsed argv (in `main`). Errors speak flag syntax
  (`--num_cpu_devices=0`).

  Args:
    flag_values: the parsed FlagValues `define_flags` defined the flags on;
      None for `absl.flags.FLAGS`.

  Returns:
    The validated `TowersConfig`; its `plan` is the `DevicePlan` for
    `replicate_model_fn` and `staged_input_fn`.

  Raises:
    ValueError: if `define_flags` was not called on `flag_values`, or for any
      value `make_config` rejects.

  Example:
      ```python
      def main(argv):
        config = estimator_towers.config_from_flags()
        estimator = tf.estimator.Estimator(
            estimator_towers.replicate_model_fn(model_fn, plan=config.plan),
            config=estimator_towers.make_run_config(config, model_dir=FLAGS.model_dir))
      ```
  """
  flag_values = flags.FLAGS if flag_values is None else flag_values
  missing = [name for name in config_lib.FIELDS if name not in flag_values]
  if missing:
    raise ValueError(
        f'config_from_flags needs the flags of define_flags(), but {missing} '
        f'are not defined. Call define_flags() (with the same FlagValues) '
        f'before the flags are parsed.')
  with spelling.flag_syntax():
    return config_lib.make_config(
        **{name: flag_values[name].value for name in config_lib.FIELDS})
