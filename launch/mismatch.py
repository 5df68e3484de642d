r"""Training-inference mismatch experiment launcher.

  python launch/mismatch.py --workdir=runs/mismatch \
      [--config=configs/mismatch.py[:smoke|:paper|:gpu]]

A stopped run resumes: rerun the same command.
"""

import pathlib

from absl import app, flags
from ml_collections import config_flags

from stableattn.experiments import mismatch
from stableattn.experiments.cli import run_and_print

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / "configs"
config_flags.DEFINE_config_file(
  "config",
  str(_CONFIG_PATH / "mismatch.py"),
  "Experiment configuration file (with an optional :variant).",
)
flags.DEFINE_string(
  "workdir",
  "runs/mismatch",
  "Directory for config.json, metrics.jsonl, the report and figures.",
)
flags.DEFINE_bool(
  "restart",
  False,
  "Delete the results of an earlier run in --workdir before running.",
)


def main(argv):
  del argv
  return run_and_print(
    mismatch.run,
    flags.FLAGS.config,
    flags.FLAGS.workdir,
    restart=flags.FLAGS.restart,
  )


if __name__ == "__main__":
  app.run(main)
