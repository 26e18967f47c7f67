"""How error messages spell a setting: `num_gpus=4` from Python, `--num_gpus=4` from flags.

The same checks validate `make_config(...)` and the command-line flags; a user
who typed `--num_cpu_devices=0` should read advice in flag syntax, and a
Python caller in Python syntax. `config_from_flags` and the flag validators run
the checks inside `flag_syntax()`; messages build their setting names with
`name()` and `setting()`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

_FLAG_SYNTAX = contextvars.ContextVar('estimator_towers_flag_syntax', default=False)


@contextlib.contextmanager
def flag_syntax() -> Iterator[None]:
  """Within this block, messages spell settings as command-line flags."""
  token = _FLAG_SYNTAX.set(True)
  try:
    yield
  finally:
    _FLAG_SYNTAX.reset(token)


def flags_active() -> bool:
  """True inside `flag_syntax()`."""
  return _FLAG_SYNTAX.get()


def name(field: str) -> str:
  """'num_gpus', or '--num_gpus' inside `flag_syntax()`."""
  return f'--{field}' if flags_active() else field


def _flag_text(value: Any) -> str:
  if value is None:
    return ''
  if isinstance(value, (list, tuple)):
    return ','.join(str(v) for v in value)
  return str(value)


def setting(field: str, value: Any) -> str:
  """A setting as the user writes it.

  'num_gpus=4' / "devices=['/cpu:0']" / 'allow_cpu_fallback=True' from Python;
  '--num_gpus=4' / '--devices=/cpu:0' / '--allow_cpu_fallback' (False:
  '--noallow_cpu_fallback') inside `flag_syntax()`.
  """
  if not flags_active():
    return f'{field}={value!r}'
  if isinstance(value, bool):
    return f'--{field}' if value else f'--no{field}'
  return f'--{field}={_flag_text(value)}'


def value(field: str, given: Any) -> str:
  """A received value for 'got ...': repr from Python, the flag from flags."""
  return setting(field, given) if flags_active() else repr(given)
