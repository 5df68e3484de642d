r"""Benchmark launcher.

  python launch/benchmark.py --workdir=runs/benchmark \
      [--config=configs/benchmark.py[:smoke]] \
      [--config.cpu.seq_lens=512,2048]

Kept short so that Colab and tests call the same `run`.
"""

import os
import pathlib

# On a GPU, JAX takes 75% of device memory at start; the memory probes run
# in child processes and would find none left.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from stableattn.experiments import benchmark  # noqa: E402
from stableattn.experiments.cli import run_and_print  # noqa: E402

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
