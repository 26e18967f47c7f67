"""The self-test's report: one result per check, as text and as JSON.

A check is a function returning a `Result`: its status (PASS, FAIL, or INFO
for what is measured rather than judged), the lines the text report prints
and the numbers the JSON holds. `run_check` runs one check so that nothing it
raises stops the others: an exception becomes that check's FAIL, with the
error. The whole report FAILs when any check does, and the command's exit
status says so (`exit_status`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from typing import Any, Callable

PASS, FAIL, INFO = 'PASS', 'FAIL', 'INFO'


@dataclasses.dataclass
class Result:
  """One check's outcome: `status`, its report `lines`, its numbers in `data`."""
  name: str
  status: str = INFO
  lines: list[str] = dataclasses.field(default_factory=list)
  data: dict[str, Any] = dataclasses.field(default_factory=dict)
  error: str | None = None
  seconds: float = 0.0


def run_check(name: str, check: Callable[[], Result]) -> Result:
  """`check()`, timed; anything it raises becomes a FAIL naming the error."""
  start = time.perf_counter()
  try:
    result = check()
  except Exception as e:  # pylint: disable=broad-except  (one check's crash is its FAIL)
    message = f'{type(e).__name__}: {e}'.strip()
    result = Result(name, FAIL, [f'FAIL  the check crashed: {message.splitlines()[0][:400]}'],
                    error=message + '\n' + traceback.format_exc(limit=-3))
  result.seconds = time.perf_counter() - start
  return result


def overall(results: list[Result]) -> str:
  return FAIL if any(r.status == FAIL for r in results) else PASS


def exit_status(results: list[Result]) -> int:
  """0 when no check failed, 1 otherwise."""
  return int(overall(results) == FAIL)


def text(results: list[Result]) -> str:
  """The report as printed: a section per check, then the overall result."""
  out = ['estimator_towers self-test']
  for r in results:
    out.append(f'== {r.name} ({r.status}, {r.seconds:.0f} s) ==')
    out.extend(r.lines)
  failed = [r.name for r in results if r.status == FAIL]
  out.append(f'== result: {overall(results)}'
             + (f' (failed: {", ".join(failed)})' if failed else '') + ' ==')
  return '\n'.join(out)


def as_json(results: list[Result]) -> dict:
  """The report as one JSON object: the overall status and every check."""
  return {'status': overall(results),
          'checks': [dataclasses.asdict(r) for r in results]}


def write_json(results: list[Result], path: str) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(as_json(results), f, indent=2, sort_keys=True, default=str)
    f.write('\n')
