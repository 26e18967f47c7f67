"""The user's own model for the own-model check: `pkg.mod:fn` paths and `--params`.

The rule: a function is named as `module.path:function` (the module
importable from the current directory or the Python path, the function a
name in it, dots allowed for an attribute of an attribute); `--params` is a
JSON object, the `params` Estimator hands the model_fn and the input_fns
that name a `params` argument. The form is checked when the flags are read;
the import runs in the check, so that an error in the user's module is that
check's FAIL, with the message, in the report and the JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Callable

EXAMPLE = 'my_project.model:model_fn'


def form_problem(flag: str, value: str) -> str | None:
  """Why `value` is not a `module.path:function` (None when it is)."""
  module, _, name = value.partition(':')
  if not module or not name or ':' in name or not all(
      part.isidentifier() for part in module.split('.') + name.split('.')):
    return (f'--{flag} names a function as module.path:function (e.g. '
            f'--{flag}={EXAMPLE.replace("model_fn", flag)}), got --{flag}={value}. Give the '
            f'module importable from this directory or PYTHONPATH, a colon, and the name '
            f'of the function in it.')
  return None


def load(flag: str, value: str) -> Callable:
  """The function `value` names (`module.path:function`), imported."""
  problem = form_problem(flag, value)
  if problem:
    raise ValueError(problem)
  module_name, _, name = value.partition(':')
  if os.getcwd() not in sys.path and '' not in sys.path:
    sys.path.insert(0, os.getcwd())  # `python -m` puts the directory first; a library call may not
  try:
    target: Any = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f'--{flag}={value}: the module {module_name} cannot be imported ({e}). '
                     f'Run from the directory that holds it, or add that directory to '
                     f'PYTHONPATH.') from e
  for part in name.split('.'):
    if not hasattr(target, part):
      raise ValueError(f'--{flag}={value}: {module_name} has no {name}. Name a function '
                       f'defined in {module_name}.')
    target = getattr(target, part)
  if not callable(target):
    raise ValueError(f'--{flag}={value}: {name} is a {type(target).__name__}, not a '
                     f'function. Name the function itself.')
  return target


def params_problem(value: str | None) -> str | None:
  """Why `value` is not a JSON object (None when it is, or not given)."""
  if value is None:
    return None
  try:
    parsed = json.loads(value)
  except ValueError as e:
    return (f'--params is a JSON object, got --params={value} ({e}). Quote it for the '
            f'shell, e.g. --params=\'{{"batch_size": 32}}\'.')
  if not isinstance(parsed, dict):
    return (f'--params is a JSON object (the model_fn\'s params dict), got '
            f'--params={value}, a {type(parsed).__name__}. Write it as {{"name": value}}.')
  return None


def params(value: str | None) -> dict:
  """The `params` dict of `--params` (empty without it)."""
  problem = params_problem(value)
  if problem:
    raise ValueError(problem)
  return {} if value is None else json.loads(value)
