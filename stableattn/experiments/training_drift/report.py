"""report.md and summary.csv of the training-drift experiment.

All numbers come from the rows written to metrics.jsonl; each section is
a function of rows (and the settings that say what ran).
"""

from __future__ import annotations

import numpy as np

from stableattn.experiments.training_drift.analysis import (
  model_drift,
  ratio_summary,
  replicates_of,
  worst_max_abs,
)
from stableattn.experiments.training_drift.edges import (
  edge_section,
  monitor_section,
  stable_finding,
)
from stableattn.experiments.training_drift.pairs import with_role
from stableattn.experiments.training_drift.plots import (
  replicate_series,
  write_plots,
)
from stableattn.experiments.training_drift.ratio_report import (
  below_text,
  ratio_section,
)
from stableattn.harness import environment
from stableattn.harness.reporting import (
  finding_lines,
  num,
  spread,
  table,
)
from stableattn.harness.rundir import RunDir
from stableattn.numerics.metrics import power_law
from stableattn.ops.dispatch import IMPLEMENTATIONS
from stableattn.training.drift import top_singular_share

DRIFT_METRICS = ("max_abs", "wasserstein", "rel_l2")
GAP_METRICS = ("eval_loss_gap", "logit_max_abs", "logit_rel_l2")


def write_report(
  run_dir: RunDir, settings, rows: list[dict], env: dict | None = None
) -> dict:
  """report.md, summary.csv and the plots; returns the headline numbers.

  env: `stableattn.harness.environment.describe()` of the run (with its
  corpus digest); None: this process's, without one.
  """
  env = environment.describe() if env is None else env
  headline: dict = {
    "environment": env,
    "machine_pair": {
      "xla_flags": settings.machine_flags,
      "label": settings.machine,
    },
  }
  pairs = settings.pairs
  steps = sorted({r["step"] for r in rows if r.get("kind") == "drift"})
  if not steps:
    raise ValueError(
      f"No drift rows in {run_dir.path}/metrics.jsonl: nothing to report."
    )
  summary = summary_rows(rows, pairs, steps)
  run_dir.write_csv("summary.csv", summary)
  ratio_lines, findings = ratio_section(rows, pairs, headline)
  findings += growth_findings(rows, pairs, headline)
  for control in with_role(pairs, "control"):
    findings.append(control_finding(rows, control.name, steps, headline))
  if "flash_fix_vs_flash" in pairs:
    findings.append(fix_finding(rows, headline))
  if "stable_vs_flash" in pairs:
    findings.append(stable_finding(rows, headline))
  parts = [
    "# Training drift: does Flash attention's deviation matter?",
    "",
    environment.summary_line(env),
    "",
    what_ran(settings, len(replicates_of(rows))),
    "",
    *ratio_lines,
    *final_drift_section(summary, pairs, steps[-1]),
    *finding_lines(findings),
    *grad_error_section(rows, headline),
    "",
    *edge_section(rows, headline),
    *monitor_section(run_dir, settings, rows, headline),
    "## Plots",
    "",
  ]
  parts += [f"![{p}]({p})" for p in write_plots(run_dir, settings, rows)]
  run_dir.write_text("report.md", "\n".join(parts) + "\n")
  return headline


def summary_rows(rows, pairs, steps) -> list[dict]:
  """One row per pair, replicate and logging step (summary.csv)."""
  out = []
  for pair in pairs:
    for replicate in replicates_of(rows):
      gaps = {
        r["step"]: r
        for r in rows
        if r.get("kind") == "pair"
        and r["pair"] == pair
        and r.get("replicate", 0) == replicate
      }
      drift = {m: model_drift(rows, pair, m, replicate) for m in DRIFT_METRICS}
      out += [
        {
          "pair": pair,
          "replicate": replicate,
          "step": step,
          **{m: v.get(step) for m, v in drift.items()},
          **{k: gaps.get(step, {}).get(k) for k in GAP_METRICS},
        }
        for step in steps
      ]
  return out


def _attention_label(attention) -> str:
  if attention.kind not in IMPLEMENTATIONS + ("shadow",):
    return f"{attention.kind} attention (its own arithmetic)"
  policy = attention.options.precision.name
  if attention.context_parallel > 1:
    return (
      f"{attention.kind} ring attention ({policy}), the sequence sharded "
      f"over {attention.context_parallel} devices"
    )
  return f"{attention.kind} attention ({policy})"


def _format_label(spec) -> str:
  if not spec.fp32_classes:
    return spec.precision
  return f"{spec.precision} (FP32: {', '.join(spec.fp32_classes)})"


def what_ran(settings, replicates: int) -> str:
  runs = "; ".join(
    f"{name}: {_attention_label(spec.attention)}, {_format_label(spec)} "
    f"training, init seed {spec.init_seed}, {spec.devices} device(s)"
    for name, spec in settings.physical_runs.items()
  )
  m = settings.model
  compared = (
    "compares each kernel under its natural policy (Flash's FP32 "
    "statistics vs eager attention's stored scores)"
    if settings.compare == "natural"
    else "compares the two algorithms under one shared policy (Flash's)"
  )
  return (
    f"*What ran:* a {m.depth}-layer decoder (width {m.width}, {m.heads} "
    f"heads, sequence {settings.seq_len}, vocabulary {m.vocab_size}) "
    f"trained for {settings.optimizer.total_steps} steps, batch "
    f"{settings.batch_size}, AdamW with warmup and cosine decay; drift "
    f"measured every {settings.log_every} steps in {replicates} "
    "replicate(s), each with its own initialization and data order. "
    f"Flash vs Baseline {compared} (attention.compare = "
    f"{settings.compare}). Runs — {runs}. "
    + (
      f"The base run again in a child process with XLA_FLAGS="
      f"`{settings.machine_flags}` ({settings.machine}): the same program "
      "compiled for another machine (pair other_machine)."
      if settings.machine_flags is not None
      else f"No other-machine pair: {settings.machine}."
    )
  )


def growth_findings(rows, pairs, headline) -> list[str]:
  """Log-log slope of each pair's Wasserstein drift over steps."""
  slopes = {}
  for pair in pairs:
    series = replicate_series(rows, pair, "wasserstein", pair)
    points = [(x, y) for x, y in zip(series.x, series.y) if y > 0]
    if len(points) >= 2:
      slopes[pair], _ = power_law(*zip(*points))
  if not slopes:
    return []
  headline["growth_slopes"] = slopes
  return [
    "Growth of the Wasserstein drift with training steps (slope on "
    "log-log, replicate mean): "
    + ", ".join(f"{p} {v:.2f}" for p, v in slopes.items())
    + ". Summers & Dinneen argue the rate, not the final distance, is "
    "what tells the pairs apart."
  ]


def final_drift_section(summary, pairs, final: int) -> list[str]:
  final_rows = [r for r in summary if r["step"] == final]
  metrics = ("max_abs", "wasserstein", "rel_l2", "eval_loss_gap")
  metrics += ("logit_max_abs",)
  header = ["pair", "max abs Δw (final)", "Wasserstein (final)"]
  header += ["relative L2", "eval loss gap", "logit max abs Δ"]
  body = [
    [pair]
    + [spread([r[m] for r in final_rows if r["pair"] == pair]) for m in metrics]
    for pair in pairs
  ]
  return [
    "## Weight drift at the final step",
    "",
    "Median over replicates (range in parentheses).",
    "",
    table(header, body),
    "",
  ]


def control_finding(rows, pair: str, steps, headline) -> str:
  """A control must drift exactly 0 at every logging step."""
  worst = 0.0
  for replicate in replicates_of(rows):
    drift = model_drift(rows, pair, "max_abs", replicate)
    if set(drift) != set(steps):
      raise ValueError(
        f"{pair} replicate {replicate} has drift rows at steps "
        f"{sorted(drift)} but the run logged {steps}: no verdict on the "
        "control from missing rows."
      )
    worst = max(worst, max(drift.values()))
  headline[f"{pair}_max_abs"] = worst
  if worst == 0:
    return (
      f"The {pair.replace('_', '-')} control is exactly 0 at every logging "
      "step of every replicate: training is deterministic here, so every "
      "other drift is caused by its difference."
    )
  bad = [
    r
    for r in rows
    if r.get("kind") == "drift"
    and r["pair"] == pair
    and r["scope"] == "tensor"
    and r["max_abs"] > 0
  ]
  first = min(bad, key=lambda r: r["step"])
  tensors = [r["name"] for r in bad if r["step"] == first["step"]]
  return (
    f"The {pair.replace('_', '-')} control is NOT 0 (max {num(worst)}): "
    f"nondeterminism first shows at step {first['step']} in {tensors[:5]}."
  )


def fix_finding(rows, headline) -> str:
  """Did Qiu & Yao's fix change what the flash run computed?"""
  worst = worst_max_abs(rows, "flash_fix_vs_flash")
  headline["flash_fix_vs_flash_max_abs"] = worst
  if worst == 0:
    return (
      "Flash with Qiu & Yao's fix vs without: the weights are identical at "
      "every logging step: no tile of this run ever had exact ties at its "
      "maximum, so the fix never changed a computation."
    )
  text = f"Flash with Qiu & Yao's fix vs without: max |Δw| {num(worst)}"
  summary = ratio_summary(rows, "flash_fix_vs_flash", "flash_vs_baseline")
  if summary is not None and summary.bounded:
    text += (
      "; its Wasserstein drift over the flash_vs_baseline pair's is "
      + below_text(summary.over_replicates)
    )
  return text + ": the fix changed what was computed."


def random_top_share(shape, samples: int = 8) -> float:
  """Mean top-singular-value energy share of Gaussian matrices of a shape."""
  rng = np.random.default_rng(0)
  return float(
    np.mean(
      [top_singular_share(rng.standard_normal(shape)) for _ in range(samples)]
    )
  )


# Median cosine from which successive gradient errors count as aligned.
ALIGNED_COSINE = 0.5


def grad_error_section(rows, headline) -> list[str]:
  """Qiu & Yao's second ingredient: aligned, low-rank gradient errors."""
  errors = [r for r in rows if r.get("kind") == "grad_error"]
  if not errors:
    return []
  shapes = {tuple(r["shape"]) for r in errors}
  random_share = {shape: random_top_share(shape) for shape in shapes}
  table_rows, findings = [], []
  for run in sorted({r["run"] for r in errors}):
    mine = [r for r in errors if r["run"] == run]
    cos = [r["cos_previous"] for r in mine if r["cos_previous"] is not None]
    summed = [
      r["cos_running_sum"] for r in mine if r.get("cos_running_sum") is not None
    ]
    share = [r["top_singular_share"] for r in mine]
    excess = [
      r["top_singular_share"] / random_share[tuple(r["shape"])] for r in mine
    ]
    table_rows.append(
      [
        run,
        spread([r["rel_error"] for r in mine]),
        spread(cos),
        spread(summed),
        spread(share),
        spread(excess),
      ]
    )
    headline[f"grad_error_top_share_{run}"] = float(np.median(share))
    if not cos:
      continue
    median_cos = float(np.median(cos))
    headline[f"grad_error_cosine_{run}"] = median_cos
    findings.append(
      f"`{run}`: successive attention-gradient errors have median cosine "
      f"{median_cos:.2f} over {len(cos)} (weight, step) pairs — "
      + (
        "they point the same way from one logged step to the next"
        if median_cos >= ALIGNED_COSINE
        else "they do not keep one direction"
      )
      + f"; the top singular value carries {np.median(share):.2f} of the "
      f"error's energy, {np.median(excess):.1f}x a Gaussian matrix of the "
      "same shape"
      + (
        " (low-rank)."
        if np.median(excess) >= 2
        else " (no more low-rank than noise)."
      )
    )
  return [
    "",
    "## Attention-gradient error of the flash runs (Qiu & Yao)",
    "",
    "At each logging step: the gradient of every attention projection "
    "under the run's flash kernel minus the same gradient with FP32 "
    "attention (same parameters, the next training batch). Errors that "
    "point the same way step after step and are low-rank accumulate in "
    "the weights; random ones average out. Medians over layers, steps and "
    "replicates, range in parentheses:",
    "",
    table(
      [
        "run",
        "error norm / gradient norm",
        "cosine with previous error",
        "cosine with the sum of earlier errors",
        "top singular share",
        "share / Gaussian's",
      ],
      table_rows,
    ),
    "",
    *finding_lines(findings),
  ]
