r"""Drift-scaling launcher: the drift study at several sizes, and the trend.

  python launch/drift_scaling.py --workdir=runs/drift_scaling \
      [--config=configs/drift_scaling.py[:smoke]] \
      [--config.scaling.sizes=w64-d2-s64,w128-d4-s64,...]

A killed run resumes: rerun the same command.
"""

from stableattn.experiments import drift_scaling
from stableattn.experiments.cli import launch

if __name__ == "__main__":
  launch(
    __file__,
    drift_scaling.run,
    config="drift_scaling.py",
    workdir="runs/drift_scaling",
    workdir_holds="config.json, metrics.jsonl, sizes/ and the report",
  )
