"""How often training meets the edges where flash kernels break, and
whether the stable preset changed what a run computed.

The edge audit (docs/audit.md) finds our kernel's BF16/FP16 backward off
the rules where a row's largest logits tie, and its FP32 backward where
logits are large. Each logging step records, per layer, the share of
rows whose two largest logits lie within one ulp of the training format
(`near_tied_share`), exact FP32 ties (`tied_max_share`) and the largest
logit; this section gives their largest values per run.
"""

from __future__ import annotations

from stableattn.auditing import monitor_verdict, thresholds
from stableattn.experiments.monitor_report import verdict_section
from stableattn.experiments.training_drift.analysis import (
  ratio_summary,
  worst_max_abs,
)
from stableattn.experiments.training_drift.ratio_report import below_text
from stableattn.harness.reporting import num, table

# Monitor statistics (`stableattn.numerics.monitor.attention_statistics`):
# name -> (column, the extreme that places a run: max or min).
EDGE_STATS = {
  "near_tied_share": ("near-tied share", max),
  "tied_max_share": ("tied share", max),
  "max_logit": ("max logit", max),
  "min_row_lse": ("min row LSE", min),
  "fp16_underflow_share": ("FP16-underflow share", max),
  "q_outlier_ratio": ("q outlier ratio", max),
  "k_outlier_ratio": ("k outlier ratio", max),
}


def edge_stats(rows) -> dict[str, dict[str, float]]:
  """{run: {statistic: its extreme over replicates, steps and layers}},
  for the statistics the run logged (older runs lack the later ones)."""
  found: dict[str, dict[str, float]] = {}
  for r in rows:
    if r.get("kind") != "attention" or "near_tied_share" not in r:
      continue
    run = found.setdefault(r["run"], {})
    for stat, (_, extreme) in EDGE_STATS.items():
      if stat in r:
        value = float(r[stat])
        run[stat] = value if stat not in run else extreme(run[stat], value)
  return found


def edge_section(rows, headline) -> list[str]:
  """The edge statistics per run, as a table (none if no run logged
  them)."""
  stats = edge_stats(rows)
  if not stats:
    return []
  headline["edges"] = stats
  logged = [s for s in EDGE_STATS if any(s in run for run in stats.values())]
  body = [
    [run, *(num(values.get(stat)) for stat in logged)]
    for run, values in sorted(stats.items())
  ]
  return [
    "## Edges in training",
    "",
    "Largest over replicates, logging steps and layers (evaluation batch, "
    "causal rows with two keys or more): the share of rows whose two "
    "largest logits lie within one ulp of the training format, where our "
    "BF16/FP16 flash backward misses the rules (docs/audit.md), the share "
    "with exact FP32 ties, and the largest logit (FP32 backward misses "
    "from standard deviation 100), and the smallest row log-sum-exp, the "
    "share of attended probabilities below FP16's smallest normal and the "
    "largest q and k channels over their median channel (smallest LSE, "
    "largest of the others).",
    "",
    table(["run", *(EDGE_STATS[s][0] for s in logged)], body),
    "",
    *regime_verdicts(rows),
  ]


def regime_verdicts(rows, data=None) -> list[str]:
  """Per run, where its largest logit was reached (layer, step) and which
  calibrated kernels (`stableattn.auditing.thresholds`, measured on drawn
  inputs at the largest logit) miss a rule at or below it."""
  data = thresholds.load() if data is None else data
  peaks: dict = {}
  for r in rows:
    if r.get("kind") == "attention" and "max_logit" in r:
      best = peaks.get(r["run"])
      if best is None or r["max_logit"] > best["max_logit"]:
        peaks[r["run"]] = r
  if not peaks or not data:
    return []
  lines = []
  for run, r in sorted(peaks.items()):
    missing = thresholds.kernels_missing_at(r["max_logit"], data)
    verdict = (
      "calibrated kernels that miss a rule there: " + ", ".join(missing)
      if missing
      else "no calibrated kernel misses a rule there"
    )
    lines.append(
      f"- {run}: largest logit {num(r['max_logit'])} (layer {r['layer']}, "
      f"step {r['step']}); {verdict} (`{data['command']}`; where one "
      "misses, its stable preset, QK-norm or a softcap lowers the logits "
      "or the error: not measured in this run)."
    )
  return lines + [""]


def monitor_section(run_dir, settings, rows, headline) -> list:
  """Per run, the monitor's verdict from its per-head statistics
  (`stableattn.experiments.monitor_report.verdict_section`), with the
  stable preset marked measured where this run's pairs hold it."""
  runs = sorted({r["run"] for r in rows if "max_logit_per_head" in r})
  records = {run: monitor_verdict.head_records(rows, run) for run in runs}
  measured = {}
  if "stable_vs_baseline" in settings.pairs:
    measured["stable preset"] = (
      "measured in this run: pair stable_vs_baseline, above"
    )
  kernels = {
    run: thresholds.calibration_name(spec.attention)
    for run, spec in settings.runs.items()
  }
  lines, entered = verdict_section(
    records, run_dir.path, measured, kernels=kernels
  )
  headline["monitor_runs_entered"] = entered
  return lines


def stable_finding(rows, headline) -> str:
  """Did the stable preset change what the flash run computed, and by how
  much against Flash vs Baseline?"""
  worst = worst_max_abs(rows, "stable_vs_flash")
  headline["stable_vs_flash_max_abs"] = worst
  if worst == 0:
    return (
      "Flash under its stable preset vs Flash: the weights are identical "
      "at every logging step, so the fixes never changed a computation."
    )
  text = f"Flash under its stable preset vs Flash: max |Δw| {num(worst)}"
  for pair in ("stable_vs_flash", "stable_vs_baseline"):
    summary = ratio_summary(rows, pair, "flash_vs_baseline")
    if summary is not None and summary.bounded:
      text += (
        f"; {pair}'s Wasserstein drift over flash_vs_baseline's is "
        + below_text(summary.over_replicates)
      )
  return text + "."
