r"""Drift-scaling launcher: the drift study at several sizes, and the trend.

  python launch/drift_scaling.py --workdir=runs/drift_scaling \
      [--config=smoke] [--config.scaling.sizes=w64-d2-s64,w128-d4-s64,...]

A killed run resumes: rerun the same command. The same as
`stableattn drift_scaling`.
"""

import sys

from stableattn.commands.main import run_experiment

if __name__ == "__main__":
  run_experiment("drift_scaling", sys.argv)
