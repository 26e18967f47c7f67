"""estimator_towers: data-parallel training of TensorFlow Estimators on several devices."""

from estimator_towers.plan import DevicePlan
from estimator_towers.plan import make_plan
from estimator_towers.towers import replicate_model_fn

__all__ = [
    'DevicePlan',
    'make_plan',
    'replicate_model_fn',
]

__version__ = '0.1.0'
