r"""Training-drift experiment launcher.

  python launch/training_drift.py --workdir=runs/drift \
      [--config=configs/training_drift.py[:paper|:smoke]] \
      [--config.train.precision=fp32]

Kept short so that Colab and tests call the same `run`.
"""

import json
import pathlib

from absl import app, flags
from ml_collections import config_flags

from stableattn.experiments import training_drift

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


def main(argv):
  del argv
  result = training_drift.run(flags.FLAGS.config, flags.FLAGS.workdir)
  print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
  app.run(main)
