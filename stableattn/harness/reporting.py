"""What every experiment's report is made of: tables, spreads, intervals,
sections and findings. All of it formats numbers it is given; none of it
measures anything.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np


def num(x) -> str:
  """A number as a table shows it: 3 significant digits, '-' for none."""
  if x is None:
    return "-"
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if x == 0:
    return "0"
  return f"{x:.3g}" if 1e-2 <= abs(x) < 1e4 else f"{x:.2e}"


def table(header: list[str], rows: list[list]) -> str:
  """A Markdown table; a '|' inside a cell (|x|) is escaped, not a column."""

  def cell(value) -> str:
    return str(value).replace("|", "\\|")

  lines = [
    "| " + " | ".join(cell(h) for h in header) + " |",
    "|" + "---|" * len(header),
  ]
  lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def select(rows, **filters) -> list[dict]:
  """The rows whose fields equal every filter."""
  return [r for r in rows if all(r.get(k) == v for k, v in filters.items())]


def one(rows, **filters) -> dict | None:
  """The first row matching the filters, or None."""
  found = select(rows, **filters)
  return found[0] if found else None


def spread(values) -> str:
  """'median (min-max)' of some values; '-' for none."""
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  return (
    f"{num(float(np.median(values)))} "
    f"({num(float(np.min(values)))}-{num(float(np.max(values)))})"
  )


@dataclasses.dataclass(frozen=True)
class Interval:
  """A mean with a two-sided confidence interval (None with one value)."""

  mean: float
  low: float | None
  high: float | None
  count: int

  def text(self, unit: str = "") -> str:
    if self.low is None:
      return f"{num(self.mean)}{unit} (n={self.count}, no interval)"
    return (
      f"{num(self.mean)}{unit} [{num(self.low)}, {num(self.high)}] "
      f"(n={self.count})"
    )

  def inverted(self) -> Interval:
    """The interval of 1/x, for a positive quantity."""
    return Interval(
      1 / self.mean,
      None if self.high is None else 1 / self.high,
      None if self.low is None else 1 / self.low,
      self.count,
    )

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def mean_interval(
  values, *, geometric: bool = False, confidence: float = 0.95
) -> Interval:
  """Student-t interval of the mean of `values`.

  geometric: the interval of the mean of log(values), mapped back, the
  right average for ratios (a 2x and a 0.5x average to 1x). Values must
  then be positive.
  """
  x = np.asarray([v for v in values if v is not None], np.float64)
  if x.size == 0:
    raise ValueError("mean_interval needs at least one value.")
  if geometric:
    if np.any(x <= 0):
      raise ValueError(f"a geometric mean needs positive values, got {x}.")
    x = np.log(x)
  mean = float(np.mean(x))
  back = np.exp if geometric else (lambda v: v)
  if x.size < 2:
    return Interval(float(back(mean)), None, None, 1)
  # Imported here: scipy.stats takes 0.4 s to import, paid by every
  # process that imports the package (each launcher, each test worker).
  from scipy import stats

  half = float(
    stats.t.ppf(0.5 + confidence / 2, x.size - 1)
    * np.std(x, ddof=1)
    / math.sqrt(x.size)
  )
  return Interval(
    float(back(mean)),
    float(back(mean - half)),
    float(back(mean + half)),
    int(x.size),
  )


def resolution(interval: Interval | None, *, geometric: bool = False) -> str:
  """What an interval could tell apart at its size and spread: the
  smallest difference from a value (0, or a band's edge) it would have
  told apart, its half-width (a factor for a `geometric` interval of
  ratios); with two values, a warning that it rests on one degree of
  freedom. "" without an interval."""
  if interval is None or interval.low is None:
    return ""
  if geometric:
    factor = math.sqrt(interval.high / interval.low)
    text = (
      f"with {interval.count} replicates it tells a ratio apart from a "
      f"band's edge only beyond {factor:.3g}x either side"
    )
  else:
    half = (interval.high - interval.low) / 2
    text = (
      f"with {interval.count} replicates it tells apart a mean difference "
      f"above {half:.3g}"
    )
  if interval.count <= 2:
    text += "; fragile: one degree of freedom (t = 12.7)"
  return text


def goal_verdict(ok: bool) -> str:
  """A goal's verdict as the reports print it."""
  return "**met**" if ok else "**missed**"


def band_verdict(interval: Interval, low: float, high: float) -> str:
  """Whether a claimed band [low, high] holds for an interval.

  "holds": the whole interval lies inside the band; "fails": none of it
  does; "cannot be told apart": it straddles an edge, or there is no
  interval (one value).
  """
  if interval.low is None:
    return "cannot be told apart"
  if low <= interval.low and interval.high <= high:
    return "holds"
  if interval.high < low or interval.low > high:
    return "fails"
  return "cannot be told apart"


def finding_lines(findings: list[str]) -> list[str]:
  """Findings as Markdown paragraphs (a blank line between two)."""
  lines = []
  for finding in findings:
    lines += [f"**Finding.** {finding}", ""]
  return lines[:-1]


def section(
  title: str,
  ran: str,
  body: str,
  findings: list[str],
  plots: list[str] = (),
) -> str:
  """One report section: what ran, the table, the findings, the figures."""
  parts = [f"## {title}", "", f"*What ran:* {ran}", "", body, ""]
  parts += finding_lines(findings)
  for plot in plots:
    parts += ["", f"![{plot.rsplit('.', 1)[0]}]({plot})"]
  return "\n".join(parts) + "\n"


def summarize(rows: list[dict]) -> list[dict]:
  """Rows `{"study", "point_key", "labels", "values", ...}` (one per seed)
  summarized per (study, point, labels): the labels, and the mean, std,
  min and max of every value. Rows missing a value do not count for it;
  no list of metric names is needed, so a new value cannot split a group.
  """
  groups: dict[tuple, list[dict]] = {}
  for row in rows:
    identity = (
      row["study"],
      row["point_key"],
      json.dumps(row["labels"], sort_keys=True),
    )
    groups.setdefault(identity, []).append(row)
  summary = []
  for (study, key, _), members in groups.items():
    out = {"study": study, "point_key": key, **members[0]["labels"]}
    out["n_seeds"] = len(members)
    names = sorted({v for m in members for v in m["values"]})
    for name in names:
      values = [m["values"][name] for m in members if name in m["values"]]
      bad = [
        v
        for v in values
        if isinstance(v, bool) or not isinstance(v, (int, float))
      ]
      if bad:
        raise ValueError(
          f"value {name!r} of {key} is not a number ({bad[0]!r}); a label "
          "belongs in a row's labels."
        )
      arr = np.asarray(values, dtype=np.float64)
      out[f"{name}_mean"] = float(np.mean(arr))
      out[f"{name}_std"] = float(np.std(arr))
      out[f"{name}_min"] = float(np.min(arr))
      out[f"{name}_max"] = float(np.max(arr))
    summary.append(out)
  return summary
