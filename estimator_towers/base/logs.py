"""Log lines a run shows once: each line printed once, some once per graph or per process.

Estimator calls the model_fn once per graph it builds (training, each
evaluation, export), and a script may build its config several times; a
notice repeated at each call says nothing new and buries the rest of the log.
Every line of the library goes to absl's logger (its level is absl's
verbosity) and never installs a handler on the root logger, as absl's
`logging.info` would: TensorFlow's logger has a handler of its own, and a
root handler would print each of TensorFlow's lines a second time. Where
nothing else would print an absl line (no handler on the root logger or on
absl's), one handler of this module prints it to stderr, as
`logging.basicConfig()` would have.
"""

from __future__ import annotations

import logging as std_logging
import sys
import threading
import weakref

from absl import logging as absl_logging
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
  warning('%s', message)
  return True


def info_once_per_graph(message: str, graph: tf.Graph | None = None) -> bool:
  """Logs `message` at INFO once per graph (default: the default graph); True if logged."""
  return _once_per_graph(info, message, graph)


def warning_once_per_graph(message: str, graph: tf.Graph | None = None) -> bool:
  """Logs `message` as a warning once per graph (default: the default graph); True if logged."""
  return _once_per_graph(warning, message, graph)


def _once_per_graph(log, message: str, graph: tf.Graph | None) -> bool:
  graph = graph if graph is not None else tf.compat.v1.get_default_graph()
  with _lock:
    seen = _logged_in.setdefault(graph, set())
    if message in seen:
      return False
    seen.add(message)
  log('%s', message)
  return True


class _LastResort(std_logging.Handler):
  """Prints an absl record to stderr only where no other handler would."""

  def __init__(self):
    super().__init__()
    self.setFormatter(std_logging.Formatter(std_logging.BASIC_FORMAT))

  def _others_print(self, logger: std_logging.Logger, record) -> bool:
    while logger is not None:
      if any(h is not self and record.levelno >= h.level for h in logger.handlers):
        return True
      if not logger.propagate:
        return False
      logger = logger.parent
    return False

  def emit(self, record) -> None:
    if self._others_print(absl_logging.get_absl_logger(), record):
      return
    try:
      sys.stderr.write(self.format(record) + '\n')
    except Exception:  # pylint: disable=broad-except
      self.handleError(record)


_last_resort = _LastResort()


def _logger() -> std_logging.Logger:
  logger = absl_logging.get_absl_logger()
  if _last_resort not in logger.handlers:
    with _lock:
      if _last_resort not in logger.handlers:
        logger.addHandler(_last_resort)
  return logger


def info(message: str, *args) -> None:
  """Logs at INFO on absl's logger (shown from absl's verbosity INFO)."""
  _logger().info(message, *args)


def warning(message: str, *args) -> None:
  """Logs a warning on absl's logger."""
  _logger().warning(message, *args)


def error(message: str, *args) -> None:
  """Logs an error on absl's logger."""
  _logger().error(message, *args)
