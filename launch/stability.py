r"""Training-stability experiment launcher (learning-rate sensitivity).

  python launch/stability.py --workdir=runs/stability \
      [--config=configs/stability.py[:smoke|:paper|:gpu]]

A stopped sweep resumes: rerun the same command.
"""

import pathlib

from absl import app, flags
from ml_collections import config_flags

from stableattn import distributed
from stableattn.experiments import stability
from stableattn.experiments.cli import run_and_print

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / "configs"
config_flags.DEFINE_config_file(
  "config",
  str(_CONFIG_PATH / "stability.py"),
  "Experiment configuration file (with an optional :variant).",
)
flags.DEFINE_string(
  "workdir",
  "runs/stability",
  "Directory for config.json, metrics.jsonl, the report and figures.",
)
flags.DEFINE_bool(
  "restart",
  False,
  "Delete the results of an earlier run in --workdir before running.",
)


def main(argv):
  del argv
  config = flags.FLAGS.config
  distributed.simulate_cpu_devices(int(config.context_parallel or 0))
  return run_and_print(
    stability.run,
    config,
    flags.FLAGS.workdir,
    restart=flags.FLAGS.restart,
  )


if __name__ == "__main__":
  app.run(main)
