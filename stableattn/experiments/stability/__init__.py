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
traced input). The Baseline arms are trained again on another machine
(`machine_twin`: one CPU instruction set down, or a GPU without
autotuning), the reference for how far Flash moves the sensitivity.
"""

from __future__ import annotations

from stableattn.experiments.stability import across_sizes
from stableattn.experiments.stability.report import write_report
from stableattn.experiments.stability.settings import (
  Settings,
  settings_from_config,
)
from stableattn.experiments.stability.sweep import sweep
from stableattn.harness import machine_twin
from stableattn.harness.rundir import RunDir, opened

# Config fields a rerun may raise to add cells without changing any.
EXTENDABLE = ("train.replicates",)


def run(config, workdir, *, restart: bool = False) -> dict:
  """Sweeps the cells not yet in `workdir` and writes the report; returns
  the headline (per arm: LR sensitivity with its interval, largest stable
  learning rate; the verdicts). With `config.sizes`, each size is such a
  sweep, and the report compares them (`across_sizes`)."""
  if str(config.get("sizes", "")).strip():
    return across_sizes.run(config, workdir, run, restart=restart)
  if (
    str(config.get("shard", "1/1")).strip() != "1/1"
    or int(config.get("workers", 1)) != 1
  ):
    raise ValueError(
      "config.shard and config.workers spread a sweep over sizes; set "
      "config.sizes (e.g. 'w64-d2,w96-d3,w128-d4') or leave them at "
      "'1/1' and 1."
    )
  s = settings_from_config(config)
  with opened(workdir, config, restart=restart, extendable=EXTENDABLE) as (
    run_dir,
    _,
  ):
    done = _done(run_dir)
    sweep(s, s.arms_here, run_dir, done)
    missing = [
      (arm, lr, r)
      for arm in s.arms_elsewhere
      for lr in s.learning_rates
      for r in range(s.replicates)
      if (arm.name, lr, r) not in done
    ]
    if missing:
      machine_twin.run_child(
        "stableattn.experiments.stability.twin",
        config.to_dict(),
        run_dir.path,
        s.machine_flags,
        s.machine,
      )
    return write_report(run_dir, s, run_dir.read_metrics())


def _done(run_dir: RunDir) -> set:
  """(arm, lr, replicate) of every cell with a final row."""
  return {
    (r["arm"], r["lr"], r["replicate"])
    for r in run_dir.read_metrics()
    if r.get("kind") == "final"
  }


__all__ = ["Settings", "run", "settings_from_config"]
