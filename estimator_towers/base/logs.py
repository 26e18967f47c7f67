"""Log lines a run shows once: per graph (what the towers got) or per process (warnings).

Estimator calls the model_fn once per graph it builds (training, each
evaluation, export), and a script may build its config several times; a
notice repeated at each call says nothing new and buries the rest of the log.
"""

from __future__ import annotations

import threading
import weakref

from absl import logging
import tensorflow as tf

_lock = threading.Lock()
_warned: set[str] = set()
_logged_in: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {message}


def warning_once(message: str, key: str | None = None) -> bool:
  """Logs `message` as a warning unless this process already did; True if logged.

  Args:
    message: the warning.
    key: what makes two warnings the same (default: the message), e.g. the
      same fact spelled once in flag syntax and once in Python syntax.
  """
  key = message if key is None else key
  with _lock:
    if key in _warned:
      return False
    _warned.add(key)
  logging.warning('%s', message)
  return True


def info_once_per_graph(message: str, graph: tf.Graph | None = None) -> bool:
  """Logs `message` at INFO once per graph (default: the default graph); True if logged."""
  graph = graph if graph is not None else tf.compat.v1.get_default_graph()
  with _lock:
    seen = _logged_in.setdefault(graph, set())
    if message in seen:
      return False
    seen.add(message)
  logging.info('%s', message)
  return True
