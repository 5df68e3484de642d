r"""Audit launcher: is this attention kernel accurate?

  python launch/audit.py --workdir=runs/audit \
      --config.kernel=package.module:function [--config=configs/audit.py:smoke]

Exits 0 when the kernel passes, 1 when it fails (report.md says why), 2 on
bad input. Kept short so that Colab and tests call the same `run`.
"""

import pathlib

from absl import app, flags
from ml_collections import config_flags

from stableattn.experiments import audit
from stableattn.experiments.cli import run_and_print

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / "configs"
config_flags.DEFINE_config_file(
  "config",
  str(_CONFIG_PATH / "audit.py"),
  "Experiment configuration file (with an optional :variant).",
)
flags.DEFINE_string(
  "workdir",
  "runs/audit",
  "Directory for config.json, metrics.jsonl, the report and headline.json.",
)
flags.DEFINE_bool(
  "restart",
  False,
  "Delete the results of an earlier run in --workdir before running.",
)


def main(argv):
  del argv
  return run_and_print(
    audit.run,
    flags.FLAGS.config,
    flags.FLAGS.workdir,
    restart=flags.FLAGS.restart,
    failed=lambda result: not result["passed"],
  )


if __name__ == "__main__":
  app.run(main)
