"""report.md, headline.json and the figure of the drift-scaling sweep.

Every number comes from the size studies' rows (their metrics.jsonl):
Flash vs Baseline's drift over each reference's, one geometric mean over
logging steps per replicate, then the intervals and the fit.
"""

from __future__ import annotations

import json

from stableattn.experiments import environment
from stableattn.experiments.drift_scaling.plots import write_figure
from stableattn.experiments.drift_scaling.trend import MIN_DISTINCT, fit
from stableattn.experiments.reporting import (
  finding_lines,
  mean_interval,
  num,
  table,
)
from stableattn.experiments.rundir import RunDir
from stableattn.experiments.training_drift.analysis import (
  replicate_ratios,
  unbounded_replicates,
)

SUBJECT = "flash_vs_baseline"
RESOLVES = 1.5  # an interval resolves 1.5x when high/mean and mean/low <= it


def ratio_rows(size_row: dict, rows, references, metric) -> list[dict]:
  """One row per replicate per reference at one size; a reference
  identical in some replicates gives one 'unbounded' row instead."""
  out = []
  tag = {k: size_row[k] for k in ("size", "parameters", "context", "compute")}
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
  run_dir: RunDir, plans, size_rows, *, references, metric, target, notes, env
) -> dict:
  """The sweep's report from the size studies' rows; returns its headline."""
  rows = list(size_rows)
  for p, size_row in zip(plans, size_rows):
    study = RunDir(run_dir.path / "sizes" / p.size.name).read_metrics()
    rows += ratio_rows(size_row, study, references, metric)
  run_dir.rewrite_metrics(rows)
  ratios = [r for r in rows if r["kind"] == "ratio"]
  trends = {
    ref: fit([r for r in ratios if r["reference"] == ref]) for ref in references
  }
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
    "prediction_at": target.name,
    "environment": env,
  }
  figure = write_figure(
    run_dir.path / "drift_scaling.png", ratios, trends, per_size
  )
  text = _report(plans, size_rows, per_size, trends, target, notes, metric)
  text += [
    "",
    f"![ratio against size and context]({figure.name})",
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


def _predict(trend, target) -> dict | None:
  if len(trend.slopes) < 2:
    return None  # an axis not fitted would be extrapolated blind
  mean, low, high = trend.at(
    parameters=target.parameters, context=target.context
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


def _slope_cell(trend, axis) -> str:
  slope = trend.slopes.get(axis) if trend else None
  if slope is None:
    return "not fitted (one value)"
  return (
    f"{slope.estimate:+.3f} [{slope.low:+.3f}, {slope.high:+.3f}]: "
    f"**{slope.verdict}**"
  )


def _report(plans, size_rows, per_size, trends, target, notes, metric):
  lines = [
    "# Training drift across sizes: Flash vs Baseline against references",
    "",
    "Each size is a drift study of its own (`sizes/<size>/report.md`): "
    "the same tokens per non-embedding parameter and per step at every "
    "size. A ratio is Flash vs Baseline's drift over the reference pair's "
    f"({metric}), the geometric mean over logging steps after step 0 in "
    "each replicate, then over replicates with a 95% Student-t interval.",
    "",
  ]
  lines += [f"- {n}" for n in notes] + ([""] if notes else [])
  header = ["size", "parameters", "context", "batch x steps", "tokens",
            "training FLOPs", "seconds"]  # fmt: skip
  lines += [
    "## Sizes",
    "",
    table(
      header,
      [
        [
          r["size"],
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
    "## Flash vs Baseline over each reference, per size",
    "",
  ]
  references = list(trends)
  lines += [
    table(
      ["size"] + references,
      [
        [name]
        + [_cell(cells[ref]) if ref in cells else "-" for ref in references]
        for name, cells in per_size.items()
      ],
    ),
    "",
    "## The trend",
    "",
    "log10(ratio) = a + b log10(parameters) + c log10(context), least "
    "squares over one value per replicate per size; 95% intervals. The "
    "ratio changes 10^b-fold per 10x parameters. A slope is judged only "
    f"with {MIN_DISTINCT} or more distinct values of its axis: 'grows' or "
    "'shrinks' when its interval excludes 0.",
    "",
  ]
  lines += [_trend_table(trends, target), ""]
  lines += finding_lines(_findings(trends, target, plans))
  return lines


def _trend_table(trends, target) -> str:
  rows = []
  for ref, trend in trends.items():
    prediction = _predict(trend, target) if trend else None
    rows.append(
      [ref, _slope_cell(trend, "parameters"), _slope_cell(trend, "context"),
       "-" if trend is None else f"{trend.sizes} / {trend.observations}",
       "-" if prediction is None else
       f"{num(prediction['mean'])}x [{num(prediction['low'])}, "
       f"{num(prediction['high'])}]"]
    )  # fmt: skip
  header = ["reference", "slope: parameters", "slope: context",
            "sizes / values", f"prediction at {target.name}"]  # fmt: skip
  return table(header, rows)


def _findings(trends, target, plans) -> list[str]:
  parameters = [p.size.parameters for p in plans]
  computes = [p.compute for p in plans]
  contexts = [p.size.context for p in plans]
  findings = [
    f"The sizes span {num(max(parameters) / min(parameters))}x in "
    f"parameters, {num(max(computes) / min(computes))}x in training "
    f"compute and {num(max(contexts) / min(contexts))}x in context.",
  ]
  steps = [p.steps for p in plans]
  if max(steps) > min(steps):
    findings.append(
      f"Optimizer steps differ from size to size ({min(steps)} to "
      f"{max(steps)}): the same tokens per parameter take a larger model "
      "more steps, and two runs drift further apart with every step, so "
      "the parameters slope holds the effect of the longer run with that "
      "of the size. The context axis trains the same steps at every "
      "context."
    )
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
    prediction = _predict(trend, target)
    if prediction is not None:
      text += (
        f" Predicted (an extrapolation "
        f"{num(target.parameters / max(parameters))}x beyond the largest "
        f"size's parameters and {num(target.context / max(contexts))}x its "
        f"context, valid only if the trend stays a power law) at "
        f"{target.name}: {num(prediction['mean'])}x "
        f"[{num(prediction['low'])}, {num(prediction['high'])}]."
      )
    findings.append(text)
  return findings
