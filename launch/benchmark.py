r"""Benchmark launcher.

  python launch/benchmark.py --workdir=runs/benchmark \
      [--config=configs/benchmark.py[:smoke]] \
      [--config.cpu.seq_lens=512,2048]

Kept short so that Colab and tests call the same `run`.
"""

import pathlib

from absl import app, flags
from ml_collections import config_flags

from stableattn.experiments import benchmark
from stableattn.experiments.cli import run_and_print

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / "configs"
config_flags.DEFINE_config_file(
  "config",
  str(_CONFIG_PATH / "benchmark.py"),
  "Experiment configuration file (with an optional :variant).",
)
flags.DEFINE_string(
  "workdir",
  "runs/benchmark",
  "Directory for config.json, metrics.jsonl, the report and plots.",
)

flags.DEFINE_bool(
  "restart",
  False,
  "Delete the results of an earlier run in --workdir before running.",
)


def main(argv):
  del argv
  return run_and_print(
    benchmark.run,
    flags.FLAGS.config,
    flags.FLAGS.workdir,
    restart=flags.FLAGS.restart,
  )


if __name__ == "__main__":
  app.run(main)
