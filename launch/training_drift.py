r"""Training-drift experiment launcher.

  python launch/training_drift.py --workdir=runs/drift \
      [--config=configs/training_drift.py[:paper|:smoke]] \
      [--config.train.precision=fp32]

Kept short so that Colab and tests call the same `run`.
"""

import pathlib

import jax
from absl import app, flags
from ml_collections import config_flags

from stableattn import distributed
from stableattn.experiments import training_drift
from stableattn.experiments.cli import run_and_print

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / "configs"
config_flags.DEFINE_config_file(
  "config",
  str(_CONFIG_PATH / "training_drift.py"),
  "Experiment configuration file (with an optional :variant).",
)
flags.DEFINE_string(
  "workdir",
  "runs/training_drift",
  "Directory for config.json, metrics.jsonl, checkpoints and the report.",
)

flags.DEFINE_bool(
  "restart",
  False,
  "Delete the results of an earlier run in --workdir before running.",
)


def main(argv):
  del argv
  config = flags.FLAGS.config
  # A context-parallel run on a CPU: its ring's devices are simulated, and
  # the other runs keep the one real CPU device unless told otherwise.
  if distributed.simulate_cpu_devices(config.attention.context_parallel):
    if config.train.devices == 0 and jax.default_backend() == "cpu":
      config.train.devices = 1
  return run_and_print(
    training_drift.run,
    config,
    flags.FLAGS.workdir,
    restart=flags.FLAGS.restart,
  )


if __name__ == "__main__":
  app.run(main)
