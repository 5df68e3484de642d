r"""Audit launcher: is this attention kernel accurate?

  python launch/audit.py --workdir=runs/audit \
      --config.kernel=package.module:function [--config=configs/audit.py:smoke]

Exits 0 when the kernel passes, 1 when it fails (report.md says why), 2 on
bad input. Kept short so that Colab and tests call the same `run`.
"""

from stableattn.experiments import audit_grid as audit
from stableattn.experiments.cli import launch

if __name__ == "__main__":
  launch(
    __file__,
    audit.run,
    config="audit.py",
    workdir="runs/audit",
    workdir_holds="config.json, metrics.jsonl, the report and headline.json",
    failed=lambda result: not result["passed"],
  )
