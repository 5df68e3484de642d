"""Numbers from drift rows: per-step drift, ratios between pairs with
intervals, and the paper's verdicts. No text, no files."""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.experiments.training_drift.pairs import Pair
from stableattn.harness.reporting import (
  Interval,
  band_verdict,
  mean_interval,
)

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

  over_replicates: Interval | None
  over_steps: Interval | None
  # Replicates whose reference drifts exactly 0 at every logged step while
  # the subject drifts: the ratio is unbounded there, so the others are
  # not the whole and give no ratio (None above) and no verdict.
  unbounded_replicates: int = 0
  replicates: int = 0

  @property
  def bounded(self) -> bool:
    return self.unbounded_replicates == 0

  def as_dict(self) -> dict:
    if not self.bounded:
      return {
        "unbounded_replicates": self.unbounded_replicates,
        "replicates": self.replicates,
      }
    return {
      "over_replicates": self.over_replicates.as_dict(),
      "over_steps": self.over_steps.as_dict(),
    }


def unbounded_replicates(
  rows, numerator: str, denominator: str, metric: str = "wasserstein"
) -> list[int]:
  """Replicates where `denominator` drifts exactly 0 at every logged step
  after step 0 while `numerator` drifts at some: the ratio has no bound."""
  found = []
  for replicate in replicates_of(rows):
    a = model_drift(rows, numerator, metric, replicate)
    b = model_drift(rows, denominator, metric, replicate)
    steps = [s for s in a if s > 0 and s in b]
    if steps and all(b[s] == 0 for s in steps) and any(a[s] > 0 for s in steps):
      found.append(replicate)
  return found


def worst_max_abs(rows, pair: str) -> float:
  """The largest max |Δw| of a pair over replicates and steps (0 if it
  never drifted)."""
  return max(
    (
      v
      for r in replicates_of(rows)
      for v in model_drift(rows, pair, "max_abs", r).values()
    ),
    default=0.0,
  )


def ratio_summary(
  rows, numerator: str, denominator: str, metric: str = "wasserstein"
) -> RatioSummary | None:
  """The ratio of two pairs' drifts with intervals; None if never defined.

  Where the reference is identical (drift 0) in some replicates but not
  all, the summary says how many and carries no ratio.
  """
  unbounded = unbounded_replicates(rows, numerator, denominator, metric)
  replicates = len(replicates_of(rows))
  if unbounded and len(unbounded) < replicates:
    return RatioSummary(None, None, len(unbounded), replicates)
  per_replicate = _per_replicate_ratios(rows, numerator, denominator, metric)
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
      list(replicate_ratios(rows, numerator, denominator, metric).values()),
      geometric=True,
    ),
    over_steps=mean_interval(by_step, geometric=True),
    replicates=replicates,
  )


def _per_replicate_ratios(rows, numerator, denominator, metric):
  """{replicate: {step: ratio}} of the replicates with a defined ratio."""
  per_replicate = {
    r: drift_ratios(rows, numerator, denominator, metric, r)
    for r in replicates_of(rows)
  }
  return {r: v for r, v in per_replicate.items() if v}


def replicate_ratios(
  rows, numerator: str, denominator: str, metric: str = "wasserstein"
) -> dict[int, float]:
  """{replicate: geometric mean over logging steps of the ratio}: one
  independent value per replicate (its own initialization and data
  order), the unit that intervals and fits across runs rest on."""
  return {
    r: mean_interval(list(v.values()), geometric=True).mean
    for r, v in _per_replicate_ratios(
      rows, numerator, denominator, metric
    ).items()
  }


def growth_rate(
  rows, pair: str, metric: str = "wasserstein", replicate: int = 0
) -> float | None:
  """The least-squares slope of one pair's drift against the step (drift
  per step) over its logged steps, step 0 included: the paper's Fig. 8
  reads the comparison from how fast deviation grows ("note the slope").
  None with fewer than two logged steps."""
  drift = model_drift(rows, pair, metric, replicate)
  if len(drift) < 2:
    return None
  steps = np.asarray(sorted(drift), np.float64)
  return float(np.polyfit(steps, [drift[s] for s in sorted(drift)], 1)[0])


def slope_ratio_summary(
  rows, numerator: str, denominator: str, metric: str = "wasserstein"
):
  """(interval over replicates of growth_rate(numerator) /
  growth_rate(denominator), replicates left out because a slope was not
  positive); (None, n) when no replicate has both slopes positive."""
  ratios, left_out = [], 0
  for replicate in replicates_of(rows):
    a = growth_rate(rows, numerator, metric, replicate)
    b = growth_rate(rows, denominator, metric, replicate)
    if a is None or b is None:
      continue
    if a > 0 and b > 0:
      ratios.append(a / b)
    else:
      left_out += 1
  if not ratios:
    return None, left_out
  return mean_interval(ratios, geometric=True), left_out


def paper_verdict(summary: RatioSummary, reference: Pair) -> str | None:
  """The verdict on the paper's claim about a subject against `reference`
  (None where the paper claims nothing about that reference)."""
  if not summary.bounded:
    return None
  interval = summary.over_replicates
  if reference.at_most is not None:
    return band_verdict(interval, 0.0, reference.at_most)
  if reference.below_band is not None:
    return band_verdict(interval.inverted(), *reference.below_band)
  return None
