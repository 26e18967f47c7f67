"""pytest's setup for these tests: one temporary directory per test process.

Tests make Estimators in fresh temporary directories (`testlib.make_estimator`)
and TensorFlow writes its autograph files there too. Each test process sends
them to a directory of its own (`tempfile.tempdir`, and TMPDIR for the
processes it starts), removed when the process's tests end, so that runs of
the suite do not fill the machine's /tmp.

Python's garbage collector: TensorFlow's and the library's modules, imported
here once, are moved out of the collected generations (`gc.freeze`). Every
full collection otherwise walks those millions of long-lived objects again;
the tests build and drop graphs all the time, which triggers many (about 8%
of a test process's time, measured on tests/test_cross_example.py). Objects
the tests make are collected as before.

TF_CONFIG: a test that leaves it changed fails, and it is put back.

TF1 behaviour: with ESTIMATOR_TOWERS_TEST_BEHAVIOUR set to 'v1'
(`tf.compat.v1.disable_v2_behavior()`) or one of its parts ('tensorshape',
'ref_variables', 'control_flow_v1': testlib.TF1_BEHAVIOURS), that behaviour
is switched on here, before any graph is built: CI runs the core equivalence
tests (marker `core_equivalence`) a second time that way, in a process of
their own (.ci/run). The report's header names it.
"""

import gc
import os
import shutil
import tempfile

import pytest
import tensorflow as tf  # pylint: disable=unused-import

import estimator_towers  # pylint: disable=unused-import

BEHAVIOUR = os.environ.get('ESTIMATOR_TOWERS_TEST_BEHAVIOUR', '')
if BEHAVIOUR:  # process-global: before any graph is built
  import testlib  # pylint: disable=g-import-not-at-top
  if BEHAVIOUR not in testlib.TF1_BEHAVIOURS:
    raise ValueError(f'ESTIMATOR_TOWERS_TEST_BEHAVIOUR={BEHAVIOUR!r}: it must be one of '
                     f'{sorted(testlib.TF1_BEHAVIOURS)}, or unset for TF2 behaviour.')
  testlib.TF1_BEHAVIOURS[BEHAVIOUR]()

gc.collect()
gc.freeze()


def pytest_report_header(config):  # pylint: disable=unused-argument
  return f'behaviour: {BEHAVIOUR or "TF2"} (ESTIMATOR_TOWERS_TEST_BEHAVIOUR)'


@pytest.fixture(scope='session', autouse=True)
def _temporary_directory():
  path = tempfile.mkdtemp(prefix='et_tests_')
  saved_dir, saved_env = tempfile.tempdir, os.environ.get('TMPDIR')
  tempfile.tempdir = os.environ['TMPDIR'] = path
  try:
    yield path
  finally:
    tempfile.tempdir = saved_dir
    if saved_env is None:
      os.environ.pop('TMPDIR', None)
    else:
      os.environ['TMPDIR'] = saved_env
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _tf_config_left_as_it_was():
  """A TF_CONFIG a test leaves in os.environ would make every later Estimator of the
  process a task of that cluster (a worker waiting for its chief forever): it is put
  back, and the test that left it fails."""
  saved = os.environ.get('TF_CONFIG')
  yield
  left = os.environ.get('TF_CONFIG')
  if left != saved:
    if saved is None:
      os.environ.pop('TF_CONFIG', None)
    else:
      os.environ['TF_CONFIG'] = saved
    pytest.fail(f'the test left TF_CONFIG={left!r} in os.environ (it was {saved!r}); '
                f'use monkeypatch.setenv / delenv')
