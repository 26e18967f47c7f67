"""What the bench scripts share: the machine they ran on, interleaved timing."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Any, Sequence


def machine() -> str:
  """The CPU model (from lscpu where there is one) and the core count."""
  try:
    lscpu = subprocess.run(['lscpu'], capture_output=True, text=True, check=False).stdout
    model = next((l.split(':', 1)[1].strip() for l in lscpu.splitlines()
                  if l.startswith('Model name')), platform.processor())
  except OSError:
    model = platform.processor()
  return f'{model}, {os.cpu_count()} cores'


def interleaved_seconds_per_step(sessions: dict[str, tuple[Any, Any]], order: Sequence[str],
                                 warmup_steps: int, rounds: int, steps: int
                                 ) -> dict[str, list[float]]:
  """Seconds per step of each `(session, fetch)`, one chunk of `steps` per round each.

  After `warmup_steps` untimed steps per session, every round runs one chunk
  of each configuration in `order` (reversed every other round), so that the
  configurations alternate under the same machine load.
  """
  for session, fetch in sessions.values():
    for _ in range(warmup_steps):
      session.run(fetch)
  seconds = {name: [] for name in order}
  for round_index in range(rounds):
    for name in (order if round_index % 2 == 0 else order[::-1]):
      session, fetch = sessions[name]
      start = time.perf_counter()
      for _ in range(steps):
        session.run(fetch)
      seconds[name].append((time.perf_counter() - start) / steps)
  return seconds
