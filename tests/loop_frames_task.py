"""Recurrent models under TF1 behaviour (control flow v1 frames), in a process of their own.

`python tests/loop_frames_task.py CASE...` calls `disable_v2_behavior()` first
(process-global, so never in the pytest process), then per CASE ('model-layout', a model of
tests/loop_models.py and a layout of tests/test_loop_models.py) trains the plain and the
towered model_fn (`test_loop_models._train`: steps 1 and 2) and prints one JSON line:
{"case", "error" (None: every variable and slot within 1e-5, no warning), "share" (the
least loaded device's heavy ops over the plain graph's, While loops counted)}. Run by
tests/test_loop_frames.py.
"""

import json
import os
import sys
import traceback

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import tensorflow as tf  # pylint: disable=g-import-not-at-top


def run(case: str) -> dict:
  import test_loop_models as models  # pylint: disable=g-import-not-at-top
  import testlib  # pylint: disable=g-import-not-at-top
  name, layout = case.split('-')
  result = {'case': case, 'error': None, 'share': None}
  try:
    steps, counts, warned = models._train(name, layout)  # pylint: disable=protected-access
    plain_steps, plain_counts, _ = models._train(name)  # pylint: disable=protected-access
    devices = models.LAYOUTS[layout][0]
    result['share'] = min(counts.get(f'CPU:{i}', 0) for i in range(devices)) / sum(
        plain_counts.values())
    assert not warned, warned
    for got, expected in zip(steps, plain_steps):
      testlib.assert_variables_close(got, expected)
  except Exception:  # pylint: disable=broad-except
    result['error'] = traceback.format_exc()[-3000:]
  return result


def main(argv):
  tf.compat.v1.disable_v2_behavior()
  tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  for case in argv[1:]:
    print(json.dumps(run(case)), flush=True)


if __name__ == '__main__':
  main(sys.argv)
