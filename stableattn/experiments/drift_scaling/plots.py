"""The sweep's figure: the ratio against parameters, context and (where
the fixed-step arm separates it) steps, the other axes held; one colour
per reference, each unit's interval and the fit with its band."""

from __future__ import annotations

import collections
import pathlib

import numpy as np

from stableattn.experiments.drift_scaling.trend import AXES
from stableattn.harness.plotting import plt, save_figure
from stableattn.harness.reporting import num


def _held_values(ratios, axis: str, held: list[str]) -> dict:
  """The other axes' values at which the most units differ in `axis`
  (ties: the most units), so each panel's line is a slice of the fit."""
  units = {(tuple(r[h] for h in held), r[axis], r["size"]) for r in ratios}
  spread = collections.defaultdict(set)
  count = collections.Counter()
  for values, x, _ in units:
    spread[values].add(x)
    count[values] += 1
  if not spread:
    return {}
  best = max(spread, key=lambda v: (len(spread[v]), count[v]))
  return dict(zip(held, best))


def _panels(ratios, trends) -> list[str]:
  fitted = {a for t in trends.values() if t is not None for a in t.slopes}
  return [a for a in AXES if a in fitted or (a != "steps" and ratios)]


def write_figure(path, ratios, trends, per_size) -> pathlib.Path:
  ratios = [r for r in ratios if all(a in r for a in AXES)]
  panels = _panels(ratios, trends) or ["parameters"]
  fig, axes = plt.subplots(
    1, len(panels), figsize=(5.5 * len(panels), 4.4), dpi=110, squeeze=False
  )
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, axis in zip(axes[0], panels):
    held = _held_values(ratios, axis, [a for a in AXES if a != axis])
    for colour, (ref, trend) in zip(colours, trends.items()):
      points = sorted(
        {(r[axis], r["size"]) for r in ratios
         if r["reference"] == ref
         and all(r[h] == v for h, v in held.items())}
      )  # fmt: skip
      for x, size in points:
        cell = per_size[size][ref]
        low = cell["mean"] if cell["low"] is None else cell["low"]
        high = cell["mean"] if cell["high"] is None else cell["high"]
        ax.errorbar(
          [x], [cell["mean"]],
          yerr=[[cell["mean"] - low], [high - cell["mean"]]],
          fmt="o", color=colour, capsize=4,
        )  # fmt: skip
      if trend is not None and axis in trend.slopes and len(points) >= 2:
        xs = np.geomspace(points[0][0], points[-1][0], 40)
        fitted = [trend.at(**{**held, axis: x}) for x in xs]
        mean, low, high = (np.array(v) for v in zip(*fitted))
        ax.plot(xs, mean, color=colour, label=f"over {ref}")
        ax.fill_between(xs, low, high, color=colour, alpha=0.15)
      elif points:
        ax.plot([], [], "o", color=colour, label=f"over {ref} (no fit)")
    ax.axhline(1.0, color="0.5", lw=0.8, ls=":")
    ax.set(
      xscale="log",
      yscale="log",
      xlabel=axis,
      ylabel="Flash vs Baseline drift / reference drift",
      title=f"against {axis} ("
      + ", ".join(f"{h} {num(v)}" for h, v in held.items())
      + ")",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  return save_figure(fig, path)
