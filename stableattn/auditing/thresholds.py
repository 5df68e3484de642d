"""Where each kernel starts missing the audit's rules, by the monitor's
largest logit: the calibration that turns a run's `max_logit` into a
verdict on its kernel.

`sweep` audits each kernel on inputs whose scores have standard deviation
1, 10, 30, ..., 3000 (q and k both scaled by the root), at two shapes
(the edge audit's and a larger one), causal and not, and records each
case's largest logit and what failed; `thresholds` reads off,
per kernel, the smallest largest logit at which it missed a rule (and the
largest at which it still passed). `launch/monitor_thresholds.py` writes
them to `monitor_thresholds.json` beside this module, which the training
reports read; nothing in it is typed by hand.
"""

from __future__ import annotations

import itertools
import json
import pathlib

import numpy as np

from stableattn.auditing.captures import logits
from stableattn.auditing.edge_case import EdgeCase
from stableattn.auditing.measure import TENSORS
from stableattn.auditing.regimes import measure_cases
from stableattn.contract.options import Options
from stableattn.numerics.precision import Precision
from stableattn.numerics.rules import RULES
from stableattn.ops.registry import resolve

DATA = pathlib.Path(__file__).with_name("monitor_thresholds.json")
SCORE_STDS = (1.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
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


def _case(std: float, shape, causal: bool, seed: int = 0) -> EdgeCase:
  rng = np.random.default_rng(seed)
  scale = np.sqrt(std)
  q = scale * rng.standard_normal(shape)
  k = scale * rng.standard_normal(shape)
  v = rng.standard_normal(shape)
  detail = f"score std {std:g}, {'causal' if causal else 'full'}"
  return EdgeCase(
    "max_logit", detail, q, k, v, {"causal": True} if causal else {}
  )


def _max_logit(case: EdgeCase) -> float:
  return float(np.max(logits(case.q, case.k, case.features.get("causal"))))


def sweep(kernels=None, stds=SCORE_STDS) -> list[dict]:
  """One row per kernel, score level, shape and causality: the case's
  largest logit, the tensors that missed a rule (FlashAttention's or
  FlexAttention's) or were not finite, errors, and the kernel's refusal
  where it does not take the shape."""
  rows = []
  for name in kernels or KERNELS:
    registry_name, policy, inputs = KERNELS[name]
    fn = resolve(registry_name, Options(precision=policy) if policy else None)
    for std, shape, causal in itertools.product(stds, SHAPES, (True, False)):
      case = _case(std, shape, causal)
      mine, refused, raised = measure_cases(
        fn, Precision.from_name(inputs), [case], 2, TENSORS, RULES
      )
      failed = sorted(
        {
          r["tensor"]
          for r in mine
          if r["nonfinite"]
          or not (r["flashattention_passed"] and r["flexattention_passed"])
        }
      )
      rows.append(
        {
          "kernel": name,
          "score_std": std,
          "shape": list(shape),
          "causal": causal,
          "max_logit": _max_logit(case),
          "failed": failed,
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


def thresholds(rows) -> dict:
  """kernel -> {"misses_from": the smallest largest logit at which it
  missed a rule (None: nowhere swept), "passes_up_to": the largest at
  which it passed every rule below that, "tensors": what missed there,
  "missed_at_or_above": [cases that missed, cases] from there on}."""
  out = {}
  for name in dict.fromkeys(r["kernel"] for r in rows):
    # A shape the kernel refuses (splash: keys a multiple of 128) says
    # nothing about logits.
    mine = sorted(
      (r for r in rows if r["kernel"] == name and not r.get("refused")),
      key=lambda r: r["max_logit"],
    )
    first = next((r for r in mine if r["failed"] or r["errors"]), None)
    below = [
      r for r in mine if first is None or r["max_logit"] < first["max_logit"]
    ]
    above = [] if first is None else mine[len(below) :]
    out[name] = {
      "misses_from": None if first is None else first["max_logit"],
      "passes_up_to": below[-1]["max_logit"] if below else None,
      "tensors": [] if first is None else first["failed"] or ["error"],
      # Not every case above the threshold misses: how many of them did.
      "missed_at_or_above": [
        sum(bool(r["failed"] or r["errors"]) for r in above),
        len(above),
      ],
    }
  return out


def write(rows, path=DATA) -> dict:
  data = {
    "command": "python launch/monitor_thresholds.py",
    "shapes": [list(s) for s in SHAPES],
    "score_stds": list(SCORE_STDS),
    "rows": rows,
    "thresholds": thresholds(rows),
  }
  pathlib.Path(path).write_text(json.dumps(data, indent=2) + "\n")
  return data


def load(path=DATA) -> dict:
  """The stored calibration; {} where none was written."""
  path = pathlib.Path(path)
  return json.loads(path.read_text()) if path.exists() else {}


def kernels_missing_at(max_logit: float, data=None) -> list[str]:
  """The calibrated kernels that missed a rule at or below `max_logit`."""
  data = load() if data is None else data
  return [
    name
    for name, t in data.get("thresholds", {}).items()
    if t["misses_from"] is not None and t["misses_from"] <= max_logit
  ]


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
