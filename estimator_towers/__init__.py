"""estimator_towers: data-parallel training of TensorFlow Estimators on several devices."""

from estimator_towers.cluster.slurm import tf_config_from_slurm
from estimator_towers.cluster.tf_config import worker_index_and_count
from estimator_towers.inputs.global_batches import global_batches
from estimator_towers.inputs.staging import staged_input_fn
from estimator_towers.loss.loss_algebra import loss_denominator
from estimator_towers.replicate import replicate_model_fn
from estimator_towers.reporting.throughput import ThroughputHook
from estimator_towers.reporting.tower_summaries import global_mean
from estimator_towers.settings.config import make_config
from estimator_towers.settings.config import make_run_config
from estimator_towers.settings.config import session_config
from estimator_towers.settings.config import TowersConfig
from estimator_towers.settings.flags import config_from_flags
from estimator_towers.settings.flags import define_flags
from estimator_towers.settings.plan import DevicePlan
from estimator_towers.settings.plan import make_plan
from estimator_towers.towers.tower_context import current_tower
from estimator_towers.towers.tower_context import TowerContext

__all__ = [
    'DevicePlan',
    'ThroughputHook',
    'TowerContext',
    'TowersConfig',
    'config_from_flags',
    'current_tower',
    'define_flags',
    'global_batches',
    'global_mean',
    'loss_denominator',
    'make_config',
    'make_run_config',
    'session_config',
    'make_plan',
    'replicate_model_fn',
    'staged_input_fn',
    'tf_config_from_slurm',
    'worker_index_and_count',
]

__version__ = '0.1.0'
