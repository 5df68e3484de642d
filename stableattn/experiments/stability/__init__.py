"""Training-stability experiment: does a flash kernel make training blow up?

Wortsman et al. (arXiv 2309.14322) show that small transformers reproduce
large-scale instabilities at high learning rates (attention-logit growth,
output-logit divergence) and measure them as learning-rate sensitivity
over a sweep. Here every attention variant (Baseline, Flash under its
natural policy, Flash with every stage in BF16, a user's kernel, a policy
below 16 bits), in BF16 training and with Baseline in FP32 beside it, is
swept over one learning-rate grid, with and without the mitigations
(qk-norm, z-loss, an attention softcap, Qiu & Yao's tie fix), in
replicates. Built on the drift experiment's model, trainer, corpus and
run directory; the step is compiled once per arm (the learning rate is a
traced input).
"""

from __future__ import annotations

from stableattn.experiments.rundir import RunDir
from stableattn.experiments.stability.report import write_report
from stableattn.experiments.stability.settings import (
  Settings,
  settings_from_config,
)
from stableattn.experiments.stability.sweep import sweep

# Config fields a rerun may raise to add cells without changing any.
EXTENDABLE = ("train.replicates",)


def run(config, workdir, *, restart: bool = False) -> dict:
  """Sweeps the cells not yet in `workdir` and writes the report; returns
  the headline (per arm: LR sensitivity with its interval, largest stable
  learning rate; the verdicts)."""
  s = settings_from_config(config)
  run_dir = RunDir(workdir)
  with run_dir.lock():
    run_dir.bind_config(
      config.to_dict(), extendable=EXTENDABLE, restart=restart
    )
    done = {
      (r["arm"], r["lr"], r["replicate"])
      for r in run_dir.read_metrics()
      if r.get("kind") == "final"
    }
    sweep(s, run_dir, done)
    return write_report(s, run_dir, run_dir.read_metrics())


__all__ = ["Settings", "run", "settings_from_config"]
