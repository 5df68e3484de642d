"""The sweep's figure: the ratio against parameters and against context,
one colour per reference, each size's interval and the fit with its band."""

from __future__ import annotations

import collections
import pathlib

import numpy as np

from stableattn.experiments.plotting import plt, save_figure

PANELS = (("parameters", "context"), ("context", "parameters"))


def _held_value(ratios, held: str):
  """The value of the held axis that most sizes share (the axis's line)."""
  sizes = {(r[held], r["size"]) for r in ratios}
  per_value = collections.Counter(value for value, _ in sizes)
  return per_value.most_common(1)[0][0] if per_value else None


def write_figure(path, ratios, trends, per_size) -> pathlib.Path:
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), dpi=110)
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, (axis, held) in zip(axes, PANELS):
    value = _held_value(ratios, held)
    for colour, (ref, trend) in zip(colours, trends.items()):
      points = sorted(
        {(r[axis], r["size"]) for r in ratios
         if r["reference"] == ref and r[held] == value}
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
        fitted = [trend.at(**{axis: x, held: value}) for x in xs]
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
      title=f"against {axis} ({held} {value})",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  return save_figure(fig, path)
