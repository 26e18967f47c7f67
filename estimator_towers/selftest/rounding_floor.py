"""The own-model check's rounding floor: how far float32 rounding alone moves the reference.

The rule: the reference (the model_fn decorated for the first device alone)
runs again, twice, from its step-0 checkpoint with every nonzero float
variable moved by one unit in the last place (`np.nextafter`, once up, once
down), on the same batches with the same draws. Exact arithmetic would give
the reference's values to about that unit; what float32 gives is the
model's rounding floor: the largest difference of either nudged run from the
reference, relative to max(1, |value|). Any two correct computations of the
same steps that round differently (another summation order: N towers add
their shards' sums) differ by about as much. For most models the floor is
at most about `exactness.TOLERANCE`. A model whose gradient is not smooth
where its training goes (a ReLU on an activation within rounding of 0 passes
all or nothing of its gradient: a deep network with batch norm has some at
every step, and later steps amplify them) can have a floor far above it, on
one device alone; there a candidate passes within `FACTOR` x the floor. So the tolerance is `tolerance(floor)` =
max(TOLERANCE, FACTOR x floor); a mistake (another batch's statistics, a
loss scaled on one tower) is a difference of the gradient's own size and
stays far above it.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Callable

import numpy as np
import tensorflow as tf

from estimator_towers.selftest import exactness
from estimator_towers.selftest import one_start

FACTOR = 4.0
_OBJECT_GRAPH = '_CHECKPOINTABLE_OBJECT_GRAPH'


def tolerance(floor: float) -> float:
  """The largest difference a candidate may show: max(TOLERANCE, FACTOR x floor)."""
  return max(exactness.TOLERANCE, FACTOR * floor)


def nudged(value: np.ndarray, direction: float) -> np.ndarray:
  """`value`'s nonzero floats moved by one unit in the last place towards `direction`."""
  value = np.asarray(value)
  if value.dtype.kind != 'f':
    return value
  moved = np.nextafter(value, np.asarray(direction, value.dtype))
  return np.where(value != 0, moved, value).astype(value.dtype)


def nudged_start(start: str, direction: float, root: str | None = None) -> str:
  """A directory (in `root`) holding `start`'s step-0 checkpoint with its floats nudged."""
  reader = tf.train.load_checkpoint(start)
  directory = tempfile.mkdtemp(prefix='nudged_', dir=root)
  with tf.Graph().as_default():
    variables = {name: tf.compat.v1.Variable(nudged(reader.get_tensor(name), direction),
                                             name=f'v{i}')
                 for i, name in enumerate(sorted(reader.get_variable_to_shape_map()))
                 if name != _OBJECT_GRAPH}
    saver = tf.compat.v1.train.Saver(variables)
    with tf.compat.v1.Session() as session:
      session.run(tf.compat.v1.global_variables_initializer())
      saver.save(session, os.path.join(directory, 'model.ckpt'), global_step=0,
                 write_meta_graph=False)
  return directory


@dataclasses.dataclass
class Floor:
  """The largest difference of a nudged reference from the reference, and where."""
  value: float
  variable: str

  @property
  def tolerance(self) -> float:
    return tolerance(self.value)


def measure(model_fn: Callable, input_fn: Callable, device: str, params: dict, start: str,
            steps: int, reference: one_start.Trained,
            differences: Callable[[one_start.Trained, one_start.Trained], dict],
            root: str | None = None, settings: dict | None = None) -> Floor:
  """The floor: the reference's runs from `start` nudged up and down, against `reference`."""
  worst = Floor(0.0, '')
  for direction in (np.inf, -np.inf):
    trained = one_start.train(model_fn, input_fn, [device], 1, params,
                              nudged_start(start, direction, root), steps, root, settings)
    found = differences(trained, reference)
    for name, value in found.items():
      if value > worst.value:
        worst = Floor(value, name)
  return worst


def fields(floor: Floor) -> dict:
  """The floor's entries in the check's JSON."""
  return {'tolerance': floor.tolerance, 'base_tolerance': exactness.TOLERANCE,
          'rounding_floor': floor.value, 'rounding_floor_variable': floor.variable,
          'rounding_floor_factor': FACTOR}


def floor_line(floor: Floor) -> str:
  """The report's line: the floor, where, and the tolerance it sets."""
  where = f' at {floor.variable}' if floor.variable else ''
  return (f'rounding floor {floor.value:.2e}{where} (the reference from its start moved by '
          f'one unit in the last place); tolerance {floor.tolerance:.2e} = max('
          f'{exactness.TOLERANCE:g}, {FACTOR:g} x floor)')

