"""A patch shared by threads: attributes replaced while any thread holds it, then restored.

Rule: the interception of TensorFlow's functions (`interception`) replaces a
module's or class's attribute only while some thread builds a towered graph;
the replacement is one for all threads (Python attributes are global), each
thread saying by its own thread-local state whether it acts for it, and the
last thread to let go restores the originals (an inherited method is deleted
again, not set).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

__all__ = ['SharedPatch']


class SharedPatch:
  """Attributes replaced while any thread holds the patch (counted, one lock), then restored.

  `targets()` gives (owner, name, make) triples: `owner.name` becomes
  `make(original)`. Each user thread says by its own thread-local state
  whether the replacement acts for it; the patch itself is shared. With
  `active` (a thread-local), holding the patch also raises the holding
  thread's `active.depth` (nested holds count), which the replacements read.
  """

  def __init__(self, targets: Callable[[], list], active: threading.local | None = None):
    self._targets, self._users, self._saved = targets, 0, []
    self._active = active
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def held(self) -> Iterator[None]:
    with self._lock:
      if self._users == 0:
        for owner, name, make in self._targets():
          original = getattr(owner, name)
          self._saved.append((owner, name, original, name in vars(owner)))
          setattr(owner, name, make(original))
      self._users += 1
    depth = getattr(self._active, 'depth', 0)
    if self._active is not None:
      self._active.depth = depth + 1
    try:
      yield
    finally:
      if self._active is not None:
        self._active.depth = depth
      with self._lock:
        self._users -= 1
        if self._users == 0:
          for owner, name, original, own in reversed(self._saved):
            if own:
              setattr(owner, name, original)
            else:
              delattr(owner, name)   # an inherited method again
          self._saved.clear()
