"""Variable placement strategies: where variables live and where gradients meet.

Each strategy is a small class behind one interface; `STRATEGIES` maps the
`variable_strategy` name (a flag value) to its class. Tower compute always stays
on the tower's own device; a strategy only decides where each new variable is
created and on which device a variable's per-tower gradients are summed.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from estimator_towers import devices as devices_lib


class Placement:
  """Interface of a variable placement strategy.

  Args:
    tower_devices: canonical device strings, one per tower.
  """

  name = ''

  def __init__(self, tower_devices: Sequence[str]):
    self.tower_devices = tuple(tower_devices)

  def variable_device(self, shape: tf.TensorShape | None, dtype: tf.DType | None,
                      name: str) -> str:
    """The device a new variable is created on."""
    raise NotImplementedError

  def aggregation_device(self, variable: tf.Variable) -> str:
    """The device on which `variable`'s gradients are combined: its own."""
    return variable.device

  def describe(self) -> str:
    """One line for the placement log."""
    raise NotImplementedError


class CpuPlacement(Placement):
  """Variables on one parameter device: the host CPU of the first tower's
  worker when there are several towers, the single device otherwise."""

  name = 'cpu'

  def __init__(self, tower_devices: Sequence[str]):
    super().__init__(tower_devices)
    first = self.tower_devices[0]
    self.parameter_device = (first if len(self.tower_devices) == 1
                             else devices_lib.host_device(first))

  def variable_device(self, shape, dtype, name):
    return self.parameter_device

  def describe(self):
    return f'variables on {self.parameter_device}'


STRATEGIES: dict[str, type[Placement]] = {
    CpuPlacement.name: CpuPlacement,
}


def validate_strategy(name: object) -> str:
  """Checks a `variable_strategy` name.

  Raises:
    ValueError: if `name` is not one of `STRATEGIES`.
  """
  if name not in STRATEGIES:
    raise ValueError(
        f'variable_strategy must be one of {sorted(STRATEGIES)}, got '
        f'{name!r}.')
  return name


def make_placement(name: str, tower_devices: Sequence[str]) -> Placement:
  return STRATEGIES[validate_strategy(name)](tower_devices)
