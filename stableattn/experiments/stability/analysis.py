"""From final rows to numbers and verdicts (no verdict from no rows).

Learning-rate sensitivity as Wortsman et al. (arXiv 2309.14322, Sec. 3.2)
define it: over the learning-rate grid, the mean of min(final loss, L0)
minus the best final loss, with L0 the initial loss (here ln vocab, a
uniform guess; a diverged run counts as L0). Each replicate gives one
value; arms are compared replicate by replicate (same initialization and
data order), with a Student-t interval over replicates.
"""

from __future__ import annotations

import math

import numpy as np

from stableattn.harness.reporting import Interval, mean_interval

# What a cell's final row records of its logged steps (Wortsman et al.:
# logit growth, output log-partition; Qiu & Yao: tied maxima, W_Q's
# spectral norm, the sign of delta's error at the last logged step).
PROBES = (
  "max_logit_max",
  "log_z_max",
  "tied_max_share_max",
  "near_tied_share_max",
  "wq_spectral_max",
  "delta_signed_share",
)


def finals(rows) -> list[dict]:
  return [r for r in rows if r.get("kind") == "final"]


def by_replicate(rows, arm: str) -> dict[int, dict[float, dict]]:
  """{replicate: {lr: final row}} of one arm."""
  out: dict[int, dict[float, dict]] = {}
  for r in finals(rows):
    if r["arm"] == arm:
      out.setdefault(r["replicate"], {})[r["lr"]] = r
  return out


def lr_sensitivity(curve: dict[float, dict], clip: float) -> float:
  losses = [min(r["final_loss"], clip) for r in curve.values()]
  return float(np.mean(losses) - np.min(losses))


def largest_stable_lr(curve: dict[float, dict], clip: float) -> float | None:
  """The largest learning rate whose run neither diverged nor ended at or
  above the initial loss; None if none."""
  stable = [
    lr
    for lr, r in curve.items()
    if not r["diverged"] and r["final_loss"] < clip
  ]
  return max(stable) if stable else None


def arm_numbers(rows, arm: str, grid, clip: float) -> dict | None:
  """Per-replicate sensitivity and largest stable LR of one arm, over the
  replicates whose whole grid is measured; None if none is."""
  complete = {
    rep: curve
    for rep, curve in by_replicate(rows, arm).items()
    if set(curve) >= set(grid)
  }
  if not complete:
    return None
  reps = sorted(complete)
  sens = [lr_sensitivity(complete[r], clip) for r in reps]
  stable = [largest_stable_lr(complete[r], clip) for r in reps]
  top = max(grid)
  return {
    "replicates": reps,
    "lr_sensitivity": sens,
    "largest_stable_lr": stable,
    "diverged_at_top": [bool(complete[r][top]["diverged"]) for r in reps],
    "diverged": {
      lr: [bool(complete[r][lr]["diverged"]) for r in reps] for lr in grid
    },
    "max_logit": {
      lr: [complete[r][lr]["max_logit_max"] for r in reps] for lr in grid
    },
    "final_loss": {
      lr: [complete[r][lr]["final_loss"] for r in reps] for lr in grid
    },
    "probes": {
      probe: {lr: [complete[r][lr].get(probe) for r in reps] for lr in grid}
      for probe in PROBES
    },
  }


def interval(values, *, log2: bool = False) -> Interval | None:
  """Mean with interval; `log2` averages log2 of positive values."""
  values = [v for v in values if v is not None]
  if not values:
    return None
  if not log2:
    return mean_interval(values)
  i = mean_interval([math.log2(v) for v in values])
  back = lambda x: None if x is None else 2.0**x  # noqa: E731
  return Interval(back(i.mean), back(i.low), back(i.high), i.count)


def paired_values(a: dict, b: dict, key: str, *, log2=False) -> list[float]:
  """a[key] - b[key] per replicate both measured (log2 of the values
  first if `log2`; a None largest stable LR is skipped)."""
  values = []
  for rep in sorted(set(a["replicates"]) & set(b["replicates"])):
    x = a[key][a["replicates"].index(rep)]
    y = b[key][b["replicates"].index(rep)]
    if x is None or y is None:
      continue
    values.append(math.log2(x) - math.log2(y) if log2 else x - y)
  return values


def paired_difference(
  a: dict, b: dict, key: str, *, log2=False
) -> Interval | None:
  """Interval of a[key] - b[key] over the replicates both measured."""
  values = paired_values(a, b, key, log2=log2)
  return mean_interval(values) if values else None


def spread_ratio(
  a: list[float], b: list[float], confidence: float = 0.95
) -> Interval | None:
  """How far one difference moves a quantity against another: the ratio
  of root-mean-square paired differences, sqrt(mean a^2 / mean b^2), with
  the F-distribution's interval (each a zero-mean difference: n degrees of
  freedom; approximate, the replicates are shared). None without values
  or where b is identically 0."""
  if not a or not b:
    return None
  ms_a = float(np.mean(np.square(a)))
  ms_b = float(np.mean(np.square(b)))
  if ms_b == 0:
    return None
  observed = ms_a / ms_b
  tail = (1 - confidence) / 2
  from scipy import stats  # 1-2 s to import: only where a ratio is judged

  upper = stats.f.ppf(1 - tail, len(a), len(b))
  lower = stats.f.ppf(tail, len(a), len(b))
  return Interval(
    math.sqrt(observed),
    math.sqrt(observed / upper),
    math.sqrt(observed / lower),
    min(len(a), len(b)),
  )


def change_verdict(
  diff: Interval | None, references: dict[str, Interval | None] | None = None
) -> str:
  """Whether a paired difference is told apart from 0, and how its mean
  compares with each reference difference's {label: interval}."""
  if diff is None:
    return "no rows"
  if diff.low is None:
    return "one replicate: no interval"
  if diff.low > 0:
    word = "higher"
  elif diff.high < 0:
    word = "lower"
  else:
    word = "no difference told apart from 0"
  for label, reference in (references or {}).items():
    if reference is None or reference.low is None:
      continue
    if abs(diff.mean) == abs(reference.mean):
      relation = "as large as"
    elif abs(diff.mean) < abs(reference.mean):
      relation = "smaller than"
    else:
      relation = "larger than"
    word += f"; {relation} the {label} difference"
  return word


def slope(xs, ys) -> float | None:
  """Least-squares slope of log(y) against log(x) (positive ys only)."""
  pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y and y > 0]
  if len(pts) < 2:
    return None
  x, y = np.asarray(pts).T
  return float(np.polyfit(x, y, 1)[0])
