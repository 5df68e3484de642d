"""The stability sweep at several model sizes: does Flash's effect grow?

Each size ("w<width>-d<depth>", at the configured context) is the whole
sweep in `<workdir>/sizes/<size>`: a unit of work, spread over shards and
resumed like the drift-scaling sweep's. From every size's verdicts, the
report puts Flash's change of the learning-rate sensitivity (paired by
replicate against Baseline) beside the two reference changes (BF16 against
FP32 training, Baseline on another machine), and fits each change's size
per replicate, |difference|, against log10(parameters): a slope judged
from three or more sizes, with a Student-t interval.
"""

from __future__ import annotations

import json
import re

import numpy as np

from stableattn.experiments.drift_scaling.sizes import ModelSize
from stableattn.experiments.drift_scaling.trend import MIN_DISTINCT, Slope
from stableattn.experiments.shards import run_units
from stableattn.harness import environment
from stableattn.harness.plotting import plt, save_figure
from stableattn.harness.reporting import finding_lines, num, table
from stableattn.harness.rundir import RunDir

_SIZE = re.compile(r"^w(\d+)-d(\d+)$")
# A sweep over sizes may grow by sizes and replicates.
EXTENDABLE = ("sizes", "train.replicates")


def sizes_of(config) -> list[tuple[str, ModelSize]]:
  """(name, size) of each configured size, at the configured context."""
  out = []
  head_dim = int(config.size_head_dim)
  for text in [t.strip() for t in str(config.sizes).split(",") if t.strip()]:
    match = _SIZE.match(text)
    if match is None:
      raise ValueError(
        f"config.sizes: {text!r} is not 'w<width>-d<depth>', e.g. 'w96-d3'."
      )
    width, depth = (int(g) for g in match.groups())
    if width < 1 or depth < 1 or width % head_dim:
      raise ValueError(
        f"config.sizes: {text!r} needs width and depth >= 1 and a width "
        f"that is a multiple of config.size_head_dim ({head_dim})."
      )
    size = ModelSize(
      width, depth, int(config.model.seq_len), int(config.model.mlp_ratio)
    )
    out.append((text, size))
  names = [n for n, _ in out]
  if len(set(names)) != len(names):
    raise ValueError(f"config.sizes names a size twice: {names}.")
  return out


def unit_config(config, size: ModelSize):
  """One size's sweep: the config with that model and no sizes."""
  c = config.copy_and_resolve_references()
  c.sizes, c.shard, c.workers = "", "1/1", 1
  c.model.width, c.model.depth = size.width, size.depth
  c.model.heads = size.width // int(config.size_head_dim)
  return c


def run(config, workdir, run_one, *, restart: bool = False) -> dict:
  """Sweeps this shard's sizes with `run_one` (the one-model sweep), then,
  once every size is done, writes the report across sizes."""
  sizes = sizes_of(config)
  if len(sizes) < 2:
    raise ValueError(
      f"config.sizes names {len(sizes)} size(s); a comparison across sizes "
      "needs two or more (three for a trend), or sizes='' for one model."
    )

  def train(index, directory):
    name, size = sizes[index]
    run_one(unit_config(config, size), directory, restart=restart)
    return _size_row(name, size)

  def report(run_dir, rows):
    return write_report(run_dir, rows, precision_label(config))

  return run_units(
    run_one,
    config,
    workdir,
    [name for name, _ in sizes],
    train,
    report,
    restart=restart,
    extendable=EXTENDABLE,
  )


def _size_row(name: str, size: ModelSize) -> dict:
  return {
    "kind": "size",
    "size": name,
    "width": size.width,
    "depth": size.depth,
    "context": size.context,
    "parameters": size.parameters,
  }


def precision_label(config) -> str:
  """How the training-precision reference is named: "BF16 vs FP32
  training" under the default formats."""
  return (
    f"{str(config.train.precision).upper()} vs "
    f"{str(config.train.reference_precision).upper()} training"
  )


def changes_of(headline: dict, precision: str) -> dict[str, dict]:
  """{label: comparison} of one size: each variant against Baseline and
  the two reference changes, as the one-model report judged them."""
  verdicts = headline["verdicts"]
  out = dict(verdicts["variants"])
  for kind, label in (("precision", precision),
                      ("machine", "Baseline on another machine")):  # fmt: skip
    for mitigation, comparison in verdicts[kind].items():
      out[f"{label} ({mitigation})"] = comparison
  return out


def size_trend(points: list[tuple[float, float]]) -> dict | None:
  """Slope of |difference| per replicate against log10(parameters), with
  its 95% interval and verdict; None with fewer than 3 points."""
  if len(points) < 3:
    return None
  x = np.log10([p for p, _ in points])
  y = np.abs([d for _, d in points])
  from scipy import stats  # 1-2 s to import: only where a slope is fitted

  fit = stats.linregress(x, y)
  half = float(stats.t.ppf(0.975, len(points) - 2) * fit.stderr)
  slope = Slope(
    "parameters",
    float(fit.slope),
    float(fit.slope - half),
    float(fit.slope + half),
    len(set(x.tolist())),
  )
  return {
    "slope": slope.estimate,
    "low": slope.low,
    "high": slope.high,
    "verdict": slope.verdict,
    "points": len(points),
  }


def write_report(run_dir: RunDir, size_rows: list[dict], precision) -> dict:
  per_size, changes = {}, {}
  for row in size_rows:
    unit = run_dir.path / "sizes" / row["size"]
    per_size[row["size"]] = json.loads((unit / "headline.json").read_text())
    changes[row["size"]] = changes_of(per_size[row["size"]], precision)
  labels = list(dict.fromkeys(label for c in changes.values() for label in c))
  trends = {}
  for label in labels:
    points = [
      (row["parameters"], d)
      for row in size_rows
      for d in changes[row["size"]]
      .get(label, {})
      .get("lr_sensitivity_per_replicate", [])
    ]
    trends[label] = size_trend(points)
  figure = _figure(
    run_dir.path / "stability_sizes.png", size_rows, changes, labels
  )
  result = {
    "workdir": str(run_dir.path),
    "sizes": size_rows,
    "changes": changes,
    "largest_stable_lr": {
      name: {a: h["arms"][a]["largest_stable_lr"] for a in h["arms"]}
      for name, h in per_size.items()
    },
    "trends": trends,
    "environment": environment.describe(),
  }
  run_dir.rewrite_metrics(size_rows)
  run_dir.write_text("headline.json", json.dumps(result, indent=2) + "\n")
  text = _markdown(
    size_rows, per_size, changes, trends, figure.name, result["environment"]
  )
  run_dir.write_text("report.md", "\n".join(text) + "\n")
  return result


def _interval_text(d: dict | None) -> str:
  if not d:
    return "-"
  if d.get("low") is None:
    return f"{num(d['mean'])} (n=1)"
  return f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def _ratio_text(d: dict | None) -> str:
  if not d or d.get("low") is None:
    return "-"
  return f"{num(d['mean'])}x [{num(d['low'])}, {num(d['high'])}]"


def _changes_table(size_rows, changes, labels) -> str:
  rows = []
  for row in size_rows:
    for label in labels:
      c = changes[row["size"]].get(label)
      if c is None:
        continue
      ratios = c.get("spread_ratio", {})
      rows.append(
        [row["size"], num(row["parameters"]), label,
         _interval_text(c["lr_sensitivity_difference"]),
         "; ".join(f"{_ratio_text(v)} of {k}" for k, v in ratios.items())
         or "-"]
      )  # fmt: skip
  header = ["size", "parameters", "change", "difference",
            "RMS over the references'"]  # fmt: skip
  return table(header, rows)


def _markdown(size_rows, per_size, changes, trends, figure, env) -> list[str]:
  labels = list(trends)
  first = next(iter(per_size.values()))
  lines = [
    "# Training stability across sizes",
    "",
    "Each size is the whole stability sweep (`sizes/<size>/report.md`): "
    f"learning rates {first['learning_rates']}, {first['replicates']} "
    "replicates. A change is a paired difference of Wortsman et al.'s "
    "learning-rate sensitivity, per replicate, with a 95% interval over "
    "replicates; the ratios are root-mean-square differences over the "
    "reference's, with F intervals.",
    "",
    "## Changes of the learning-rate sensitivity, per size",
    "",
  ]
  lines += [
    _changes_table(size_rows, changes, labels),
    "",
    "## Largest stable learning rate, per arm (geometric mean)",
    "",
  ]
  arms = list(first["arms"])
  lines += [
    table(
      ["size"] + arms,
      [
        [name] + [num(h["arms"][a]["largest_stable_lr"]["mean"]) for a in arms]
        for name, h in per_size.items()
      ],
    ),
    "",
    "## Does the change grow with size?",
    "",
    "|difference| per replicate against log10(parameters), least squares; "
    "the slope is the change in sensitivity per 10x parameters, 95% "
    f"interval, judged from {MIN_DISTINCT} or more sizes.",
    "",
    table(
      ["change", "slope per 10x parameters", "verdict", "values"],
      [
        [label, "-", "fewer than 3 values", "-"]
        if t is None
        else [
          label,
          f"{t['slope']:+.4f} [{t['low']:+.4f}, {t['high']:+.4f}]",
          f"**{t['verdict']}**",
          t["points"],
        ]  # fmt: skip
        for label, t in trends.items()
      ],
    ),
    "",
  ]
  parameters = [r["parameters"] for r in size_rows]
  lines += finding_lines(
    [
      f"The sizes span {num(max(parameters) / min(parameters))}x in parameters."
    ]  # fmt: skip
    + [
      f"{label}: |change| with size **{t['verdict']}** "
      f"({t['slope']:+.4f} [{t['low']:+.4f}, {t['high']:+.4f}] per 10x)."
      for label, t in trends.items()
      if t is not None
    ]
  )
  lines += [
    "",
    f"![|change| of the sensitivity against parameters]({figure})",
    "",
    environment.summary_line(env),
  ]
  return lines


def _figure(path, size_rows, changes, labels):
  fig, ax = plt.subplots(figsize=(6.5, 4.4), dpi=110)
  colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for k, (label, colour) in enumerate(zip(labels, colours)):
    shift = 1.0 + 0.04 * (k - (len(labels) - 1) / 2)  # side by side
    xs, means = [], []
    for row in size_rows:
      c = changes[row["size"]].get(label)
      if c is None:
        continue
      values = np.abs(c["lr_sensitivity_per_replicate"])
      x = row["parameters"] * shift
      ax.scatter([x] * len(values), values, color=colour, alpha=0.35, s=12)
      xs.append(x)
      means.append(float(values.mean()))
    ax.plot(xs, means, "o-", color=colour, label=f"{label} (mean)")
  ax.set(
    xscale="log",
    xlabel="parameters (non-embedding)",
    ylabel="|change of LR sensitivity| per replicate",
    title="Stability across sizes: each change against size",
  )
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  return save_figure(fig, path)


def before_after_tables(now: dict, before: dict) -> str:
  """Two stored sweeps across sizes side by side, as docs/results.md
  quotes them: each change's learning-rate-sensitivity difference per
  size (now, then before), and each change's trend with size."""
  labels = list(now["trends"])
  rows = [
    [row["size"], num(row["parameters"])]
    + [
      _interval_text(
        sweep["changes"]
        .get(row["size"], {})
        .get(label, {})
        .get("lr_sensitivity_difference")
      )
      for label in labels
      for sweep in (now, before)
    ]
    for row in now["sizes"]
  ]
  header = ["size", "parameters"] + [
    f"{label}{when}" for label in labels for when in ("", ", before")
  ]
  trend_rows = [
    [label, when]
    + (
      [
        f"{t['slope']:+.4f} [{t['low']:+.4f}, {t['high']:+.4f}]",
        t["verdict"],
      ]
      if (t := sweep["trends"].get(label))
      else ["-", "-"]
    )
    for label in labels
    for when, sweep in (("now", now), ("before", before))
  ]
  trend_header = ["change", "run", "slope of |difference| per 10x parameters",
                  "verdict"]  # fmt: skip
  return table(header, rows) + "\n\n" + table(trend_header, trend_rows)
