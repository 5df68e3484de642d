"""The trend of a drift ratio with size, context and steps: a log-log fit.

log10(ratio) = a + b log10(parameters) + c log10(context)
+ d log10(steps), fitted by least squares to one value per replicate per
unit (each replicate its own initialization and data order, so the values
are independent), with Student-t intervals on the slopes and on the
fitted mean anywhere, the prediction included. Each slope is the change
with its axis while the others are held: b is the slope with parameters
at fixed steps, d with steps at fixed size. A slope is judged only from
three or more distinct values of its axis; no number here is written by
hand.

Steps enters only where the design separates it from the other axes: in
the tokens-per-parameter arm alone, steps are proportional to parameters,
so it is left out (and named) and the parameters slope holds both.
"""

from __future__ import annotations

import dataclasses

import numpy as np

AXES = ("parameters", "context", "steps")
MIN_DISTINCT = 3  # distinct values of an axis before its slope is judged
# An axis whose log the others' logs explain this well (R^2) moves with
# them: its slope and theirs cannot be told apart.
COLLINEAR_R2 = 0.99


@dataclasses.dataclass(frozen=True)
class Slope:
  """d log10(ratio) / d log10(axis), with its 95% interval: the ratio
  changes 10**estimate-fold per 10x of the axis."""

  axis: str
  estimate: float
  low: float
  high: float
  distinct: int  # distinct values of the axis among the fitted sizes

  @property
  def verdict(self) -> str:
    if self.distinct < MIN_DISTINCT:
      return f"no verdict: {self.distinct} distinct {self.axis} values"
    if self.low > 0:
      return "grows"
    if self.high < 0:
      return "shrinks"
    return "no trend told apart"

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "verdict": self.verdict}


@dataclasses.dataclass(frozen=True)
class Trend:
  """One reference's fit, and the mean ratio it gives at any size."""

  slopes: dict[str, Slope]
  observations: int
  sizes: int
  df: int
  coefficients: np.ndarray  # [a, b_axis...] in the order of `slopes`
  covariance: np.ndarray
  residual_sd: float
  # An axis left out because it moves with the fitted ones: {axis: [the
  # axes it moves with]}; their slopes hold its effect too.
  moves_with: dict[str, list[str]] = dataclasses.field(default_factory=dict)

  def at(self, **axes: float) -> tuple[float, float, float]:
    """(mean, low, high) of the fitted ratio at `axes` (95%, the band of
    the mean: where the trend's line lies, not where one run falls)."""
    x = np.array([1.0] + [np.log10(axes[a]) for a in self.slopes])
    mean = float(x @ self.coefficients)
    from scipy import stats  # 1-2 s to import: only where a band is drawn

    half = float(stats.t.ppf(0.975, self.df) * np.sqrt(x @ self.covariance @ x))
    return 10**mean, 10 ** (mean - half), 10 ** (mean + half)

  def as_dict(self) -> dict:
    return {
      "slopes": {a: s.as_dict() for a, s in self.slopes.items()},
      "observations": self.observations,
      "sizes": self.sizes,
      "df": self.df,
      "residual_sd_log10": self.residual_sd,
      "moves_with": self.moves_with,
    }


def _explained(column: np.ndarray, others: list[np.ndarray]) -> float:
  """R^2 of `column` regressed on a constant and `others`."""
  design = np.column_stack([np.ones_like(column)] + others)
  coefficients, *_ = np.linalg.lstsq(design, column, rcond=None)
  residual = column - design @ coefficients
  spread = float(((column - column.mean()) ** 2).sum())
  return 1.0 - float(residual @ residual) / spread


def fit(points: list[dict]) -> Trend | None:
  """The log-log fit over `points` ({"parameters", "context", "ratio"},
  and "steps" where known; one per replicate per unit), on every axis
  with two or more distinct values that the others do not explain; None
  when fewer observations than coefficients + 1 remain."""
  logs, moves_with = {}, {}
  for axis in AXES:
    if not points or any(axis not in p for p in points):
      continue
    if len({p[axis] for p in points}) < 2:
      continue
    column = np.log10(np.array([p[axis] for p in points], np.float64))
    if logs and _explained(column, list(logs.values())) >= COLLINEAR_R2:
      if axis != "steps":
        raise ValueError(
          f"scaling.sizes moves {axis} with {' and '.join(logs)}, so their "
          "slopes cannot be told apart; add a size that changes one alone."
        )
      moves_with[axis] = list(logs)
      continue
    logs[axis] = column
  axes = list(logs)
  if not points or len(points) <= len(axes) + 1:
    return None
  design = np.column_stack([np.ones(len(points))] + list(logs.values()))
  y = np.log10(np.array([p["ratio"] for p in points], np.float64))
  coefficients, *_ = np.linalg.lstsq(design, y, rcond=None)
  df = len(points) - design.shape[1]
  residual = y - design @ coefficients
  variance = float(residual @ residual) / df
  covariance = variance * np.linalg.inv(design.T @ design)
  from scipy import stats

  t = stats.t.ppf(0.975, df)
  slopes = {}
  for i, axis in enumerate(axes, start=1):
    half = float(t * np.sqrt(covariance[i, i]))
    slopes[axis] = Slope(
      axis,
      float(coefficients[i]),
      float(coefficients[i] - half),
      float(coefficients[i] + half),
      len({p[axis] for p in points}),
    )
  return Trend(
    slopes=slopes,
    observations=len(points),
    sizes=len({tuple(p.get(a) for a in AXES) for p in points}),
    df=df,
    coefficients=coefficients,
    covariance=covariance,
    residual_sd=float(np.sqrt(variance)),
    moves_with=moves_with,
  )
