r"""Training-inference mismatch experiment launcher.

  python launch/mismatch.py --workdir=runs/mismatch \
      [--config=configs/mismatch.py[:smoke|:paper|:gpu]]

A stopped run resumes: rerun the same command.
"""

from stableattn.experiments import mismatch
from stableattn.experiments.cli import launch

if __name__ == "__main__":
  launch(
    __file__,
    mismatch.run,
    config="mismatch.py",
    workdir="runs/mismatch",
    workdir_holds="config.json, metrics.jsonl, the report and figures",
  )
