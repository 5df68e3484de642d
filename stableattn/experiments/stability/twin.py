"""The stability sweep's Baseline arms on the other machine: the child
process `machine_twin` starts with that machine's XLA_FLAGS. It appends
its cells' rows to the parent's metrics.jsonl (the parent holds the run
directory's lock and waits)."""

from __future__ import annotations

import sys

from stableattn.experiments.stability import _done
from stableattn.experiments.stability.settings import settings_from_config
from stableattn.experiments.stability.sweep import sweep
from stableattn.harness import machine_twin
from stableattn.harness.rundir import RunDir


def main(argv) -> None:
  config, workdir, label = machine_twin.child_arguments(argv)
  s = settings_from_config(config, machine=label)
  run_dir = RunDir(workdir)
  sweep(s, s.arms_elsewhere, run_dir, _done(run_dir))


if __name__ == "__main__":
  main(sys.argv)
