"""Small matplotlib helpers: log-scale line and bar plots saved as PNG."""

from __future__ import annotations

import dataclasses
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@dataclasses.dataclass
class Series:
  label: str
  x: list
  y: list
  y_err: list | None = None  # symmetric spread (e.g. std), drawn as a band

  @classmethod
  def from_points(cls, label: str, points) -> Series:
    """A series from (x, y) pairs, sorted by x."""
    points = sorted(points)
    return cls(label, [x for x, _ in points], [y for _, y in points])


def save_figure(fig, path, *, tight_box: bool = False) -> pathlib.Path:
  """Writes the PNG and frees the figure; `tight_box` crops to the content
  (figures whose colour bar sits outside the axes grid)."""
  if tight_box:
    fig.savefig(path, bbox_inches="tight")
  else:
    fig.tight_layout()
    fig.savefig(path)
  plt.close(fig)
  return pathlib.Path(path)


def _positive(values):
  return [v if v is not None and v > 0 else float("nan") for v in values]


def line_plot(
  path: str | pathlib.Path,
  series: list[Series],
  *,
  title: str,
  xlabel: str,
  ylabel: str,
  logx: bool = True,
  logy: bool = True,
) -> pathlib.Path:
  if logy:
    # A series with no positive value (an exact-zero control) has no place
    # on a log axis: say so in the legend instead of failing to draw it.
    shown = [s for s in series if any(v and v > 0 for v in s.y)]
    zero = [s.label for s in series if s not in shown]
    if not shown:
      logy = False
    else:
      series = shown
      if zero:
        title += f"\n({', '.join(zero)}: 0 throughout, not drawn)"
  crowded = len(series) > 4  # the legend goes beside the axes, not on them
  fig, ax = plt.subplots(figsize=(8.6 if crowded else 6.4, 4.2), dpi=110)
  for s in series:
    y = _positive(s.y) if logy else s.y
    (line,) = ax.plot(s.x, y, marker="o", label=s.label)
    if s.y_err is not None:
      low = [v - e for v, e in zip(s.y, s.y_err)]
      high = [v + e for v, e in zip(s.y, s.y_err)]
      if logy:  # a band reaching zero has no place on a log axis
        low = [max(lo, v / 10) for lo, v in zip(low, s.y)]
      ax.fill_between(s.x, low, high, color=line.get_color(), alpha=0.15)
  if logx:
    ax.set_xscale("log", base=2)
  if logy:
    ax.set_yscale("log")
  ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
  ax.grid(True, which="both", alpha=0.3)
  if series and crowded:
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  elif series:
    ax.legend(fontsize=8)
  return save_figure(fig, path)


def line_panels(
  path: str | pathlib.Path,
  panels: dict[str, list[Series]],
  *,
  title: str,
  xlabel: str,
  ylabel: str,
  columns: int = 2,
  logy: bool = False,
  sharey: bool = False,
) -> pathlib.Path:
  """One small line plot per panel (log2 x; log y if `logy`; one y axis
  for all if `sharey`), each label one colour in all panels, one legend
  for the figure."""
  rows = -(-len(panels) // columns)
  fig, axes = plt.subplots(
    rows,
    columns,
    figsize=(4.2 * columns, 2.9 * rows),
    dpi=110,
    squeeze=False,
    sharex=True,
    sharey=sharey,
  )
  labels = sorted({s.label for group in panels.values() for s in group})
  colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
  for ax, (name, group) in zip(axes.flat, panels.items()):
    for s in group:
      ax.plot(s.x, s.y, marker="o", color=colours[s.label], label=s.label)
    ax.set_xscale("log", base=2)
    if logy:
      ax.set_yscale("log")
    ax.set_title(name, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
  for ax in axes.flat[len(panels) :]:
    ax.set_visible(False)
  for ax in axes[:, 0]:
    ax.set_ylabel(ylabel)
  for ax in axes[-1]:
    ax.set_xlabel(xlabel)
  handles = [
    plt.Line2D([], [], color=colours[label], marker="o") for label in labels
  ]
  # As many legend columns as the figure's width holds (about 100
  # characters at 8.4 inches; a column is as wide as its longest label),
  # the panels raised above the legend's lines.
  column = max(len(label) for label in labels) + 8
  per_line = max(1, min(len(labels), 100 * columns // (2 * column)))
  lines = -(-len(labels) // per_line)
  fig.legend(handles, labels, loc="lower center", ncol=per_line)
  fig.suptitle(title)
  fig.tight_layout(rect=(0, 0.01 + lines * 0.3 / (2.9 * rows), 1, 1))
  fig.savefig(path)
  plt.close(fig)
  return pathlib.Path(path)


def _grouped_bars(ax, labels, groups: dict[str, list], *, rotation: int):
  """One bar per group at each label, the label under the group's middle."""
  width = 0.8 / max(1, len(groups))
  for i, (name, values) in enumerate(groups.items()):
    xs = [j + i * width for j in range(len(labels))]
    ax.bar(xs, values, width, label=name)
  ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(labels))])
  ax.set_xticklabels(labels, rotation=rotation, ha="right", fontsize=7)


def bar_plot(
  path: str | pathlib.Path,
  labels: list[str],
  groups: dict[str, list[float]],
  *,
  title: str,
  ylabel: str,
  logy: bool = True,
  reference_line: float | None = None,
  legend_outside: bool = False,
) -> pathlib.Path:
  """Grouped bars: one bar per group at each label."""
  fig, ax = plt.subplots(
    figsize=(max(6.4, 0.55 * len(labels) + 2), 4.4), dpi=110
  )
  if logy:
    groups = {name: _positive(values) for name, values in groups.items()}
  _grouped_bars(ax, labels, groups, rotation=35)
  if logy:
    ax.set_yscale("log")
  if reference_line is not None:
    ax.axhline(reference_line, color="black", linewidth=0.8, linestyle="--")
  ax.set(title=title, ylabel=ylabel)
  ax.grid(True, axis="y", which="both", alpha=0.3)
  if len(groups) > 1 and legend_outside:
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return save_figure(fig, path, tight_box=True)
  if len(groups) > 1:
    ax.legend(fontsize=8)
  return save_figure(fig, path)


def signed_share_panels(
  path: str | pathlib.Path,
  panels: dict[str, tuple[list[str], dict[str, list[float]]]],
  *,
  title: str,
) -> pathlib.Path:
  """Grouped bars of a share in [-1, 1], one panel per title, stacked."""
  n = max(1, len(panels))
  width_in = max(
    6.4, 0.5 * max((len(lbl) for lbl, _ in panels.values()), default=0) + 2
  )
  fig, axes = plt.subplots(
    n, 1, figsize=(width_in, 2.6 * n + 0.8), dpi=110, sharey=True, squeeze=False
  )
  for ax, (panel, (labels, groups)) in zip(axes[:, 0], panels.items()):
    _grouped_bars(ax, labels, groups, rotation=30)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_title(panel, fontsize=9)
    ax.set_ylabel("signed share")
    ax.grid(True, axis="y", alpha=0.3)
  axes[0, 0].legend(fontsize=7, loc="lower left")
  fig.suptitle(title, fontsize=10)
  return save_figure(fig, path)


def ratio_heatmaps(
  path: str | pathlib.Path,
  panels: dict[str, tuple[list[str], list[str], list[list[float]]]],
  *,
  title: str,
  mark_at: float | None = None,
) -> pathlib.Path:
  """One annotated heatmap (log colour scale) per panel, side by side.

  Each panel is (row labels, column labels, values[row][column]); panels
  share their rows, labelled on the first. A value >= `mark_at` is bold.
  """
  import numpy as np
  from matplotlib.colors import LogNorm

  values = [v for _, _, m in panels.values() for row in m for v in row if v > 0]
  norm = LogNorm(vmin=min(values), vmax=max(values)) if values else None
  n = max(1, len(panels))
  rows = max((len(r) for r, _, _ in panels.values()), default=1)
  fig, axes = plt.subplots(
    1,
    n,
    figsize=(2.6 * n + 3.4, 0.45 * rows + 1.8),
    dpi=110,
    squeeze=False,
    sharey=True,
  )
  image = None
  for index, (ax, (panel, (row_labels, col_labels, matrix))) in enumerate(
    zip(axes[0], panels.items())
  ):
    data = np.asarray(matrix, float)
    image = ax.imshow(data, cmap="viridis", norm=norm, aspect="auto")
    ax.set_xticks(range(len(col_labels)), col_labels, fontsize=8)
    ax.set_xlabel("sequence length", fontsize=8)
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=7)
    if index:
      ax.tick_params(axis="y", labelleft=False)
    ax.set_title(panel, fontsize=9)
    for i in range(data.shape[0]):
      for j in range(data.shape[1]):
        value = data[i, j]
        bold = mark_at is not None and value >= mark_at
        ax.text(
          j,
          i,
          f"{value:.3g}",
          ha="center",
          va="center",
          fontsize=7,
          color="white" if norm is None or norm(value) < 0.6 else "black",
          fontweight="bold" if bold else "normal",
        )
  if image is not None:
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.9)
  fig.suptitle(title, fontsize=10)
  return save_figure(fig, path, tight_box=True)


def interval_plot(
  path: str | pathlib.Path,
  labels: list[str],
  intervals: list,
  *,
  title: str,
  ylabel: str,
  logy: bool = True,
) -> pathlib.Path:
  """One mean with its interval per label (`reporting.Interval`s); a mean
  of 0 (an exact control) is named in the title, not drawn on a log axis."""
  shown = [
    (label, i)
    for label, i in zip(labels, intervals)
    if not logy or (i.mean and i.mean > 0)
  ]
  zero = [
    label for label, i in zip(labels, intervals) if (label, i) not in shown
  ]
  if zero:
    title += f"\n({', '.join(zero)}: 0, not drawn)"
  fig, ax = plt.subplots(figsize=(max(6.4, 0.7 * len(shown) + 2), 4.4), dpi=110)
  for x, (_, i) in enumerate(shown):
    low = i.mean if i.low is None else i.low
    high = i.mean if i.high is None else i.high
    if logy:
      low = max(low, i.mean / 10)
    ax.errorbar(
      [x], [i.mean], yerr=[[i.mean - low], [high - i.mean]], fmt="o", capsize=4
    )
  ax.set_xticks(range(len(shown)))
  ax.set_xticklabels([label for label, _ in shown], rotation=35, ha="right")
  if logy:
    ax.set_yscale("log")
  ax.set(title=title, ylabel=ylabel)
  ax.grid(True, axis="y", which="both", alpha=0.3)
  return save_figure(fig, path)
