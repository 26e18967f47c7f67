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

xdist's `--dist loadfile` (README's command): the files go to the two test processes
heaviest first (`FILE_SECONDS`, each file's time in a run of the suite; a file not listed
weighs a second a test), not by their number of tests, which xdist's own order follows: it
leaves the few-test files that run clusters or whole programs (SimCLR's upstream model, the
docs' programs) for the end, where one process may run them while the other has nothing
left. Which process runs a file, and so which tests share a process, is all that changes.

TensorFlow's CPU kernels: Eigen's, not oneDNN's (TF_ENABLE_ONEDNN_OPTS=0, unless the
environment sets it; set before TensorFlow is imported, and inherited by the processes the
tests start). TensorFlow turns oneDNN on by itself on x86 CPUs with AVX-512 VNNI and newer,
so without this the kernels, and with them the last bits of a result, would depend on the
machine the suite runs on. The suite's bit-for-bit checks (the fixed shard grid across
workers) and the self-test's rounding floor were made on Eigen's kernels; with oneDNN's
the grid's batch-norm model across two workers differs from one device in the last bit
(docs/limits.md). CI runs the core equivalence tests again with oneDNN on (.ci/run).
oneDNN off is also a tenth quicker here: fewer first-call kernel set-ups.

TF1 behaviour: with ESTIMATOR_TOWERS_TEST_BEHAVIOUR set to 'v1'
(`tf.compat.v1.disable_v2_behavior()`) or one of its parts ('tensorshape',
'ref_variables', 'control_flow_v1': testlib.TF1_BEHAVIOURS), that behaviour
is switched on here, before any graph is built: CI runs the core equivalence
tests (marker `core_equivalence`) a second time that way, in a process of
their own (.ci/run). The report's header names it.
"""

import collections
import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')  # before TensorFlow is imported

import tensorflow as tf  # pylint: disable=unused-import,g-import-not-at-top,wrong-import-position

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
  onednn = 'off' if os.environ['TF_ENABLE_ONEDNN_OPTS'] in ('0', 'false', 'False') else 'on'
  return (f'behaviour: {BEHAVIOUR or "TF2"} (ESTIMATOR_TOWERS_TEST_BEHAVIOUR); oneDNN CPU '
          f'kernels: {onednn} (TF_ENABLE_ONEDNN_OPTS)')


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


# The modules whose tests read Estimator's step summaries or step logs (event files,
# examples/sec, the logged loss): they keep Estimator's defaults.
STEP_SUMMARIES_READ = frozenset({
    'test_collective_position.py', 'test_device_report.py', 'test_example.py',
    'test_example_resume.py', 'test_hook_values.py', 'test_hook_values_cluster.py',
    'test_logging.py', 'test_lost_task.py', 'test_tower_summaries.py',
})


@pytest.fixture(scope='module', autouse=True)
def no_step_summaries(request):
  """`testlib.run_config` (so `make_estimator`, `stepwise_estimator`) without Estimator's
  step summaries and step logging: `save_summary_steps` and `log_step_count_steps` None
  unless a call gives them, in every module but those of `STEP_SUMMARIES_READ`. None of
  the others reads them, and they cost each train() call a tenth of its time: the first
  step of a call fetches the summaries as well, so the session makes and optimises a
  second executor of the towered step. (What a model_fn's own summaries and hooks see
  stays tested by the modules that read them.)"""
  import testlib  # pylint: disable=g-import-not-at-top
  if os.path.basename(str(request.fspath)) in STEP_SUMMARIES_READ:
    yield
    return
  run_config = testlib.run_config

  def quiet_run_config(num_cpus=1, **kwargs):
    kwargs.setdefault('save_summary_steps', None)
    kwargs.setdefault('log_step_count_steps', None)
    return run_config(num_cpus, **kwargs)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(testlib, 'run_config', quiet_run_config)
    yield


# Seconds each test file took in a run of the suite (README's command, 2 processes on 2
# cores, an otherwise idle machine); only the order they give matters. Files under 10 s
# are left out: a second a test.
FILE_SECONDS = {
    'test_collective.py': 223, 'test_loop_models.py': 209, 'test_loss_algebra.py': 141,
    'test_cross_example.py': 104, 'test_simclr_upstream.py': 95, 'test_real_world.py': 73,
    'test_sync_batch_norm.py': 72, 'test_faults.py': 70, 'test_fixed_grid_cluster.py': 70,
    'test_tf1_behaviour.py': 68, 'test_fixed_grid.py': 67, 'test_loop_draws.py': 65,
    'test_collective_position.py': 60, 'test_micro_batches.py': 53, 'test_example.py': 53,
    'test_sparse_features.py': 52, 'test_transformers.py': 49, 'test_recovery.py': 48,
    'test_lost_worker.py': 48, 'test_canned.py': 48, 'test_equivalence.py': 46,
    'test_step_order.py': 46, 'test_bert.py': 45, 'test_input_structures.py': 42,
    'test_loop_frames.py': 40, 'test_padded_transformer.py': 39,
    'test_attention_styles.py': 37, 'test_random_draws.py': 35,
    'test_selftest_own_model.py': 33, 'test_staging.py': 32, 'test_towers.py': 32,
    'test_input_position.py': 29, 'test_simclr_batch_norm.py': 27, 'test_warm_start.py': 26,
    'test_selftest.py': 26, 'test_properties.py': 25, 'test_placement.py': 24,
    'test_sparse_canned.py': 24, 'test_docs_resuming.py': 23, 'test_streams.py': 22,
    'test_tower_copies.py': 20, 'test_optimizers.py': 18, 'test_example_resume.py': 17,
    'test_docs_clusters.py': 17, 'test_docs_bert.py': 17, 'test_batch_mixing.py': 17,
    'test_static_batch.py': 17, 'test_batch_reductions.py': 16,
    'test_batch_norm_default.py': 16, 'test_random_restart.py': 14, 'test_build.py': 14,
    'test_logging.py': 14, 'test_several_losses.py': 13,
}


class _HeaviestFileFirst(collections.OrderedDict):
  """xdist's queue of files (file -> its tests), handed out heaviest first."""

  def popitem(self, last=True):
    if last or not self:
      return super().popitem(last)
    heaviest = max(self, key=lambda f: FILE_SECONDS.get(os.path.basename(f), len(self[f])))
    return heaviest, self.pop(heaviest)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` with `_HeaviestFileFirst`; any other mode is xdist's own."""
  if config.getvalue('dist') != 'loadfile':
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  class HeaviestFileFirst(LoadFileScheduling):

    def __init__(self, config, log=None):
      super().__init__(config, log)
      self.workqueue = _HeaviestFileFirst()

  return HeaviestFileFirst(config, log)
