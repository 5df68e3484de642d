"""Training drift across model sizes and contexts, with a fitted trend.

Each unit (a size in one or both arms: the same tokens per parameter, or
the same optimizer steps) is a whole drift study
(`stableattn.experiments.training_drift`) in its own directory under
`<workdir>/sizes/`, so a killed sweep resumes from the last checkpoint of
the unit it was training and retrains nothing finished. From every unit's
rows, Flash vs Baseline's drift is divided by each reference pair's per
replicate, and the log ratios are fitted against log parameters, log
context and log steps (`trend.py`); the report (`report.py`) gives each
unit's ratios with intervals, the slopes with intervals, the verdicts,
and the fit's prediction at a larger size.
"""

from __future__ import annotations

from stableattn.experiments import training_drift
from stableattn.experiments.drift_scaling.report import write_report
from stableattn.experiments.drift_scaling.sizes import (
  ModelSize,
  drift_config,
  plans_of,
)
from stableattn.experiments.shards import run_units
from stableattn.experiments.training_drift.analysis import RATIO_METRICS
from stableattn.experiments.training_drift.pairs import BY_NAME, MACHINE_RUN
from stableattn.harness import environment
from stableattn.harness.config_values import as_tuple

__all__ = ["ModelSize", "run"]

SUBJECT = "flash_vs_baseline"
# A sweep may grow by sizes; each size's own study binds its own config.
EXTENDABLE = (
  "scaling.sizes",
  "scaling.fixed_steps",
  "scaling.fixed_step_sizes",
  "drift.train.stop_at_step",
)


def run(config, workdir, *, restart: bool = False) -> dict:
  """Trains this shard's units (resuming), then, once every unit is done,
  writes the report."""
  scaling = config.scaling
  mlp_ratio = int(config.drift.model.mlp_ratio)
  plans = plans_of(scaling, mlp_ratio)
  target = ModelSize.parse(scaling.predict_at, mlp_ratio)
  if scaling.metric not in RATIO_METRICS:
    raise ValueError(
      f"scaling.metric {scaling.metric!r} is not one of {RATIO_METRICS}."
    )
  drift = config.drift.copy_and_resolve_references()
  machine_note = _machine_reference(drift)
  references = _references(drift.pairs)

  def train(index, directory):
    p = plans[index]
    headline = training_drift.run(
      drift_config(drift, p, int(scaling.head_dim)), directory, restart=restart
    )
    return None if "stopped_at_step" in headline else _size_row(p)

  def report(run_dir, rows):
    return write_report(
      run_dir,
      plans,
      rows,
      references=references,
      metric=scaling.metric,
      target=target,
      target_steps=int(scaling.predict_steps),
      notes=[machine_note] if machine_note else [],
      env=environment.describe(),
    )

  return run_units(
    run,
    config,
    workdir,
    [p.name for p in plans],
    train,
    report,
    restart=restart,
    extendable=EXTENDABLE,
  )


def _references(pairs) -> list[str]:
  names = as_tuple(pairs)
  if SUBJECT not in names:
    raise ValueError(
      f"drift.pairs must include {SUBJECT!r}, the pair whose trend the "
      f"sweep measures; got {list(names)}."
    )
  unknown = [n for n in names if n not in BY_NAME]
  if unknown:
    raise ValueError(f"Unknown pairs {unknown}; valid: {list(BY_NAME)}.")
  references = [n for n in names if BY_NAME[n].role == "reference"]
  if not references:
    raise ValueError(
      "drift.pairs names no reference pair to divide Flash vs Baseline's "
      "drift by (e.g. bf16_vs_fp32, different_seed, other_machine)."
    )
  return references


def _machine_reference(drift) -> str:
  """Drops the other-machine pair where no instruction set changes the
  program here (it would drift 0), and says so in the report."""
  names = as_tuple(drift.pairs)
  if "other_machine" not in names:
    return ""
  flags, label = environment.other_machine_flags()
  if flags is not None:
    return f"`other_machine`: the base run compiled for {label}."
  drift.pairs = ",".join(n for n in names if n != "other_machine")
  return (
    f"`other_machine` left out: {label}, so the base run compiled for "
    f"another machine ({MACHINE_RUN}) would be the same program."
  )


def _size_row(p) -> dict:
  size = p.size
  return {
    "kind": "size",
    "size": p.name,
    "model": size.name,
    "arms": list(p.arms),
    "width": size.width,
    "depth": size.depth,
    "context": size.context,
    "parameters": size.parameters,
    "batch_size": p.batch_size,
    "steps": p.steps,
    "tokens": p.tokens,
    "compute": p.compute,
  }
