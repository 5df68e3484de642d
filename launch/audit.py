r"""Audit launcher: is this attention kernel accurate?

  python launch/audit.py --workdir=runs/audit \
      --config.kernel=package.module:function [--config=smoke]

Exits 0 when the kernel passes, 1 when it fails or raises on a case
(report.md says why; every other case is still judged), 2 on a bad config
or a kernel that cannot be imported. Prints a short summary (--json: the
headline as JSON). The same as `stableattn audit`.
"""

import sys

from stableattn.commands.main import run_experiment

if __name__ == "__main__":
  run_experiment("audit", sys.argv)
