r"""Benchmark launcher.

  python launch/benchmark.py --workdir=runs/benchmark \
      [--config=configs/benchmark.py[:smoke]] \
      [--config.cpu.seq_lens=512,2048]

Kept short so that Colab and tests call the same `run`.
"""

import os

# On a GPU, JAX takes 75% of device memory at start; the memory probes run
# in child processes and would find none left.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from stableattn.experiments import benchmark  # noqa: E402
from stableattn.experiments.cli import launch  # noqa: E402

if __name__ == "__main__":
  launch(
    __file__,
    benchmark.run,
    config="benchmark.py",
    workdir="runs/benchmark",
    workdir_holds="config.json, metrics.jsonl, the report and plots",
  )
