"""report.md, summary.csv and plots of the training-drift experiment.

All numbers come from the rows written to metrics.jsonl.
"""

from __future__ import annotations

import numpy as np

from stableattn.drift import top_singular_share
from stableattn.experiments.forward_report import num, table
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


def model_drift(rows, pair: str, metric: str = "wasserstein"):
  """{step: value} of the whole-model drift of one pair."""
  return {
    r["step"]: r[metric]
    for r in rows
    if r.get("kind") == "drift" and r["pair"] == pair and r["scope"] == "model"
  }


def drift_ratios(
  rows, numerator: str, denominator: str, metric: str = "wasserstein"
) -> dict[int, float]:
  """{step: drift(numerator) / drift(denominator)} where both are > 0."""
  a, b = (
    model_drift(rows, numerator, metric),
    model_drift(rows, denominator, metric),
  )
  return {s: a[s] / b[s] for s in sorted(a) if s in b and a[s] > 0 and b[s] > 0}


def _ratio_phrase(ratios: dict[int, float], other: str) -> str:
  values = np.asarray(list(ratios.values()))
  median = float(np.median(values))
  low, high = float(values.min()), float(values.max())
  if median < 1:
    return f"{1 / median:.2g}x ({1 / high:.2g}-{1 / low:.2g}x) below {other}"
  return f"{median:.2g}x ({low:.2g}-{high:.2g}x) {other}"


def _attention_label(attention) -> str:
  policy = (
    attention.flash_precision
    if attention.kind == "pallas"
    else attention.baseline_precision
  )
  return f"{attention.kind} attention ({policy})"


def write_report(run_dir: RunDir, settings, rows: list[dict]) -> dict:
  headline: dict = {}
  pairs = settings.pairs
  steps = sorted({r["step"] for r in rows if r.get("kind") == "drift"})
  if not steps:
    raise ValueError(
      f"No drift rows in {run_dir.path}/metrics.jsonl: nothing to report."
    )
  final = steps[-1]

  # summary.csv: one row per pair and step, whole-model drift plus gaps.
  summary = []
  for pair in pairs:
    gaps = {
      r["step"]: r
      for r in rows
      if r.get("kind") == "pair" and r["pair"] == pair
    }
    for step in steps:
      drift = {
        m: model_drift(rows, pair, m).get(step)
        for m in ("max_abs", "wasserstein", "rel_l2")
      }
      summary.append(
        {
          "pair": pair,
          "step": step,
          **drift,
          **{
            k: gaps.get(step, {}).get(k)
            for k in ("eval_loss_gap", "logit_max_abs", "logit_rel_l2")
          },
        }
      )
  run_dir.write_csv("summary.csv", summary)

  findings = []
  if "flash_vs_baseline" in pairs:
    phrases = []
    for other in REFERENCE_PAIRS:
      if other not in pairs:
        continue
      ratios = drift_ratios(rows, "flash_vs_baseline", other)
      if not ratios:
        continue
      values = list(ratios.values())
      headline[f"flash_over_{other}_median"] = float(np.median(values))
      headline[f"flash_over_{other}_min"] = float(np.min(values))
      headline[f"flash_over_{other}_max"] = float(np.max(values))
      phrases.append(_ratio_phrase(ratios, f"the {other} pair"))
    if phrases:
      findings.append(
        "Flash-vs-Baseline Wasserstein drift of the weights is "
        + "; ".join(phrases)
        + " (median over logging steps, range in parentheses)."
      )
  slopes = {}
  for pair in pairs:
    series = {
      s: v for s, v in model_drift(rows, pair).items() if s > 0 and v > 0
    }
    if len(series) >= 2:
      slopes[pair], _ = power_law(list(series), list(series.values()))
  if slopes:
    headline["growth_slopes"] = slopes
    findings.append(
      "Growth of the Wasserstein drift with training steps (slope on "
      "log-log): "
      + ", ".join(f"{p} {v:.2f}" for p, v in slopes.items())
      + ". Summers & Dinneen argue the rate, not the final distance, is "
      "what tells the pairs apart."
    )
  if "identical_rerun" in pairs:
    rerun = model_drift(rows, "identical_rerun", "max_abs")
    if set(rerun) != set(steps):
      raise ValueError(
        f"identical_rerun has drift rows at steps {sorted(rerun)} but the "
        f"run logged {steps}: no verdict on the control from missing rows."
      )
    worst = max(rerun.values())
    headline["identical_rerun_max_abs"] = worst
    if worst == 0:
      findings.append(
        "The identical-rerun control is exactly 0 at every "
        "logging step: training is deterministic here, so "
        "every other drift is caused by its difference."
      )
    else:
      first = min(s for s, v in rerun.items() if v > 0)
      tensors = [
        r["name"]
        for r in rows
        if r.get("kind") == "drift"
        and r["pair"] == "identical_rerun"
        and r["step"] == first
        and r["scope"] == "tensor"
        and r["max_abs"] > 0
      ]
      findings.append(
        f"The identical-rerun control is NOT 0 (max {num(worst)}): "
        f"nondeterminism first shows at step {first} in {tensors[:5]}."
      )

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
      [
        r["pair"],
        num(r["max_abs"]),
        num(r["wasserstein"]),
        num(r["rel_l2"]),
        num(r["eval_loss_gap"]),
        num(r["logit_max_abs"]),
      ]
      for r in summary
      if r["step"] == final
    ],
  )

  grad_section = _grad_error_section(rows, headline)
  if "flash_fix_vs_flash" in pairs:
    fix_drift = model_drift(rows, "flash_fix_vs_flash", "max_abs")
    worst = max(fix_drift.values()) if fix_drift else 0.0
    headline["flash_fix_vs_flash_max_abs"] = worst
    findings.append(
      "Flash with Qiu & Yao's fix vs without: "
      + (
        "the weights are identical at every logging step: no tile of this "
        "run ever had exact ties at its maximum, so the fix never changed "
        "a computation."
        if worst == 0
        else f"max |Δw| {num(worst)} at the end, "
        + _ratio_phrase(
          drift_ratios(rows, "flash_fix_vs_flash", "flash_vs_baseline"),
          "the flash_vs_baseline pair",
        )
        + " (Wasserstein): the fix changed what was computed."
      )
    )

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
    f"measured every {settings.log_every} steps. Flash vs Baseline "
    + (
      "compares each kernel under its natural policy (Flash's FP32 "
      "statistics vs eager attention's stored scores)"
      if settings.compare == "natural"
      else "compares the two algorithms under one shared policy (Flash's)"
    )
    + f" (attention.compare = {settings.compare}). Runs — {runs}.",
    "",
    "## Weight drift at the final step",
    "",
    drift_table,
    "",
  ]
  parts += [f"**Finding.** {f}" for f in findings]
  parts += grad_section
  parts += ["", "## Plots", ""]
  parts += [f"![{p}]({p})" for p in plots]
  run_dir.write_text("report.md", "\n".join(parts) + "\n")
  return headline


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


def _spread(values) -> str:
  if not values:
    return "-"
  return (
    f"{num(float(np.median(values)))} "
    f"({num(float(np.min(values)))}-{num(float(np.max(values)))})"
  )


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
        _spread([r["rel_error"] for r in mine]),
        _spread(cos),
        _spread(share),
        _spread(excess),
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
    "the weights; random ones average out. Medians over layers and steps, "
    "range in parentheses:",
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
    *(f"**Finding.** {f}" for f in findings),
  ]


def _plots(run_dir, settings, rows, pairs) -> list[str]:
  names = []
  if "flash_vs_baseline" in pairs:
    series = [
      Series.from_points(
        metric,
        [
          (step, v)
          for step, v in model_drift(rows, "flash_vs_baseline", metric).items()
          if step > 0
        ],
      )
      for metric in ("max_abs", "wasserstein")
    ]
    names.append(
      line_plot(
        run_dir.path / "fig7_flash_vs_baseline.png",
        [s for s in series if s.x],
        title="Flash vs Baseline weight drift (Fig. 7)",
        xlabel="training step",
        ylabel="drift",
        logx=False,
      ).name
    )
  series = []
  for pair in pairs:
    points = [(s, v) for s, v in model_drift(rows, pair).items() if s > 0]
    if points:
      series.append(Series.from_points(pair, points))
  names.append(
    line_plot(
      run_dir.path / "fig8_all_pairs.png",
      series,
      title="Wasserstein weight drift of every pair (Fig. 8)",
      xlabel="training step",
      ylabel="Wasserstein-1 distance",
    ).name
  )
  shadow = [
    r for r in rows if r.get("kind") == "attention" and "shadow_max_abs" in r
  ]
  layers = sorted({r["layer"] for r in shadow})
  series = []
  for layer in layers:
    points = [
      (r["step"], r["shadow_max_abs"]) for r in shadow if r["layer"] == layer
    ]
    series.append(Series.from_points(f"layer {layer}", points))
  if series:
    names.append(
      line_plot(
        run_dir.path / "shadow_deviation.png",
        series,
        title="In-model |flash - baseline| per layer (shadow attention)",
        xlabel="training step",
        ylabel="max |flash - baseline|",
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
      series.append(Series.from_points(run, points))
  names.append(
    line_plot(
      run_dir.path / "loss.png",
      series,
      title="Evaluation loss",
      xlabel="training step",
      ylabel="cross-entropy",
      logx=False,
      logy=False,
    ).name
  )
  return names
