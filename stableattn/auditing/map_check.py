"""Does the calibrated 2-D map predict where kernels miss on a model's own
tensors? Each captured layer's largest logit and near-tie share place it
on the map (`thresholds.regions`): a kernel is predicted to miss there if
the point lies in one of its corners' quadrants. The kernel's audit on
the same captured tensors (`launch/audit.py --config.inputs=...`) says
whether it did. A confusion table per kernel counts the four outcomes and
the false-alarm rate (predicted, yet passed, over all that passed).
"""

from __future__ import annotations

import gzip
import json
import pathlib

import numpy as np

from stableattn.auditing import captures, thresholds
from stableattn.harness.reporting import table
from stableattn.numerics.precision import Precision

# What an audit run computed -> its name in the calibration: the audit's
# `kernel` (and `kernel_precision=stable`) with BF16 inputs.
AUDITED = {
  ("pallas", "bf16-framework", False): "pallas bf16-fa2",
  ("pallas", "bf16-framework", True): "pallas bf16-fa2-stable",
  ("pallas", "fp32", False): "pallas fp32",
  ("pallas", "fp32", True): "pallas fp32-stable",
  ("jax_mha", "bf16-framework", False): "jax_mha bf16",
  ("jax_mha", "fp32", False): "jax_mha fp32",
  ("xla", "bf16-framework", False): "xla bf16",
  ("xla", "fp32", False): "xla fp32",
}


def input_format(kernel: str) -> str:
  """The format a calibrated kernel's inputs arrive in (its audit
  policy's), in which a near tie is counted."""
  inputs = thresholds.KERNELS[kernel][2]
  return str(np.dtype(Precision.from_name(inputs).dtype("inputs")))


def layer_points(path, formats=("bfloat16", "float32")) -> dict:
  """{input format: {label: {"max_logit", "near_tied_share"}}} of every
  captured layer under `path`, near ties counted in each format."""
  layers = captures.load(path)
  return {
    fmt: {layer.label: captures.statistics(layer, fmt) for layer in layers}
    for fmt in formats
  }


def audit_misses(audit_dir) -> dict[str, dict[str, bool]]:
  """{calibration kernel name: {layer label: missed a rule}} from one
  audit run's rows on captured tensors (each input policy its own
  kernel)."""
  audit_dir = pathlib.Path(audit_dir)
  config = json.loads((audit_dir / "config.json").read_text())
  stable = config.get("kernel_precision") == "stable"
  out: dict = {}
  rows = audit_dir / "metrics.jsonl"
  if rows.exists():
    text = rows.read_text()
  else:  # as stored under results/
    with gzip.open(rows.with_suffix(".jsonl.gz"), "rt") as f:
      text = f.read()
  for line in text.splitlines():
    row = json.loads(line)
    if row.get("regime") != "captured":
      continue
    name = AUDITED.get((row["kernel"], row["policy"], stable))
    if name is None:
      continue
    missed = bool(
      row["nonfinite"]
      or not row["flashattention_passed"]
      or not row["flexattention_passed"]
    )
    layers = out.setdefault(name, {})
    layers[row["detail"]] = layers.get(row["detail"], False) or missed
  return out


# The confusion table's cells: predicted and missed, predicted but passed,
# missed unpredicted, passed unpredicted.
OUTCOMES = ("hit", "false_alarm", "missed", "quiet")


def _outcome(predicted: bool, measured: bool) -> str:
  """The confusion table's cell of one layer."""
  if predicted:
    return "hit" if measured else "false_alarm"
  return "missed" if measured else "quiet"


def _judged(points: dict, misses: dict, predictors: dict) -> dict[str, dict]:
  """Per kernel with a predictor ({name: point -> predicted}): the layers
  predicted and measured to miss, the four counts and the false-alarm
  rate (None where no layer passed)."""
  out = {}
  for name, measured in misses.items():
    predict = predictors.get(name)
    if predict is None:
      continue
    counts = dict.fromkeys(OUTCOMES, 0)
    layers = {}
    for label, failed in sorted(measured.items()):
      point = points[input_format(name)][label]
      predicted = predict(point)
      counts[_outcome(predicted, failed)] += 1
      layers[label] = {"predicted": predicted, "measured": failed, **point}
    passed = counts["false_alarm"] + counts["quiet"]
    out[name] = {
      **counts,
      "false_alarm_rate": counts["false_alarm"] / passed if passed else None,
      "layers": layers,
    }
  return out


def confusion(points: dict, misses: dict, data) -> dict[str, dict]:
  """The drawn 2-D map judged on captured layers (`_judged`): a kernel is
  predicted to miss where one of its regions' corners holds the layer.
  `points`: `layer_points`' {format: {label: point}}, each kernel read in
  its own input format."""

  def region_holds(region):
    def predict(point):
      found = thresholds.region_of(
        point["max_logit"], point["near_tied_share"], region
      )
      return found is not None

    return predict

  return _judged(
    points,
    misses,
    {name: region_holds(r) for name, r in data["regions"].items()},
  )


def confusion_table(found: dict) -> str:
  """Markdown: per kernel (in the calibration's order), predicted against
  measured misses (and the recall, where the confusion has it)."""
  rows = []
  recall = any("recall" in c for c in found.values())
  for name in sorted(found, key=list(thresholds.KERNELS).index):
    c = found[name]
    rate = c["false_alarm_rate"]
    rows.append(
      [
        name,
        c["hit"],
        c["false_alarm"],
        c["missed"],
        c["quiet"],
        "-" if rate is None else f"{rate:.2f}",
      ]
      + (
        ["-" if c["recall"] is None else f"{c['recall']:.2f}"] if recall else []
      )
    )
  header = [
    "kernel",
    "predicted, missed",
    "predicted, passed (false alarm)",
    "not predicted, missed",
    "not predicted, passed",
    "false-alarm rate",
  ] + (["recall"] if recall else [])
  return table(header, rows)


def _counts(layers, threshold: float) -> dict:
  """The four outcomes of predicting a miss where a layer's near-tie share
  exceeds `threshold`."""
  out = dict.fromkeys(OUTCOMES, 0)
  for layer in layers:
    predicted = layer["near_tied_share"] > threshold
    out[_outcome(predicted, layer["measured"])] += 1
  return out


def held_out_tie_threshold(layers: dict) -> dict:
  """Whether the near-tie share alone predicts a kernel's misses on real
  tensors, without grading on the layers it was fitted to: for each model
  size (a label's first folder), the share threshold that makes the
  fewest errors on the other sizes' layers, judged on that size's. Returns
  {size: {"threshold", "fitted", "held_out"}} and the held-out outcomes
  summed ("total")."""
  sizes = sorted({label.split("/")[0] for label in layers})
  out, total = {}, dict.fromkeys(OUTCOMES, 0)
  for size in sizes:
    fit = [v for k, v in layers.items() if k.split("/")[0] != size]
    test = [v for k, v in layers.items() if k.split("/")[0] == size]
    candidates = sorted({v["near_tied_share"] for v in fit})

    def errors(threshold, fit=fit):
      c = _counts(fit, threshold)
      return c["false_alarm"] + c["missed"], threshold

    threshold = min(candidates, key=errors)
    held = _counts(test, threshold)
    out[size] = {
      "threshold": threshold,
      "fitted": _counts(fit, threshold),
      "held_out": held,
    }
    total = {k: total[k] + held[k] for k in total}
  return {"sizes": out, "total": total}


# A kernel is predicted to miss on a layer whose key offset or near-tie
# share reaches its thresholds.
CAPTURED_AXES = ("key_offset_ratio", "near_tied_share")


def predicted_on_captures(entry: dict, point: dict) -> bool:
  """Whether a captured calibration `entry` predicts a miss at `point`
  (`layer_points`' statistics, or a monitor record's)."""
  return any(point[axis] >= entry[axis] for axis in CAPTURED_AXES)


def fit_captured(points: dict, misses: dict) -> dict:
  """Per kernel: the thresholds that make the fewest errors on captured
  layers (misses and false alarms counted alike). The key offset comes
  first, the axis Qiu & Yao's Eq. 1 names: its threshold alone, the
  highest of those with the fewest errors (fewer alarms); the near-tie
  share joins only where a pair makes strictly fewer errors. A kernel
  that missed nowhere gets infinite thresholds (never predicted); one
  that missed everywhere, 0. Returns {kernel: {"key_offset_ratio",
  "near_tied_share", "layers", "errors"}}."""
  out = {}
  for name, measured in sorted(misses.items()):
    layers = [
      {**points[input_format(name)][label], "measured": failed}
      for label, failed in measured.items()
    ]
    grids = [
      sorted({0.0, float("inf"), *(x[axis] for x in layers)})
      for axis in CAPTURED_AXES
    ]

    def errors(pair, layers=layers):
      entry = dict(zip(CAPTURED_AXES, pair))
      return sum(
        predicted_on_captures(entry, x) != x["measured"] for x in layers
      )

    alone = [(t, float("inf")) for t in grids[0]]
    best = min(alone, key=lambda pair: (errors(pair), -pair[0]))
    if all(x["measured"] for x in layers):
      best = (0.0, float("inf"))  # no layer says where it would pass
    fewest = errors(best)
    scored = [(errors((a, b)), a, b) for a in grids[0] for b in grids[1]]
    better = [s for s in scored if s[0] < fewest]
    if better:
      fewest, *best = min(better, key=lambda s: (s[0], -s[1], -s[2]))
    out[name] = {
      **dict(zip(CAPTURED_AXES, best)),
      "layers": len(layers),
      "errors": fewest,
    }
  return out


def captured_confusion(points: dict, misses: dict, calibration: dict) -> dict:
  """`confusion`'s table for the captured calibration: each kernel's
  thresholds (`fit_captured`) judged on these layers, with the recall
  (None where no layer missed)."""
  found = _judged(
    points,
    misses,
    {
      name: lambda point, entry=entry: predicted_on_captures(entry, point)
      for name, entry in calibration.items()
    },
  )
  for counts in found.values():
    missed = counts["hit"] + counts["missed"]
    counts["recall"] = counts["hit"] / missed if missed else None
  return found


def write_captured(
  calibration: dict, sources, audits, path=thresholds.DATA
) -> None:
  """Stores the captured calibration beside the drawn one in the
  monitor's data (`thresholds.load`), with the command that fitted it."""
  data = thresholds.load(path)
  data["captured"] = {
    "command": "python launch/monitor_map_check.py --fit "
    f"--captures={','.join(map(str, sources))} "
    f"--audits={','.join(map(str, audits))}",
    "captures": [str(s) for s in sources],
    "kernels": {
      name: {k: (None if v == float("inf") else v) for k, v in e.items()}
      for name, e in calibration.items()
    },
  }
  pathlib.Path(path).write_text(json.dumps(data, indent=2) + "\n")


def captured_entries(data) -> dict:
  """{kernel: {"key_offset_ratio", "near_tied_share", ...}} of the
  captured calibration (`fit_captured`, stored by
  `launch/monitor_map_check.py --fit`), a threshold never reached
  stored as null and read back as infinity; {} where none was written."""
  kernels = data.get("captured", {}).get("kernels", {})
  return {
    name: {k: float("inf") if v is None else v for k, v in entry.items()}
    for name, entry in kernels.items()
  }
