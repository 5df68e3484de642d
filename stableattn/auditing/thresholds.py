"""Where each kernel starts missing the audit's rules, by the monitor's
largest logit and near-tie share: the calibration that turns a run's
statistics into a verdict on its kernel.

`sweep` audits each kernel on inputs whose scores have standard deviation
1, 10, 30, ..., 3000 (q and k both scaled by the root), with exact ties
of the largest logit made in a chosen share of rows (0, 10%, 30%, 90%:
tokens repeated, key and value, so the ties survive any rounding), at
two shapes (the edge audit's and a larger one), causal and not, and
records each case's largest logit and near-tie share (measured on the
inputs as the kernel receives them) and which rule each tensor missed.
`thresholds` reads off, per kernel, the smallest largest logit at which
it missed a rule without ties (and the largest at which it still
passed); `regions` the 2-D map: the fewest (largest logit, near-tie
share) corners whose upper-right quadrants hold every case that missed.
`launch/monitor_thresholds.py` writes them to `monitor_thresholds.json`
beside this module, which the training reports read; nothing in it is
typed by hand.
"""

from __future__ import annotations

import itertools
import json
import pathlib

import numpy as np

from stableattn.auditing.captures import CapturedLayer, logits, statistics
from stableattn.auditing.edge_case import EdgeCase
from stableattn.auditing.measure import TENSORS
from stableattn.auditing.regimes import measure_cases
from stableattn.contract.options import Options
from stableattn.numerics.precision import Precision
from stableattn.numerics.rules import RULES
from stableattn.ops.registry import resolve

DATA = pathlib.Path(__file__).with_name("monitor_thresholds.json")
SCORE_STDS = (1.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
# Target shares of rows whose largest logit is tied exactly; the map's
# second axis is the near-tie share the monitor measures on the case.
TIE_SHARES = (0.0, 0.1, 0.3, 0.9)
SHAPES = ((1, 64, 2, 32), (1, 128, 2, 64))
# name -> (registry name, the policy of our implementations (None for a
# peer, which computes its own way), the audit's input policy)
KERNELS = {
  "pallas bf16-fa2": ("pallas", "bf16-fa2", "bf16-framework"),
  "pallas bf16-fa2-stable": ("pallas", "bf16-fa2-stable", "bf16-framework"),
  "pallas fp16-fa2": ("pallas", "fp16-fa2", "fp16-framework"),
  "pallas fp16-fa2-stable": ("pallas", "fp16-fa2-stable", "fp16-framework"),
  "pallas fp32": ("pallas", "fp32", "fp32"),
  "pallas fp32-stable": ("pallas", "fp32-stable", "fp32"),
  "jax_mha bf16": ("jax_mha", None, "bf16-framework"),
  "jax_mha fp32": ("jax_mha", None, "fp32"),
  "jax_splash bf16": ("jax_splash", None, "bf16-framework"),
  "jax_splash fp32": ("jax_splash", None, "fp32"),
  "xla bf16": ("xla", "bf16-framework", "bf16-framework"),
  "xla fp32": ("xla", "fp32", "fp32"),
}


def _case(
  std: float, shape, causal: bool, tie_share: float = 0.0, seed: int = 0
) -> EdgeCase:
  rng = np.random.default_rng(seed)
  scale = np.sqrt(std)
  q = scale * rng.standard_normal(shape)
  k = scale * rng.standard_normal(shape)
  v = rng.standard_normal(shape)
  if tie_share:
    k, v = with_tied_rows(q, k, v, tie_share, causal, rng)
  detail = (
    f"score std {std:g}, ties in {tie_share:.0%} of rows, "
    f"{'causal' if causal else 'full'}"
  )
  return EdgeCase(
    "max_logit", detail, q, k, v, {"causal": True} if causal else {}
  )


def with_tied_rows(q, k, v, share: float, causal: bool, rng):
  """(k, v) with tokens repeated so that about `share` of the rows with
  two keys or more (per batch and head) have their largest logit tied
  exactly: a row's top key and its value are copied over a key that is
  no row's largest, as a repeated token in text holds the same key and
  value twice (the real tensors' ties, docs/results.md). Each copy goes
  to an earlier key, so every row that sees the original sees the copy
  (causal: where no such key is left, the first free key after it, which
  the rows from there on see). q, k, v [B, T, H, D], one KV head per
  query head."""
  k = np.array(k, np.float64)
  v = np.array(v, np.float64)
  s = logits(q, k, causal)  # [B, H, T, S]
  first = 1 if causal else 0  # a causal first row has a single key
  for b, h in np.ndindex(s.shape[0], s.shape[1]):
    winners = np.argmax(s[b, h, first:], axis=-1)
    rows = np.arange(first, s.shape[2])
    free = sorted(set(range(k.shape[1])) - set(winners.tolist()))
    wanted, tied = share * len(winners), 0
    for key in rng.permutation(np.unique(winners)):
      if tied >= wanted or not free:
        break
      earlier = [j for j in free if j < key]
      copy = earlier[-1] if earlier else free[0]
      free.remove(copy)
      k[b, copy, h] = k[b, key, h]
      v[b, copy, h] = v[b, key, h]
      # Rows that see both: all of the key's under full attention.
      seen = rows >= copy if causal else np.ones_like(rows, bool)
      tied += int(np.sum((winners == key) & seen))
  return k, v


def case_statistics(case: EdgeCase, inputs: str) -> dict:
  """The case's largest logit and near-tie share as the monitor measures
  them on q and k rounded to the audit's input format (`inputs`, a
  policy name), which is what the kernel receives."""
  dtype = np.dtype(Precision.from_name(inputs).dtype("inputs"))
  rounded = CapturedLayer(
    step=0,
    layer=0,
    dtype=str(dtype),
    features={"causal": bool(case.features.get("causal"))},
    tensors={
      name: np.asarray(x).astype(dtype).astype(np.float64)
      for name, x in (("q", case.q), ("k", case.k))
    },
  )
  return statistics(rounded)


def sweep(kernels=None, stds=SCORE_STDS, tie_shares=TIE_SHARES) -> list[dict]:
  """One row per kernel, score level, tie share, shape and causality: the
  case's largest logit and near-tie share (as the monitor measures them
  on the rounded inputs), each tensor that missed a rule with the rules
  it missed (FlashAttention's, FlexAttention's, or "nonfinite"), errors,
  and the kernel's refusal where it does not take the shape."""
  rows = []
  for name in kernels or KERNELS:
    registry_name, policy, inputs = KERNELS[name]
    fn = resolve(registry_name, Options(precision=policy) if policy else None)
    cases = itertools.product(stds, tie_shares, SHAPES, (True, False))
    for std, tie_share, shape, causal in cases:
      case = _case(std, shape, causal, tie_share)
      mine, refused, raised = measure_cases(
        fn, Precision.from_name(inputs), [case], 2, TENSORS, RULES
      )
      missed = {}
      for r in mine:
        rules = [
          rule
          for rule, passed in (
            ("nonfinite", not r["nonfinite"]),
            ("flashattention", r["flashattention_passed"]),
            ("flexattention", r["flexattention_passed"]),
          )
          if not passed
        ]
        if rules:
          missed.setdefault(r["tensor"], set()).update(rules)
      rows.append(
        {
          "kernel": name,
          "score_std": std,
          "tie_share": tie_share,
          "shape": list(shape),
          "causal": causal,
          **case_statistics(case, inputs),
          "failed": sorted(missed),
          "missed_rules": {t: sorted(r) for t, r in sorted(missed.items())},
          "errors": len(raised),
          "refused": [n["reason"] for n in refused],
          "worst_fa_ratio": max(
            (
              r["flashattention_value"] / r["flashattention_limit"]
              for r in mine
            ),
            default=None,
          ),
        }
      )
  return rows


def _judged(rows, name) -> list[dict]:
  # A shape the kernel refuses (splash: keys a multiple of 128) says
  # nothing about logits or ties.
  return [r for r in rows if r["kernel"] == name and not r.get("refused")]


def _missed(row) -> bool:
  return bool(row["failed"] or row["errors"])


def thresholds(rows) -> dict:
  """kernel -> {"misses_from": the smallest largest logit at which it
  missed a rule without made ties (None: nowhere swept), "passes_up_to":
  the largest at which it passed every rule below that, "tensors": what
  missed there, "missed_at_or_above": [cases that missed, cases] from
  there on}."""
  out = {}
  for name in dict.fromkeys(r["kernel"] for r in rows):
    mine = sorted(
      (r for r in _judged(rows, name) if not r.get("tie_share")),
      key=lambda r: r["max_logit"],
    )
    first = next((r for r in mine if _missed(r)), None)
    below = [
      r for r in mine if first is None or r["max_logit"] < first["max_logit"]
    ]
    above = [] if first is None else mine[len(below) :]
    out[name] = {
      "misses_from": None if first is None else first["max_logit"],
      "passes_up_to": below[-1]["max_logit"] if below else None,
      "tensors": [] if first is None else first["failed"] or ["error"],
      # Not every case above the threshold misses: how many of them did.
      "missed_at_or_above": [sum(map(_missed, above)), len(above)],
    }
  return out


def regions(rows) -> dict:
  """The 2-D map: kernel -> {"corners": the fewest [largest logit,
  near-tie share] points whose upper-right quadrants (both at or above)
  hold every case that missed, each with the tensors and rules missed in
  its quadrant and [cases that missed, cases] there; "cases", "missed"}.
  A run whose statistics lie in a corner's quadrant is where that kernel
  missed on drawn inputs; how often it misses there is the quadrant's
  share, not a certainty."""
  out = {}
  for name in dict.fromkeys(r["kernel"] for r in rows):
    mine = _judged(rows, name)
    missed = [r for r in mine if _missed(r)]
    points = {(r["max_logit"], r["near_tied_share"]) for r in missed}
    corners = sorted(
      p
      for p in points
      if not any(o != p and o[0] <= p[0] and o[1] <= p[1] for o in points)
    )
    described = []
    for logit, share in corners:
      inside = [
        r
        for r in mine
        if r["max_logit"] >= logit and r["near_tied_share"] >= share
      ]
      what: dict = {}
      for r in inside:
        for tensor, rules in r.get("missed_rules", {}).items():
          what.setdefault(tensor, set()).update(rules)
        if r["errors"]:
          what.setdefault("error", set())
      described.append(
        {
          "max_logit": logit,
          "near_tied_share": share,
          "missed": {t: sorted(r) for t, r in sorted(what.items())},
          "missed_of_cases": [sum(map(_missed, inside)), len(inside)],
        }
      )
    out[name] = {
      "corners": described,
      "cases": len(mine),
      "missed": len(missed),
    }
  return out


def region_of(max_logit: float, near_tied_share: float, region: dict):
  """The corner whose quadrant holds (max_logit, near_tied_share), the
  one with the largest share of missed cases; None outside the map."""
  inside = [
    c
    for c in region["corners"]
    if c["max_logit"] <= max_logit and c["near_tied_share"] <= near_tied_share
  ]
  return max(
    inside,
    key=lambda c: c["missed_of_cases"][0] / max(c["missed_of_cases"][1], 1),
    default=None,
  )


def write(rows, path=DATA) -> dict:
  data = {
    "command": "python launch/monitor_thresholds.py",
    "shapes": [list(s) for s in SHAPES],
    "score_stds": list(SCORE_STDS),
    "tie_shares": list(TIE_SHARES),
    "rows": rows,
    "thresholds": thresholds(rows),
    "regions": regions(rows),
  }
  pathlib.Path(path).write_text(json.dumps(data, indent=2) + "\n")
  return data


def load(path=DATA) -> dict:
  """The stored calibration; {} where none was written."""
  path = pathlib.Path(path)
  return json.loads(path.read_text()) if path.exists() else {}


def kernels_missing_at(
  max_logit: float, data=None, near_tied_share: float | None = None
) -> list[str]:
  """The calibrated kernels that missed a rule at or below `max_logit`
  (and, given the near-tie share and a 2-D map, at or below both)."""
  data = load() if data is None else data
  if near_tied_share is not None and data.get("regions"):
    return [
      name
      for name, region in data["regions"].items()
      if region_of(max_logit, near_tied_share, region) is not None
    ]
  return [
    name
    for name, t in data.get("thresholds", {}).items()
    if t["misses_from"] is not None and t["misses_from"] <= max_logit
  ]


def calibration_name(attention) -> str | None:
  """The calibration's name of a run's attention (`KERNELS`; a training
  `AttentionSpec`): our kernel under its policy, or a peer at its input
  format; None where the calibration has no such kernel (e.g. the
  Baseline, "reference")."""
  implementation = attention.kind
  policy = attention.options.precision.name
  if implementation == "pallas":
    name = f"pallas {policy}"
  else:
    fmt = "fp32" if policy.startswith("fp32") else policy.split("-")[0]
    name = f"{implementation} {fmt}"
  return name if name in KERNELS else None


def table(data) -> str:
  """Markdown: per kernel, the largest logit it passed up to and the one
  from which it missed, with what missed."""

  def logit(x):
    return "-" if x is None else f"{x:.3g}"

  lines = [
    "| kernel | passes up to max logit | misses from max logit | what missed "
    "| cases missing at or above |",
    "|---|---|---|---|---|",
  ]
  for name, t in data["thresholds"].items():
    misses = (
      "nowhere swept" if t["misses_from"] is None else logit(t["misses_from"])
    )
    share = "-"
    if t["misses_from"] is not None:
      share = "{} of {}".format(*t["missed_at_or_above"])
    lines.append(
      f"| {name} | {logit(t['passes_up_to'])} | {misses} | "
      f"{', '.join(t['tensors']) or '-'} | {share} |"
    )
  return "\n".join(lines)


def regions_table(data) -> str:
  """Markdown: per kernel, each corner of its 2-D map (largest logit and
  near-tie share at or above which it missed), what missed there, and how
  many cases in that quadrant missed."""
  lines = [
    "| kernel | from max logit | and near-tie share | what missed (rules) "
    "| cases missing there |",
    "|---|---|---|---|---|",
  ]
  for name, region in data["regions"].items():
    if not region["corners"]:
      lines.append(
        f"| {name} | - | - | nothing, in {region['cases']} cases | - |"
      )
    for c in region["corners"]:
      what = "; ".join(
        f"{t} ({', '.join(r)})" if r else t for t, r in c["missed"].items()
      )
      lines.append(
        f"| {name} | {c['max_logit']:.3g} | {c['near_tied_share']:.2f} | "
        f"{what} | {c['missed_of_cases'][0]} of {c['missed_of_cases'][1]} |"
      )
  return "\n".join(lines)


def plot_regions(data, path) -> pathlib.Path:
  """One panel per kernel: every swept case at its largest logit and
  near-tie share, passed or missed, and the region the corners bound."""
  from stableattn.harness.plotting import plt, save_figure

  names = list(data["regions"])
  columns = 4
  rows_n = -(-len(names) // columns)
  fig, axes = plt.subplots(
    rows_n, columns, figsize=(3.2 * columns, 2.8 * rows_n), squeeze=False
  )
  for ax, name in zip(axes.ravel(), names):
    mine = _judged(data["rows"], name)
    styles = {False: ("o", "tab:green"), True: ("x", "tab:red")}
    for missed, (marker, color) in styles.items():
      points = [r for r in mine if _missed(r) == missed]
      ax.scatter(
        [r["max_logit"] for r in points],
        [r["near_tied_share"] for r in points],
        s=14,
        label="missed" if missed else "passed",
        marker=marker,
        color=color,
      )
    corners = data["regions"][name]["corners"]
    if corners:
      top = max(r["max_logit"] for r in mine) * 2
      xs, ys = [], []
      for c in sorted(corners, key=lambda c: c["max_logit"]):
        xs += [c["max_logit"], c["max_logit"]]
        ys += [ys[-1] if ys else 1.0, c["near_tied_share"]]
      ax.fill_between(
        xs + [top], ys + [ys[-1]], 1.0, step=None, color="tab:red", alpha=0.12
      )
    ax.set_xscale("log")
    ax.set_ylim(-0.03, 1.0)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("largest logit", fontsize=8)
    ax.set_ylabel("near-tied share", fontsize=8)
  for ax in axes.ravel()[len(names) :]:
    ax.axis("off")
  axes.ravel()[0].legend(fontsize=7)
  return save_figure(fig, path)
