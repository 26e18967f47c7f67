"""Several clusters' runs of tests/collective_task.py, one after another in one process per task.

Usage: python collective_scenarios_task.py TASK_TYPE PLAN.json

PLAN: a list of {"spec": a spec of collective_task.py, "tf_config": its TF_CONFIG for
TASK_TYPE, or null when TASK_TYPE has no part in that run}. Each run of the plan that
TASK_TYPE has a part in is run in turn by `collective_task.main` (its own cluster on its own
ports, so its own TensorFlow server; the previous runs' servers stay up, idle), with its
output (Python's and TensorFlow's) in <the spec's directory>/<task>0.log and its end in
<task>0.status: "0", or "1" after the traceback in the log. A run that fails does not stop
the next. Importing TensorFlow costs each process seconds of CPU: a cluster test's two
processes spent most of their CPU on it, once per run.
Not for runs that need a process of their own: TF1 behaviour (process-global), a task
that is killed or blocks.
"""

import json
import os
import sys
import traceback

import collective_task


def _run(task_type, spec_path, tf_config):
  directory = os.path.dirname(spec_path)
  os.environ['TF_CONFIG'] = json.dumps(tf_config)
  sys.stdout.flush()
  sys.stderr.flush()
  with open(os.path.join(directory, f'{task_type}0.log'), 'wb') as log:
    saved = os.dup(1), os.dup(2)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
      collective_task.main(spec_path)
      code = 0
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      code = 1
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      os.close(saved[0])
      os.close(saved[1])
  with open(os.path.join(directory, f'{task_type}0.status'), 'w') as f:
    f.write(str(code))


def main(task_type, plan_path):
  with open(plan_path) as f:
    plan = json.load(f)
  for run in plan:
    if run['tf_config'] is not None:
      _run(task_type, run['spec'], run['tf_config'])


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2])
