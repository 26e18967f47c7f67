"""A static size read the same under TF2 and TF1 shapes: an int, or None if unknown.

Under TF2 shapes `x.shape[0]` is an int or None; under TF1 shapes
(`tf.compat.v1.disable_v2_tensorshape()`, part of `disable_v2_behavior()`) it
is a `Dimension`, which is never `None`, compares to None as unknown and
fails `int()` when unknown. Every stage reads a static size through `dim`, so
that both behaviours give the same int or None.
"""

from __future__ import annotations

import tensorflow as tf


def dim(value, axis: int = 0) -> int | None:
  """Axis `axis`'s static size of `value` (a Tensor, anything with a `shape`, or a
  TensorShape): an int, or None where the size or the rank is unknown."""
  shape = value if isinstance(value, tf.TensorShape) else tf.TensorShape(value.shape)
  if shape.rank is None or not -shape.rank <= axis < shape.rank:
    return None
  return tf.compat.v1.dimension_value(shape[axis])


def dims(value) -> list | None:
  """Every axis's static size of `value` as `dim` reads it; None if the rank is unknown."""
  shape = value if isinstance(value, tf.TensorShape) else tf.TensorShape(value.shape)
  return None if shape.rank is None else [tf.compat.v1.dimension_value(d) for d in shape]
