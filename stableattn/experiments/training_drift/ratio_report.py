"""The drift report's ratio section: every subject pair divided by every
reference pair, with intervals over replicates and steps and the paper's
verdicts; a reference identical in some replicates gives no ratio."""

from __future__ import annotations

from stableattn.experiments.training_drift.analysis import (
  RATIO_METRICS,
  model_drift,
  paper_verdict,
  ratio_summary,
  replicates_of,
  slope_ratio_summary,
)
from stableattn.experiments.training_drift.pairs import with_role
from stableattn.harness.reporting import (
  Interval,
  num,
  resolution,
  table,
)

RATIO_INTRO = (
  "Drift of each subject pair divided by the drift of each reference pair "
  "(below 1: the subject drifts less). Geometric means over logging steps "
  "after step 0, then over replicates; 95% Student-t intervals over "
  "replicates (each replicate its own initialization and data order) and "
  "over logging steps (correlated, so narrower). A verdict holds when the "
  "interval over replicates lies inside the paper's band, fails when it "
  "lies outside, and cannot be told apart when it straddles an edge or "
  "there is one replicate. The growth-rate ratio divides the pairs' "
  "fitted slopes of drift against step (the paper's Fig. 8 reading), per "
  "replicate, with its interval over replicates."
)


def ratio_section(rows, pairs, headline) -> tuple[list[str], list[str]]:
  """Every subject against every reference, with the paper's verdicts."""
  table_rows, findings = [], []
  headline["ratios"], headline["paper_verdicts"] = {}, {}
  subjects = with_role(pairs, "subject") + with_role(pairs, "ablation")
  for subject in subjects:
    for reference in with_role(pairs, "reference"):
      for metric in RATIO_METRICS:
        summary = ratio_summary(rows, subject.name, reference.name, metric)
        if summary is None:
          continue
        ratios = headline["ratios"].setdefault(subject.name, {})
        ratios.setdefault(reference.name, {})[metric] = summary.as_dict()
        if not summary.bounded:
          table_rows.append(_unbounded_row(subject, reference, metric, summary))
          if metric == "wasserstein":
            findings.append(_unbounded_finding(subject, reference, summary))
          continue
        verdict = None
        if subject.role == "subject":
          verdict = paper_verdict(summary, reference)
        judged = metric == "wasserstein" and verdict is not None
        if judged:
          verdicts = headline["paper_verdicts"].setdefault(subject.name, {})
          verdicts[reference.name] = verdict
          findings.append(
            f"`{subject.name}` against `{reference.name}` (Wasserstein): "
            f"{below_text(summary.over_replicates)}, over replicates; the "
            f"paper's {reference.claim} **{verdict}**"
            f"{_resolution_text(summary.over_replicates)}."
          )
        elif metric == "wasserstein":
          findings.append(
            f"`{subject.name}` against `{reference.name}` (Wasserstein; "
            f"the paper claims nothing here): "
            f"{below_text(summary.over_replicates)}, over replicates"
            f"{_resolution_text(summary.over_replicates)}."
          )
        slope, left_out = slope_ratio_summary(
          rows, subject.name, reference.name, metric
        )
        if slope is not None:
          ratios[reference.name][f"{metric}_slope"] = {
            **slope.as_dict(),
            "replicates_left_out": left_out,
          }
        table_rows.append(
          [subject.name, reference.name, metric]
          + [num(summary.over_replicates.mean)]
          + [_interval_cell(summary.over_replicates)]
          + [_interval_cell(summary.over_steps)]
          + [_slope_cell(slope, left_out)]
          + ([reference.claim, verdict] if judged else ["-", "-"])
        )
  for reference in with_role(pairs, "reference"):
    drifts = [
      v
      for replicate in replicates_of(rows)
      for v in model_drift(rows, reference.name, "max_abs", replicate).values()
    ]
    if drifts and max(drifts) == 0:
      findings.append(
        f"Reference `{reference.name}` drifts exactly 0 at every logged "
        "step (its two runs compute the same bits here), so no subject is "
        "divided by it."
      )
  if not table_rows:
    return [], findings
  header = ["subject pair", "reference pair", "metric", "subject / reference"]
  header += ["95% CI over replicates", "95% CI over steps"]
  header += ["growth-rate ratio [95% CI]", "paper", "verdict"]
  return [
    "## Each subject pair against each reference pair",
    "",
    RATIO_INTRO,
    "",
    table(header, table_rows),
    "",
  ], findings


def _unbounded_row(subject, reference, metric, summary) -> list[str]:
  identical = (
    f"unbounded: identical in {summary.unbounded_replicates} of "
    f"{summary.replicates} replicates"
  )
  return [subject.name, reference.name, metric, identical, "-", "-", "-"] + (
    [reference.claim, "no verdict"] if reference.claim else ["-", "-"]
  )


def _unbounded_finding(subject, reference, summary) -> str:
  return (
    f"`{subject.name}` against `{reference.name}`: the reference's two "
    f"runs are identical (drift exactly 0 at every logged step) in "
    f"{summary.unbounded_replicates} of {summary.replicates} replicates, "
    "where the subject drifts, so the ratio is unbounded there; no ratio "
    "or verdict is given from the other replicates as if they were the "
    "whole."
  )


def below_text(interval: Interval) -> str:
  """A ratio with its interval, read as 'N x below' (or above)."""
  mean = interval.mean
  side = f"{num(1 / mean)}x below" if mean < 1 else f"{num(mean)}x above"
  return f"{interval.text('x')}, i.e. {side}"


def _resolution_text(interval: Interval) -> str:
  text = resolution(interval, geometric=True)
  return f" ({text})" if text else ""


def _interval_cell(interval: Interval) -> str:
  if interval.low is None:
    return f"- (n={interval.count})"
  return f"{num(interval.low)}-{num(interval.high)} (n={interval.count})"


def _slope_cell(slope: Interval | None, left_out: int) -> str:
  if slope is None:
    return f"- ({left_out} slopes not positive)" if left_out else "-"
  cell = f"{num(slope.mean)} [{_interval_cell(slope)}]"
  return cell + (f", {left_out} left out" if left_out else "")


def _cell(got: dict | None, verdict: str | None = None) -> str:
  if not got or "mean" not in got:
    return "-"
  text = f"{num(got['mean'])} [{num(got['low'])}, {num(got['high'])}]"
  if got.get("replicates_left_out"):
    text += f" (n={got['count']})"
  return f"{text} {verdict}" if verdict else text


def runs_table(
  headlines: dict, subject: str = "flash_vs_baseline", metric="wasserstein"
) -> str:
  """One subject against every reference pair, side by side for several
  stored runs (`{label: headline.json}`): the end-point ratio of the
  metric's drift with its interval over replicates (and, for Wasserstein,
  the paper's verdict) and the ratio of growth rates; docs/results.md
  quotes it."""
  references = sorted(
    {r for h in headlines.values() for r in h["ratios"].get(subject, {})}
  )
  header = ["reference pair"] + [
    f"{label}: {what}"
    for label in headlines
    for what in ("end-point ratio", "growth-rate ratio")
  ]
  rows = []
  for reference in references:
    row = [reference]
    for headline in headlines.values():
      ratios = headline["ratios"].get(subject, {}).get(reference, {})
      verdicts = headline["paper_verdicts"].get(subject, {})
      verdict = verdicts.get(reference) if metric == "wasserstein" else None
      row.append(_cell(ratios.get(metric, {}).get("over_replicates"), verdict))
      row.append(_cell(ratios.get(f"{metric}_slope")))
    rows.append(row)
  return table(header, rows)


def ablation_table(headline: dict, reference: str = "bf16_vs_fp32") -> str:
  """The ablation's pairs (`--config=ablation`) as shares of `reference`:
  per tensor class, the drift from FP32 training of BF16 training with
  that class kept in FP32, and of FP32 training with only that class in
  BF16, over `reference`'s, end point and growth rate, on Wasserstein and
  max |dW|; docs/results.md quotes it."""
  from stableattn.training.compute_format import FP32_CLASSES

  header = ["tensor class"] + [
    f"{run}: {metric}"
    for run in ("kept in FP32", "alone in BF16")
    for metric in ("Wasserstein", "growth rate", "max |dW|")
  ]
  rows = []
  for tensor_class in FP32_CLASSES:
    row = [tensor_class]
    for pair in (
      f"bf16_{tensor_class}_in_fp32_vs_fp32",
      f"bf16_only_{tensor_class}_vs_fp32",
    ):
      ratios = headline["ratios"].get(pair, {}).get(reference, {})
      row += [
        _cell(ratios.get("wasserstein", {}).get("over_replicates")),
        _cell(ratios.get("wasserstein_slope")),
        _cell(ratios.get("max_abs", {}).get("over_replicates")),
      ]
    rows.append(row)
  return table(header, rows)
