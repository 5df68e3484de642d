r"""Training-drift experiment launcher.

  python launch/training_drift.py --workdir=runs/drift \
      [--config=paper|smoke] [--config.train.precision=fp32]

The same as `stableattn training_drift`.
"""

import sys

from stableattn.commands.main import run_experiment

if __name__ == "__main__":
  run_experiment("training_drift", sys.argv)
