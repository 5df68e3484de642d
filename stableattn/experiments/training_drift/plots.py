"""The drift experiment's figures: the paper's Figs. 7 and 8, the in-model
deviation and the loss curves, each a replicate mean with a ±1 std band."""

from __future__ import annotations

import numpy as np

from stableattn.experiments.training_drift.analysis import (
  model_drift,
  replicates_of,
)
from stableattn.experiments.training_drift.pairs import with_role
from stableattn.harness.plotting import Series, line_plot


def replicate_series(rows, pair: str, metric: str, label: str) -> Series:
  """A pair's drift over steps: mean over replicates, std as the band."""
  points = [
    (step, v)
    for r in replicates_of(rows)
    for step, v in model_drift(rows, pair, metric, r).items()
    if step > 0
  ]
  return over_replicates(label, points, band=True)


def over_replicates(label: str, points, band: bool = False) -> Series:
  """A series of (step, value) points from every replicate: the mean at
  each step, and with `band` the std across replicates where there are
  several."""
  by_step: dict = {}
  for step, value in points:
    by_step.setdefault(step, []).append(value)
  steps = sorted(by_step)
  series = Series(label, steps, [float(np.mean(by_step[s])) for s in steps])
  if band and any(len(v) > 1 for v in by_step.values()):
    series.y_err = [float(np.std(by_step[s])) for s in steps]
  return series


def write_plots(run_dir, settings, rows) -> list[str]:
  """The PNG names, in the order the report shows them."""
  count = len(replicates_of(rows))
  over = f"\nmean of {count} replicates, band ±1 std" if count > 1 else ""
  names = [
    _fig7(run_dir, rows, subject.name, over)
    for subject in with_role(settings.pairs, "subject")
  ]
  series = [replicate_series(rows, p, "wasserstein", p) for p in settings.pairs]
  names.append(
    line_plot(
      run_dir.path / "fig8_all_pairs.png",
      [s for s in series if s.x],
      title="Wasserstein weight drift of every pair (Fig. 8)" + over,
      xlabel="training step",
      ylabel="Wasserstein-1 distance",
    ).name
  )
  return (
    names + _shadow_plot(run_dir, rows) + [_loss_plot(run_dir, settings, rows)]
  )


def _fig7(run_dir, rows, subject: str, over: str) -> str:
  series = [
    replicate_series(rows, subject, metric, metric)
    for metric in ("max_abs", "wasserstein")
  ]
  title = (
    "Flash vs Baseline weight drift (Fig. 7)"
    if subject == "flash_vs_baseline"
    else f"{subject} weight drift (as Fig. 7)"
  )
  return line_plot(
    run_dir.path / f"fig7_{subject}.png",
    [s for s in series if s.x],
    title=title + over,
    xlabel="training step",
    ylabel="drift",
    logx=False,
  ).name


def _shadow_plot(run_dir, rows) -> list[str]:
  shadow = [
    r for r in rows if r.get("kind") == "attention" and "shadow_max_abs" in r
  ]
  series = [
    over_replicates(
      f"layer {layer}",
      [(r["step"], r["shadow_max_abs"]) for r in shadow if r["layer"] == layer],
    )
    for layer in sorted({r["layer"] for r in shadow})
  ]
  if not series:
    return []
  return [
    line_plot(
      run_dir.path / "shadow_deviation.png",
      series,
      title="In-model |flash - baseline| per layer (shadow attention)",
      xlabel="training step",
      ylabel="max |flash - baseline|, replicate mean",
      logx=False,
    ).name
  ]


def _loss_plot(run_dir, settings, rows) -> str:
  series = []
  for run in settings.physical_runs:
    points = [
      (r["step"], r["eval_loss"])
      for r in rows
      if r.get("kind") == "run" and r["run"] == run
    ]
    if points:
      series.append(over_replicates(run, points))
  return line_plot(
    run_dir.path / "loss.png",
    series,
    title="Evaluation loss (replicate mean)",
    xlabel="training step",
    ylabel="cross-entropy",
    logx=False,
    logy=False,
  ).name
