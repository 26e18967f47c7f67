"""The staged input_fn's backends: their names, and the check of a name.

Kept apart from staging.py so that plan.py (which validates
`staging_backend`) and staging.py (which takes a plan) both import it without
importing each other.
"""

from __future__ import annotations

# Staging backends (the `staging_backend` option): one, kept as an option so
# that configurations naming it keep working and a removed one gets a clear error.
BACKENDS: tuple[str, ...] = ('staging_area',)

# Removed backends, with what to say to a configuration that still names one.
REMOVED_BACKENDS: dict[str, str] = {
    'multi_device_iterator': (
        'it was removed: tf.data\'s MultiDeviceIterator hands an input '
        'pipeline error to one device only and ends the others\' sequences, '
        'so an input error could pass for the end of input; and it was slower '
        'than staging_area (about 9% more CPU per step, and 0.1-0.25 s more '
        'to start each train/evaluate/predict call, measured on 2-8 virtual '
        'CPU devices)'),
}


def validate_backend(name: object, what: str = 'backend') -> str:
  """Checks a staging backend name (`what` names the argument in the message).

  Raises:
    ValueError: if `name` is not one of `BACKENDS` (a removed backend's message
      says why it went).
  """
  if isinstance(name, str) and name in REMOVED_BACKENDS:
    raise ValueError(
        f'{what}={name!r} is no longer available: {REMOVED_BACKENDS[name]}. '
        f'Use {what}=\'staging_area\' (the default), or leave it out.')
  if name not in BACKENDS:
    raise ValueError(
        f'{what} must be one of {list(BACKENDS)}, got {name!r}: '
        f'"staging_area" puts the shards into a StagingArea per device.')
  return name
