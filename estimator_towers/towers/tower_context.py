"""current_tower(): which tower a model_fn is being built for.

A towered model_fn runs the user's model_fn once per tower. Code inside it
that needs per-tower state or ops (names, local variables, a side effect that
must happen once per step) asks `current_tower()`. Towers may be built inside
one another (a tower can be built while another waits for gradients), so the
context is a stack; graph construction happens on one thread, and each thread
has its own stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Iterator


@dataclasses.dataclass(frozen=True)
class TowerContext:
  """The tower a model_fn call builds.

  With micro-batches (`micro_batches=k`), a tower is one shard: one
  micro-batch of one device, built once each; shards are numbered
  device-major, so shard `index` is micro-batch `index % k` of device
  `index // k`, and `num_towers` is (devices) * k. The micro-batches of one
  device share that device's variables and run one after another.

  Attributes:
    index: the tower's (shard's) index, 0 .. num_towers - 1.
    num_towers: how many towers (shards) the towered model_fn builds at most:
      devices times micro-batches per device.
    device: the tower's device ('/device:GPU:1'), or None outside towers.
    primary: True for the tower whose side effects run: its train_op is the
      one Estimator runs, with its update ops (batch-norm moving averages) and
      summaries (tower 0). The other towers contribute gradients only.

  Example:
      ```python
      tower = estimator_towers.current_tower()   # inside a model_fn
      if tower.num_towers > 1:
        tf.compat.v1.logging.info('building tower %d of %d on %s',
                                  tower.index, tower.num_towers, tower.device)
      ```
  """
  index: int
  num_towers: int
  device: str | None
  primary: bool


OUTSIDE = TowerContext(index=0, num_towers=1, device=None, primary=True)

_local = threading.local()
_builds = itertools.count(1)


def _stack() -> list[tuple[TowerContext, int]]:
  if not hasattr(_local, 'stack'):
    _local.stack = []
  return _local.stack


def reads() -> int:
  """How many times this thread has asked `current_tower` or `current_build`.

  A model_fn that asks (directly, or through `loss_denominator` or
  `global_mean`) may build something else on each tower, so its other towers
  are not copied from the first (`tower_copies`). The library's own sync
  points ask through `peek`, which is not counted.
  """
  return getattr(_local, 'reads', 0)


def peek() -> tuple[TowerContext, int]:
  """(`current_tower()`, `current_build()`), not counted as a read of the model_fn."""
  stack = _stack()
  return stack[-1] if stack else (OUTSIDE, 0)


def _count_read() -> None:
  _local.reads = reads() + 1


def current_build() -> int:
  """A number unique to the current tower build (0 outside towers).

  A tower's model_fn may be built more than once (a second pass); each build
  has its own number.
  """
  _count_read()
  stack = _stack()
  return stack[-1][1] if stack else 0


def current_tower() -> TowerContext:
  """The tower being built, as seen from inside a model_fn.

  Outside a towered model_fn (a plain model_fn, an input_fn, a hook) the
  answer is one device: index 0 of 1 tower, device None, primary.

  Returns:
    A `TowerContext`: the tower's index, the number of towers, its device
    and whether it is the primary tower (the one whose side effects run).

  Example:
      ```python
      def model_fn(features, labels, mode):
        logits = build_model(features)
        tower = estimator_towers.current_tower()
        if tower.primary:   # once per step, not once per tower
          tf.compat.v1.summary.histogram('logits', logits)
        ...
      ```
  """
  _count_read()
  stack = _stack()
  return stack[-1][0] if stack else OUTSIDE


@contextlib.contextmanager
def entering(index: int, num_towers: int, device: str | None,
             primary: bool) -> Iterator[TowerContext]:
  """While a tower's model_fn call is built, `current_tower()` describes it."""
  context = TowerContext(index=index, num_towers=num_towers, device=device,
                         primary=primary)
  stack = _stack()
  stack.append((context, next(_builds)))
  try:
    yield context
  finally:
    stack.pop()
