"""What the bench scripts share: a description of the machine they ran on."""

from __future__ import annotations

import os
import platform
import subprocess


def machine() -> str:
  """The CPU model (from lscpu where there is one) and the core count."""
  try:
    lscpu = subprocess.run(['lscpu'], capture_output=True, text=True, check=False).stdout
    model = next((l.split(':', 1)[1].strip() for l in lscpu.splitlines()
                  if l.startswith('Model name')), platform.processor())
  except OSError:
    model = platform.processor()
  return f'{model}, {os.cpu_count()} cores'
