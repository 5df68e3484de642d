r"""Benchmark launcher.

  python launch/benchmark.py --workdir=runs/benchmark \
      [--config=smoke] [--config.cpu.seq_lens=512,2048]

The same as `stableattn benchmark`.
"""

import sys

from stableattn.commands.main import run_experiment

if __name__ == "__main__":
  run_experiment("benchmark", sys.argv)
