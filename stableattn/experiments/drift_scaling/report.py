"""report.md, headline.json and the figure of the drift-scaling sweep.

Every number comes from the size studies' rows (their metrics.jsonl):
Flash vs Baseline's drift over each reference's, one geometric mean over
logging steps per replicate, then the intervals and the fit.
"""

from __future__ import annotations

import json

from stableattn.experiments.drift_scaling.plots import write_figure
from stableattn.experiments.drift_scaling.trend import AXES, MIN_DISTINCT, fit
from stableattn.experiments.training_drift.analysis import (
  replicate_ratios,
  unbounded_replicates,
)
from stableattn.harness import environment
from stableattn.harness.reporting import (
  finding_lines,
  mean_interval,
  num,
  table,
)
from stableattn.harness.rundir import RunDir

SUBJECT = "flash_vs_baseline"
RESOLVES = 1.5  # an interval resolves 1.5x when high/mean and mean/low <= it


def ratio_rows(size_row: dict, rows, references, metric) -> list[dict]:
  """One row per replicate per reference at one size; a reference
  identical in some replicates gives one 'unbounded' row instead."""
  out = []
  keys = ("size", "parameters", "context", "compute", "steps", "arms")
  tag = {k: size_row[k] for k in keys if k in size_row}
  for reference in references:
    unbounded = unbounded_replicates(rows, SUBJECT, reference, metric)
    if unbounded:
      out.append(
        {"kind": "unbounded", **tag, "reference": reference,
         "replicates": unbounded}
      )  # fmt: skip
      continue
    for replicate, ratio in replicate_ratios(
      rows, SUBJECT, reference, metric
    ).items():
      out.append(
        {"kind": "ratio", **tag, "reference": reference,
         "replicate": replicate, "ratio": ratio}
      )  # fmt: skip
  return out


def write_report(
  run_dir: RunDir,
  plans,
  size_rows,
  *,
  references,
  metric,
  target,
  target_steps,
  notes,
  env,
) -> dict:
  """The sweep's report from the size studies' rows; returns its headline."""
  rows = list(size_rows)
  for p, size_row in zip(plans, size_rows):
    study = RunDir(run_dir.path / "sizes" / p.name).read_metrics()
    # The plan names the unit's arms (a unit from before the fixed-step
    # arm recorded none).
    tagged = {**size_row, "arms": list(p.arms)}
    rows += ratio_rows(tagged, study, references, metric)
  run_dir.rewrite_metrics(rows)
  ratios = [r for r in rows if r["kind"] == "ratio"]
  trends = {
    ref: fit([r for r in ratios if r["reference"] == ref]) for ref in references
  }
  by_arm = _arm_trends(ratios, references, plans)
  target = (target, target_steps)
  per_size = _per_size(rows, size_rows, references)
  headline = {
    "workdir": str(run_dir.path),
    "metric": metric,
    "sizes": size_rows,
    "ratios": per_size,
    "trends": {
      ref: None
      if t is None
      else {**t.as_dict(), "prediction": _predict(t, target)}
      for ref, t in trends.items()
    },
    "arm_trends": {
      arm: {ref: None if t is None else t.as_dict() for ref, t in fits.items()}
      for arm, fits in by_arm.items()
    },
    "prediction_at": {"size": target[0].name, "steps": target_steps},
    "environment": env,
  }
  figure = write_figure(
    run_dir.path / "drift_scaling.png", ratios, trends, per_size
  )
  text = _report(
    plans, size_rows, per_size, (trends, by_arm), target, notes, metric
  )
  text += [
    "",
    f"![ratio against size, context and steps]({figure.name})",
    "",
    environment.summary_line(env),
  ]
  run_dir.write_text("report.md", "\n".join(text) + "\n")
  run_dir.write_text(
    "headline.json", json.dumps(headline, indent=2, default=str) + "\n"
  )
  return headline


def _per_size(rows, size_rows, references) -> dict:
  """{size: {reference: interval dict or {'unbounded_replicates'}}}."""
  out = {}
  for size_row in size_rows:
    name = size_row["size"]
    cell = out.setdefault(name, {})
    for ref in references:
      mine = [
        r for r in rows if r.get("size") == name and r.get("reference") == ref
      ]
      unbounded = [r for r in mine if r["kind"] == "unbounded"]
      if unbounded:
        cell[ref] = {"unbounded_replicates": unbounded[0]["replicates"]}
      elif mine:
        cell[ref] = mean_interval(
          [r["ratio"] for r in mine], geometric=True
        ).as_dict()
  return out


def _arm_trends(ratios, references, plans) -> dict:
  """Each arm's own fit, where the sweep has two arms: {arm: {ref: fit}}
  (in one arm, steps either moves with parameters or is held)."""
  arms = list(dict.fromkeys(a for p in plans for a in p.arms))
  if len(arms) < 2:
    return {}
  return {
    arm: {
      ref: fit(
        [r for r in ratios if r["reference"] == ref and arm in r["arms"]]
      )
      for ref in references
    }
    for arm in arms
  }


def _predict(trend, target) -> dict | None:
  """The fitted ratio at (size, steps): steps enters where it was fitted;
  else the prediction follows the tokens-per-parameter arm."""
  size, steps = target
  if len(trend.slopes) < 2:
    return None  # an axis not fitted would be extrapolated blind
  mean, low, high = trend.at(
    parameters=size.parameters, context=size.context, steps=steps
  )
  return {"mean": mean, "low": low, "high": high}


def _cell(interval: dict) -> str:
  if "unbounded_replicates" in interval:
    identical = len(interval["unbounded_replicates"])
    return f"unbounded: the reference is identical in {identical} replicates"
  if interval["low"] is None:
    return f"{num(interval['mean'])}x (n=1)"
  resolved = (
    max(interval["high"] / interval["mean"], interval["mean"] / interval["low"])
    <= RESOLVES
  )
  return (
    f"{num(interval['mean'])}x [{num(interval['low'])}, "
    f"{num(interval['high'])}]" + ("" if resolved else " (wider than 1.5x)")
  )


def _report(plans, size_rows, per_size, fits, target, notes, metric):
  trends, by_arm = fits
  lines = [
    "# Training drift across sizes: Flash vs Baseline against references",
    "",
    "Each unit is a drift study of its own (`sizes/<unit>/report.md`), "
    "trained in the same tokens per step. The tokens-per-parameter arm "
    "trains every size the same tokens per non-embedding parameter (a "
    "larger model takes more steps); the fixed-step arm, where there is "
    "one, trains its sizes the same steps. A ratio is Flash vs Baseline's "
    f"drift over the reference pair's ({metric}), the geometric mean over "
    "logging steps after step 0 in each replicate, then over replicates "
    "with a 95% Student-t interval.",
    "",
  ]
  lines += [f"- {n}" for n in notes] + ([""] if notes else [])
  header = ["unit", "arms", "parameters", "context", "batch x steps",
            "tokens", "training FLOPs", "seconds"]  # fmt: skip
  lines += [
    "## Units",
    "",
    table(
      header,
      [
        [
          r["size"],
          ", ".join(r.get("arms", ["tokens_per_parameter"])),
          num(r["parameters"]),
          r["context"],
          f"{r['batch_size']} x {r['steps']}",
          num(r["tokens"]),
          f"{r['compute']:.3g}",
          r["seconds"],
        ]
        for r in size_rows
      ],  # fmt: skip
    ),
    "",
    "## Flash vs Baseline over each reference, per unit",
    "",
  ]
  references = list(trends)
  lines += [
    table(
      ["unit"] + references,
      [
        [name]
        + [_cell(cells[ref]) if ref in cells else "-" for ref in references]
        for name, cells in per_size.items()
      ],
    ),
    "",
    "## The trend",
    "",
    "log10(ratio) = a + b log10(parameters) + c log10(context) + "
    "d log10(steps), least squares over one value per replicate per unit; "
    "95% intervals. Each slope holds the other axes: b is the slope with "
    "parameters at fixed steps and context, d with steps at fixed size. "
    "The ratio changes 10^b-fold per 10x parameters. An axis the others "
    "explain is left out and named. A slope is judged only with "
    f"{MIN_DISTINCT} or more distinct values of its axis: 'grows' or "
    "'shrinks' when its interval excludes 0.",
    "",
  ]
  lines += [_trend_table(trends, target, "both arms" if by_arm else ""), ""]
  for arm, arm_fits in by_arm.items():
    lines += [_trend_table(arm_fits, None, arm), ""]
  lines += finding_lines(_findings(trends, by_arm, target, plans))
  return lines


def _trend_table(trends, target, arm: str) -> str:
  rows = []
  for ref, trend in trends.items():
    prediction = _predict(trend, target) if trend and target else None
    rows.append(
      [ref] + [_slope_cell(trend, axis) for axis in AXES]
      + ["-" if trend is None else f"{trend.sizes} / {trend.observations}"]
      + ([] if target is None else
         ["-" if prediction is None else
          f"{num(prediction['mean'])}x [{num(prediction['low'])}, "
          f"{num(prediction['high'])}]"])
    )  # fmt: skip
  header = (
    [f"reference ({arm})" if arm else "reference"]
    + [f"slope: {axis}" for axis in AXES]
    + ["units / values"]
    + ([] if target is None else [f"prediction at {_target_label(target)}"])
  )
  return table(header, rows)


def _target_label(target) -> str:
  size, steps = target
  return f"{size.name}, {steps} steps"


def _slope_cell(trend, axis) -> str:
  if trend is not None and axis in trend.moves_with:
    return f"moves with {' and '.join(trend.moves_with[axis])}"
  slope = trend.slopes.get(axis) if trend else None
  if slope is None:
    return "not fitted (one value)"
  return (
    f"{slope.estimate:+.3f} [{slope.low:+.3f}, {slope.high:+.3f}]: "
    f"**{slope.verdict}**"
  )


def _findings(trends, by_arm, target, plans) -> list[str]:
  parameters = [p.size.parameters for p in plans]
  computes = [p.compute for p in plans]
  contexts = [p.size.context for p in plans]
  steps = [p.steps for p in plans]
  findings = [
    f"The units span {num(max(parameters) / min(parameters))}x in "
    f"parameters, {num(max(computes) / min(computes))}x in training "
    f"compute, {num(max(contexts) / min(contexts))}x in context and "
    f"{num(max(steps) / min(steps))}x in steps.",
  ]
  for ref, trend in trends.items():
    if trend is None:
      findings.append(f"Against `{ref}`: too few bounded values to fit.")
      continue
    said = "; ".join(
      f"with {axis}, **{s.verdict}** (slope {s.estimate:+.3f} "
      f"[{s.low:+.3f}, {s.high:+.3f}], {10**s.estimate:.3g}x per 10x)"
      for axis, s in trend.slopes.items()
    )
    text = f"Flash vs Baseline's drift over `{ref}`'s: {said}."
    if "steps" in trend.moves_with:
      text += (
        " Steps move with parameters here (the same tokens per parameter "
        "take a larger model more steps, and two runs drift further apart "
        "with every step), so the parameters slope holds the effect of "
        "the longer run with that of the size; a fixed-step arm "
        "(`scaling.fixed_steps`) separates them."
      )
    text += _prediction_text(trend, target, parameters, contexts)
    findings.append(text)
  findings += _arm_findings(by_arm)
  return findings


def _prediction_text(trend, target, parameters, contexts) -> str:
  prediction = _predict(trend, target)
  if prediction is None:
    return ""
  size, steps = target
  along = (
    f"at {steps} steps, from both arms' fit"
    if "steps" in trend.slopes
    else "along the tokens-per-parameter arm (steps growing with size)"
  )
  return (
    f" Predicted (an extrapolation "
    f"{num(size.parameters / max(parameters))}x beyond the largest "
    f"size's parameters and {num(size.context / max(contexts))}x its "
    f"context, valid only if the trend stays a power law) at "
    f"{size.name}, {along}: {num(prediction['mean'])}x "
    f"[{num(prediction['low'])}, {num(prediction['high'])}]."
  )


def _arm_findings(by_arm) -> list[str]:
  """Each arm's parameters slope: the fixed-step arm's is size alone."""
  out = []
  for arm, fits in by_arm.items():
    for ref, trend in fits.items():
      slope = trend.slopes.get("parameters") if trend else None
      if slope is None:
        continue
      held = "steps held" if arm == "fixed_steps" else "steps growing with size"
      out.append(
        f"The {arm} arm alone ({held}), over `{ref}`: with parameters "
        f"**{slope.verdict}** (slope {slope.estimate:+.3f} "
        f"[{slope.low:+.3f}, {slope.high:+.3f}], {trend.sizes} units)."
      )
  return out


def before_after_tables(now: dict, before: dict, references=None) -> str:
  """Two stored sweeps' headlines side by side, as docs/results.md quotes
  them: each unit's ratio over each reference (now, then before), and each
  reference's slopes from both arms and from each arm alone, with the
  prediction. `references`: the order of columns (default: now's)."""
  references = list(references or now["trends"])
  steps = {r["size"]: r["steps"] for r in now["sizes"]}
  unit_rows = [
    [unit, steps[unit]]
    + [
      _cell(sweep["ratios"][unit][ref])
      if ref in sweep["ratios"].get(unit, {})
      else "-"
      for ref in references
      for sweep in (now, before)
    ]
    for unit in now["ratios"]
  ]
  unit_header = ["unit", "steps"] + [
    f"over {ref}{when}" for ref in references for when in ("", ", before")
  ]

  def slope(fit, axis) -> str:
    cell = (fit or {}).get("slopes", {}).get(axis)
    if cell is None:
      return "-"
    return (
      f"{cell['estimate']:+.3f} [{cell['low']:+.3f}, {cell['high']:+.3f}] "
      f"({10 ** cell['estimate']:.2f}x per 10x)"
    )

  def prediction(fit) -> str:
    p = (fit or {}).get("prediction")
    return "-" if p is None else _cell(p)

  slope_rows = []
  for ref in references:
    for label, sweep in (("now", now), ("before", before)):
      arms = sweep.get("arm_trends", {})
      slope_rows.append(
        [
          ref,
          label,
          slope(sweep["trends"].get(ref), "parameters"),
          slope(sweep["trends"].get(ref), "steps"),
          slope(arms.get("fixed_steps", {}).get(ref), "parameters"),
          slope(arms.get("tokens_per_parameter", {}).get(ref), "parameters"),
          prediction(sweep["trends"].get(ref)),
        ]
      )
  slope_header = [
    "reference",
    "run",
    "parameters, at fixed steps (both arms)",
    "steps, at fixed size (both arms)",
    "parameters, fixed-step arm alone",
    "parameters, tokens-per-parameter arm alone",
    "prediction",
  ]
  return (
    table(unit_header, unit_rows) + "\n\n" + table(slope_header, slope_rows)
  )
