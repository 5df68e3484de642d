"""report.md, summary.csv and plots of the training-drift experiment.

All numbers come from the rows written to metrics.jsonl.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.drift import top_singular_share
from stableattn.experiments.reporting import (
  Interval,
  band_verdict,
  finding_lines,
  mean_interval,
  num,
  spread,
  table,
)
from stableattn.experiments.rundir import RunDir
from stableattn.metrics import power_law
from stableattn.plotting import Series, line_plot

REFERENCE_PAIRS = (
  "fp16_vs_fp32",
  "bf16_vs_fp32",
  "fp16_vs_bf16",
  "different_seed",
  "one_vs_n_devices",
)
# Golden et al.: Flash-vs-Baseline weight drift is 2-5x below the drift of
# low-precision training (Wasserstein), and at or below two seeds'.
LOW_PRECISION_PAIRS = ("bf16_vs_fp32", "fp16_vs_fp32", "fp16_vs_bf16")
PAPER_BELOW = (2.0, 5.0)
RATIO_METRICS = ("wasserstein", "max_abs")


def replicates_of(rows) -> list[int]:
  """The replicate numbers with drift rows (0 for rows that name none)."""
  return sorted(
    {r.get("replicate", 0) for r in rows if r.get("kind") == "drift"}
  )


def model_drift(
  rows, pair: str, metric: str = "wasserstein", replicate: int = 0
) -> dict[int, float]:
  """{step: value} of the whole-model drift of one pair in one replicate."""
  return {
    r["step"]: r[metric]
    for r in rows
    if r.get("kind") == "drift"
    and r["pair"] == pair
    and r["scope"] == "model"
    and r.get("replicate", 0) == replicate
  }


def drift_ratios(
  rows,
  numerator: str,
  denominator: str,
  metric: str = "wasserstein",
  replicate: int = 0,
) -> dict[int, float]:
  """{step: drift(numerator) / drift(denominator)} where both are > 0."""
  a = model_drift(rows, numerator, metric, replicate)
  b = model_drift(rows, denominator, metric, replicate)
  return {s: a[s] / b[s] for s in sorted(a) if s in b and a[s] > 0 and b[s] > 0}


@dataclasses.dataclass(frozen=True)
class RatioSummary:
  """drift(numerator) / drift(denominator), geometric means.

  over_replicates: the interval of the replicates' means over logging
  steps; over_steps: the interval of the steps' means over replicates
  (successive steps are correlated, so this one is the narrower and the
  less honest of the two).
  """

  over_replicates: Interval
  over_steps: Interval

  def as_dict(self) -> dict:
    return {
      "over_replicates": self.over_replicates.as_dict(),
      "over_steps": self.over_steps.as_dict(),
    }


def ratio_summary(
  rows, numerator: str, denominator: str, metric: str = "wasserstein"
) -> RatioSummary | None:
  """The ratio of two pairs' drifts with intervals; None if never defined."""
  per_replicate = {
    r: drift_ratios(rows, numerator, denominator, metric, r)
    for r in replicates_of(rows)
  }
  per_replicate = {r: v for r, v in per_replicate.items() if v}
  if not per_replicate:
    return None
  steps = sorted({s for v in per_replicate.values() for s in v})
  by_step = [
    mean_interval(
      [v[s] for v in per_replicate.values() if s in v], geometric=True
    ).mean
    for s in steps
  ]
  return RatioSummary(
    over_replicates=mean_interval(
      [
        mean_interval(list(v.values()), geometric=True).mean
        for v in per_replicate.values()
      ],
      geometric=True,
    ),
    over_steps=mean_interval(by_step, geometric=True),
  )


def paper_verdict(summary: RatioSummary, reference: str) -> tuple[str, str]:
  """(verdict, claim) of the paper's claim about Flash vs one reference."""
  interval = summary.over_replicates
  if reference == "different_seed":
    # "At or below the drift between two initializations": ratio <= 1.
    return band_verdict(interval, 0.0, 1.0), "<= 1x"
  low, high = PAPER_BELOW
  return (
    band_verdict(interval.inverted(), low, high),
    f"{low:g}-{high:g}x below",
  )


def _below_text(interval: Interval) -> str:
  """A Flash/reference ratio with its interval, read as 'N x below' (or
  above) by its mean."""
  mean = interval.mean
  side = f"{num(1 / mean)}x below" if mean < 1 else f"{num(mean)}x above"
  return f"{interval.text('x')}, i.e. {side}"


def _replicate_series(rows, pair: str, metric: str, label: str) -> Series:
  """A pair's drift over steps: mean over replicates, std as the band."""
  points = [
    (step, v)
    for r in replicates_of(rows)
    for step, v in model_drift(rows, pair, metric, r).items()
    if step > 0
  ]
  return _over_replicates(label, points, band=True)


def _over_replicates(label: str, points, band: bool = False) -> Series:
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


def _attention_label(attention) -> str:
  policy = (
    attention.flash_precision
    if attention.kind == "pallas"
    else attention.baseline_precision
  )
  return f"{attention.kind} attention ({policy})"


def _ratio_section(rows, pairs, headline) -> tuple[list[str], list[str]]:
  """The ratio table (Flash vs each reference) and the paper's verdicts."""
  table_rows, findings = [], []
  headline["ratios"], headline["paper_verdicts"] = {}, {}
  for other in REFERENCE_PAIRS:
    if other not in pairs:
      continue
    for metric in RATIO_METRICS:
      summary = ratio_summary(rows, "flash_vs_baseline", other, metric)
      if summary is None:
        continue
      headline["ratios"].setdefault(other, {})[metric] = summary.as_dict()
      verdict, claim = ("-", "-")
      if metric == "wasserstein" and other != "one_vs_n_devices":
        verdict, claim = paper_verdict(summary, other)
        headline["paper_verdicts"][other] = verdict
        findings.append(
          f"Flash vs Baseline against `{other}` (Wasserstein): "
          f"{_below_text(summary.over_replicates)}, over replicates; the "
          f"paper's {claim} **{verdict}**."
        )
      table_rows.append(
        [
          other,
          metric,
          num(summary.over_replicates.mean),
          _interval_cell(summary.over_replicates),
          _interval_cell(summary.over_steps),
          claim,
          verdict,
        ]
      )
  if not table_rows:
    return [], []
  lines = [
    "## Flash vs Baseline against each reference pair",
    "",
    "Drift of Flash vs Baseline divided by the drift of a reference pair "
    "(below 1: Flash drifts less). Geometric means over logging steps "
    "after step 0, then over replicates; 95% Student-t intervals over "
    "replicates (each replicate its own initialization and data order) "
    "and over logging steps (correlated, so narrower). A verdict holds "
    "when the interval over replicates lies inside the paper's band, fails "
    "when it lies outside, and cannot be told apart when it straddles an "
    "edge or there is one replicate.",
    "",
    table(
      [
        "reference pair",
        "metric",
        "Flash / reference",
        "95% CI over replicates",
        "95% CI over steps",
        "paper",
        "verdict",
      ],
      table_rows,
    ),
    "",
  ]
  return lines, findings


def _interval_cell(interval: Interval) -> str:
  if interval.low is None:
    return f"- (n={interval.count})"
  return f"{num(interval.low)}-{num(interval.high)} (n={interval.count})"


def write_report(run_dir: RunDir, settings, rows: list[dict]) -> dict:
  headline: dict = {}
  pairs = settings.pairs
  steps = sorted({r["step"] for r in rows if r.get("kind") == "drift"})
  if not steps:
    raise ValueError(
      f"No drift rows in {run_dir.path}/metrics.jsonl: nothing to report."
    )
  final = steps[-1]
  replicates = replicates_of(rows)

  # summary.csv: one row per pair, replicate and step.
  summary = []
  for pair in pairs:
    for replicate in replicates:
      gaps = {
        r["step"]: r
        for r in rows
        if r.get("kind") == "pair"
        and r["pair"] == pair
        and r.get("replicate", 0) == replicate
      }
      drift = {
        m: model_drift(rows, pair, m, replicate)
        for m in ("max_abs", "wasserstein", "rel_l2")
      }
      for step in steps:
        summary.append(
          {
            "pair": pair,
            "replicate": replicate,
            "step": step,
            **{m: v.get(step) for m, v in drift.items()},
            **{
              k: gaps.get(step, {}).get(k)
              for k in ("eval_loss_gap", "logit_max_abs", "logit_rel_l2")
            },
          }
        )
  run_dir.write_csv("summary.csv", summary)

  findings = []
  ratio_lines = []
  if "flash_vs_baseline" in pairs:
    ratio_lines, ratio_findings = _ratio_section(rows, pairs, headline)
    findings += ratio_findings
  slopes = {}
  for pair in pairs:
    series = _replicate_series(rows, pair, "wasserstein", pair)
    points = [(x, y) for x, y in zip(series.x, series.y) if y > 0]
    if len(points) >= 2:
      slopes[pair], _ = power_law(*zip(*points))
  if slopes:
    headline["growth_slopes"] = slopes
    findings.append(
      "Growth of the Wasserstein drift with training steps (slope on "
      "log-log, replicate mean): "
      + ", ".join(f"{p} {v:.2f}" for p, v in slopes.items())
      + ". Summers & Dinneen argue the rate, not the final distance, is "
      "what tells the pairs apart."
    )
  if "identical_rerun" in pairs:
    findings.append(_rerun_finding(rows, steps, replicates, headline))

  final_rows = [r for r in summary if r["step"] == final]
  drift_table = table(
    [
      "pair",
      "max abs Δw (final)",
      "Wasserstein (final)",
      "relative L2",
      "eval loss gap",
      "logit max abs Δ",
    ],
    [
      [pair]
      + [
        spread([r[m] for r in final_rows if r["pair"] == pair])
        for m in (
          "max_abs",
          "wasserstein",
          "rel_l2",
          "eval_loss_gap",
          "logit_max_abs",
        )
      ]
      for pair in pairs
    ],
  )

  grad_section = _grad_error_section(rows, headline)
  if "flash_fix_vs_flash" in pairs:
    findings.append(_fix_finding(rows, replicates, headline))

  plots = _plots(run_dir, settings, rows, pairs)
  runs = "; ".join(
    f"{name}: {_attention_label(spec.attention)}, {spec.precision} "
    f"training, init seed {spec.init_seed}, {spec.devices} device(s)"
    for name, spec in settings.physical_runs.items()
  )
  m = settings.model
  parts = [
    "# Training drift: does Flash attention's deviation matter?",
    "",
    f"*What ran:* a {m.depth}-layer decoder (width {m.width}, {m.heads} "
    f"heads, sequence {settings.seq_len}, vocabulary {m.vocab_size}) "
    f"trained for {settings.optimizer.total_steps} steps, batch "
    f"{settings.batch_size}, AdamW with warmup and cosine decay; drift "
    f"measured every {settings.log_every} steps in {len(replicates)} "
    "replicate(s), each with its own initialization and data order. "
    "Flash vs Baseline "
    + (
      "compares each kernel under its natural policy (Flash's FP32 "
      "statistics vs eager attention's stored scores)"
      if settings.compare == "natural"
      else "compares the two algorithms under one shared policy (Flash's)"
    )
    + f" (attention.compare = {settings.compare}). Runs — {runs}.",
    "",
    *ratio_lines,
    "## Weight drift at the final step",
    "",
    "Median over replicates (range in parentheses).",
    "",
    drift_table,
    "",
  ]
  parts += finding_lines(findings)
  parts += grad_section
  parts += ["", "## Plots", ""]
  parts += [f"![{p}]({p})" for p in plots]
  run_dir.write_text("report.md", "\n".join(parts) + "\n")
  return headline


def _rerun_finding(rows, steps, replicates, headline) -> str:
  worst = 0.0
  for replicate in replicates:
    rerun = model_drift(rows, "identical_rerun", "max_abs", replicate)
    if set(rerun) != set(steps):
      raise ValueError(
        f"identical_rerun replicate {replicate} has drift rows at steps "
        f"{sorted(rerun)} but the run logged {steps}: no verdict on the "
        "control from missing rows."
      )
    worst = max(worst, max(rerun.values()))
  headline["identical_rerun_max_abs"] = worst
  if worst == 0:
    return (
      "The identical-rerun control is exactly 0 at every logging step of "
      "every replicate: training is deterministic here, so every other "
      "drift is caused by its difference."
    )
  bad = [
    r
    for r in rows
    if r.get("kind") == "drift"
    and r["pair"] == "identical_rerun"
    and r["scope"] == "tensor"
    and r["max_abs"] > 0
  ]
  first = min(bad, key=lambda r: r["step"])
  tensors = [r["name"] for r in bad if r["step"] == first["step"]]
  return (
    f"The identical-rerun control is NOT 0 (max {num(worst)}): "
    f"nondeterminism first shows at step {first['step']} in {tensors[:5]}."
  )


def _fix_finding(rows, replicates, headline) -> str:
  worst = max(
    (
      v
      for r in replicates
      for v in model_drift(rows, "flash_fix_vs_flash", "max_abs", r).values()
    ),
    default=0.0,
  )
  headline["flash_fix_vs_flash_max_abs"] = worst
  if worst == 0:
    return (
      "Flash with Qiu & Yao's fix vs without: the weights are identical at "
      "every logging step: no tile of this run ever had exact ties at its "
      "maximum, so the fix never changed a computation."
    )
  text = f"Flash with Qiu & Yao's fix vs without: max |Δw| {num(worst)}"
  summary = ratio_summary(rows, "flash_fix_vs_flash", "flash_vs_baseline")
  if summary is not None:
    text += (
      "; its Wasserstein drift over the flash_vs_baseline pair's is "
      + _below_text(summary.over_replicates)
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


def _grad_error_section(rows, headline) -> list[str]:
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
    share = [r["top_singular_share"] for r in mine]
    excess = [
      r["top_singular_share"] / random_share[tuple(r["shape"])] for r in mine
    ]
    table_rows.append(
      [
        run,
        spread([r["rel_error"] for r in mine]),
        spread(cos),
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
        "top singular share",
        "share / Gaussian's",
      ],
      table_rows,
    ),
    "",
    *finding_lines(findings),
  ]


def _plots(run_dir, settings, rows, pairs) -> list[str]:
  """Replicate means with a ±1 std band across replicates."""
  names = []
  count = len(replicates_of(rows))
  over = f"\nmean of {count} replicates, band ±1 std" if count > 1 else ""
  if "flash_vs_baseline" in pairs:
    series = [
      _replicate_series(rows, "flash_vs_baseline", metric, metric)
      for metric in ("max_abs", "wasserstein")
    ]
    names.append(
      line_plot(
        run_dir.path / "fig7_flash_vs_baseline.png",
        [s for s in series if s.x],
        title="Flash vs Baseline weight drift (Fig. 7)" + over,
        xlabel="training step",
        ylabel="drift",
        logx=False,
      ).name
    )
  series = [_replicate_series(rows, p, "wasserstein", p) for p in pairs]
  names.append(
    line_plot(
      run_dir.path / "fig8_all_pairs.png",
      [s for s in series if s.x],
      title="Wasserstein weight drift of every pair (Fig. 8)" + over,
      xlabel="training step",
      ylabel="Wasserstein-1 distance",
    ).name
  )
  names += _run_plots(run_dir, settings, rows)
  return names


def _run_plots(run_dir, settings, rows) -> list[str]:
  names = []
  shadow = [
    r for r in rows if r.get("kind") == "attention" and "shadow_max_abs" in r
  ]
  series = [
    _over_replicates(
      f"layer {layer}",
      [(r["step"], r["shadow_max_abs"]) for r in shadow if r["layer"] == layer],
    )
    for layer in sorted({r["layer"] for r in shadow})
  ]
  if series:
    names.append(
      line_plot(
        run_dir.path / "shadow_deviation.png",
        series,
        title="In-model |flash - baseline| per layer (shadow attention)",
        xlabel="training step",
        ylabel="max |flash - baseline|, replicate mean",
        logx=False,
      ).name
    )
  series = []
  for run in settings.physical_runs:
    points = [
      (r["step"], r["eval_loss"])
      for r in rows
      if r.get("kind") == "run" and r["run"] == run
    ]
    if points:
      series.append(_over_replicates(run, points))
  names.append(
    line_plot(
      run_dir.path / "loss.png",
      series,
      title="Evaluation loss (replicate mean)",
      xlabel="training step",
      ylabel="cross-entropy",
      logx=False,
      logy=False,
    ).name
  )
  return names
