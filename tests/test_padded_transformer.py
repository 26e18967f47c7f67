"""A padded Transformer whose FFN removes padding trains on every tower and in micro-batches.

The official r1 Transformer's FFN (`allow_pad=True`) gathers each example's
non-pad tokens (`tf.where` of the flat mask, `gather_nd`), lifts them to
[1, n, H] for two Dense layers and scatters them back (`scatter_nd`): every
token stays its example's, so the towered model is data-parallel (each
device holds the plain model's heavy ops, no warning) and trains equal to
the plain model_fn on 3 towers, in micro-batches and on 2 devices x 2
micro-batches (`transformer_model`).
"""

import functools

import pytest
import tensorflow as tf

import estimator_towers as et
import heavy_ops
import testlib
import transformer_model as tm

_DATA = tm.data(12)
# One device's micro-batches: 3 of 4 examples (2 of 6 split the batch as evenly and proved
# nothing more; 2 micro-batches per device: the 2 x 2 layout).
_LAYOUTS = {
    '3_towers': dict(devices=testlib.cpu_devices(3)),
    'micro_batches_3': dict(devices=testlib.cpu_devices(1), micro_batches=3),
    '2_devices_x_2_micro_batches': dict(devices=testlib.cpu_devices(2), micro_batches=2),
}
# (labels a Tensor, the optimizer): the dict features with Momentum, the targets as labels
# with Adam.
_VARIANTS = {'dict_momentum': (False, 'momentum'), 'labels_adam': (True, 'adam')}


def _train(model_fn, num_cpus: int, labels_variant: bool, optimizer: str, steps: int = 2,
           center: bool = False):
  """The variables (with the optimizer's slots) after `steps` steps on the 12 examples."""
  estimator = testlib.make_estimator(model_fn, num_cpus=num_cpus,
                                     params={'optimizer': optimizer, 'center': center})
  estimator.train(tm.input_fn(_DATA, 12, labels_variant), steps=steps)
  return testlib.variables(estimator)


@functools.lru_cache(maxsize=None)
def _plain(variant: str) -> dict:
  labels_variant, optimizer = _VARIANTS[variant]
  return _train(tm.model_fn, 1, labels_variant, optimizer)


def test_three_towers_hold_the_plain_models_heavy_ops_without_warning(monkeypatch):
  warnings = testlib.logged_warnings(monkeypatch)
  params = {'optimizer': 'momentum'}
  towered = heavy_ops.train_graph(
      et.replicate_model_fn(tm.model_fn, devices=testlib.cpu_devices(3)), _DATA, None, params)
  plain = heavy_ops.train_graph(tm.model_fn, _DATA, None, params)
  assert not warnings, warnings
  share = heavy_ops.least_share(towered, plain, 3)
  assert share >= 0.9, (share, heavy_ops.per_device(towered), heavy_ops.total(plain))


@pytest.mark.parametrize('variant', sorted(_VARIANTS))
@pytest.mark.parametrize('layout', sorted(_LAYOUTS))
def test_trains_equal_to_plain(layout, variant, monkeypatch):
  warnings = testlib.logged_warnings(monkeypatch)
  labels_variant, optimizer = _VARIANTS[variant]
  plan = _LAYOUTS[layout]
  towered = et.replicate_model_fn(tm.model_fn, **plan)
  got = _train(towered, len(plan['devices']), labels_variant, optimizer)
  assert not [w for w in warnings if 'estimator_towers' in w], warnings
  expected = _plain(variant)
  slots = [n for n in expected if 'Momentum' in n or 'Adam' in n]
  assert slots, sorted(expected)   # the optimizer's slots are compared too
  testlib.assert_variables_close(got, expected)


def test_a_mixing_op_inside_the_ffn_trains_equal_to_plain_on_its_head(monkeypatch):
  """The tokens centred by their batch mean: the head on the whole batch scatters them back
  to the positions of the whole batch's mask (never to the shards' own positions); exact,
  and the library says the head runs once."""
  warnings = testlib.logged_warnings(monkeypatch)
  towered = et.replicate_model_fn(tm.model_fn, devices=testlib.cpu_devices(3))
  got = _train(towered, 3, False, 'momentum', center=True)
  once = [w for w in warnings if 'runs once, on the whole batch' in w]   # exact, but serial
  assert len(once) == 1 and 'ffn/remove_padding/sub' in once[0], warnings
  assert not [w for w in warnings if w not in once], warnings
  testlib.assert_variables_close(got, _train(tm.model_fn, 1, False, 'momentum', center=True))
