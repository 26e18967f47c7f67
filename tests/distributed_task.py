"""One task of a local TF_CONFIG cluster, for tests/test_distributed.py.

Usage: python distributed_task.py MODEL_DIR DATA.npz NUM_TOWERS  (TF_CONFIG in the environment)
"""

import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import testlib  # pylint: disable=g-import-not-at-top
from estimator_towers import replicate_model_fn  # pylint: disable=g-import-not-at-top


def main(model_dir, data_path, num_towers):
  data = np.load(data_path)
  fn = testlib.input_fn(data['x'], data['y'], 7, epochs=10)
  model_fn = testlib.v1_model_fn
  if num_towers > 1:
    model_fn = replicate_model_fn(model_fn, devices=testlib.cpu_devices(num_towers))
  config = tf.estimator.RunConfig(
      model_dir=model_dir, save_checkpoints_steps=1000,
      session_config=testlib.quiet_threads(tf.compat.v1.ConfigProto(
          device_count={'CPU': num_towers}, allow_soft_placement=True,
          inter_op_parallelism_threads=2, intra_op_parallelism_threads=1)))
  estimator = tf.estimator.Estimator(model_fn, config=config)
  tf.estimator.train_and_evaluate(
      estimator, tf.estimator.TrainSpec(fn, max_steps=3),
      tf.estimator.EvalSpec(fn, steps=1, start_delay_secs=0, throttle_secs=0))


if __name__ == '__main__':
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
