r"""Audit launcher: is this attention kernel accurate?

  python launch/audit.py --workdir=runs/audit \
      --config.kernel=package.module:function [--config=configs/audit.py:smoke]

Exits 0 when the kernel passes, 1 when it fails or raises on a case
(report.md says why; every other case is still judged), 2 on a bad config
or a kernel that cannot be imported. Prints a short summary (--json: the
headline as JSON). Kept short so that Colab and tests call the same `run`.
"""

from stableattn.experiments import audit_grid as audit
from stableattn.experiments.audit_report import summary_text
from stableattn.experiments.cli import launch

if __name__ == "__main__":
  launch(
    __file__,
    audit.run,
    config="audit.py",
    workdir="runs/audit",
    workdir_holds="config.json, metrics.jsonl, the report and headline.json",
    failed=lambda result: not result["passed"],
    summarize=summary_text,
  )
