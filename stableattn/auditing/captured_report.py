"""The audit report's section on a model's own tensors: for each captured
step and layer (and head), where it sits (largest logit, near-tie share,
key and value offsets), what the monitor's calibration predicts there,
and the kernel's verdict per rule on it."""

from __future__ import annotations

import numpy as np

from stableattn.auditing import captures, thresholds
from stableattn.auditing.measure import rule_ratio
from stableattn.harness.reporting import table
from stableattn.numerics.rules import RULES


def layer_statistics(layer: captures.CapturedLayer, data=None) -> dict:
  """A captured layer's place: `captures.statistics` (largest logit,
  near-tie share in its own format), the key and value offset ratios of
  the monitor (`offset_ratio`, per head and the largest head's), the
  largest logit per head, and the calibrated kernels the monitor's map
  predicts to miss there (`thresholds.kernels_missing_at`)."""
  t = layer.tensors
  s = captures.logits(t["q"], t["k"], layer.features.get("causal"))
  stats = captures.statistics(layer, scores=s)
  per_head = {
    f"{name}_offset_ratio": captures.offset_ratios(t[x]).tolist()
    for name, x in (("key", "k"), ("value", "v"))
  }
  per_head["max_logit"] = [float(x) for x in np.max(s, axis=(0, 2, 3))]
  data = thresholds.load() if data is None else data
  stats["predicted_misses"] = thresholds.kernels_missing_at(
    stats["max_logit"], data, stats["near_tied_share"]
  )
  return {"label": layer.label, **stats, "per_head": per_head}


def _verdict_cells(rows, label: str, rules) -> list[str]:
  """Per rule, over the layer's tensors: PASS or FAIL with the worst
  value / limit and the tensor it was found on."""
  mine = [r for r in rows if r.get("detail") == label]
  if not mine:
    return ["-"] * len(rules)
  cells = []
  for rule in rules:
    if not any(r.get(f"{rule}_applies", True) for r in mine):
      cells.append("n/a")  # e.g. FlexAttention's 1.1x at FP32
      continue
    worst = max(mine, key=lambda r: rule_ratio(r, rule))
    ok = all(r[f"{rule}_passed"] for r in mine)
    cells.append(
      f"{'pass' if ok else 'FAIL'} {rule_ratio(worst, rule):.2g}x "
      f"({worst['tensor']})"
    )
  return cells


def section(rows, layers: list[dict], gate) -> list[str]:
  """Markdown lines: a table per captured layer and a table per head;
  `layers` from `layer_statistics`, `rows` the audit's (the captured
  ones have regime "captured" and the layer's label as detail)."""
  if not layers:
    return []
  captured = [r for r in rows if r.get("regime") == captures.REGIME]
  rules = [g for g in gate if g in RULES]
  body = []
  policies = sorted({r["policy"] for r in captured}) or ["-"]
  for stats in layers:
    for policy in policies:
      mine = [r for r in captured if r["policy"] == policy]
      body.append(
        [
          stats["label"],
          policy,
          f"{stats['max_logit']:.3g}",
          f"{stats['near_tied_share']:.2f}",
          f"{stats['key_offset_ratio']:.3g}",
          f"{stats['value_offset_ratio']:.3g}",
          ", ".join(stats["predicted_misses"]) or "none",
          *_verdict_cells(mine, stats["label"], rules),
        ]
      )
  heads = []
  for stats in layers:
    ph = stats["per_head"]
    group = len(ph["max_logit"]) // len(ph["key_offset_ratio"])
    for h, logit in enumerate(ph["max_logit"]):
      kv = h // group
      heads.append(
        [
          stats["label"],
          h,
          f"{logit:.3g}",
          f"{ph['key_offset_ratio'][kv]:.3g}",
          f"{ph['value_offset_ratio'][kv]:.3g}",
        ]
      )
  return [
    "",
    "## The model's own tensors, layer by layer",
    "",
    "Each captured step and layer: its largest logit, the share of rows "
    "whose two largest logits tie within an ulp of its format, the key "
    "and value offsets (|mean| / rms spread over tokens, largest head; "
    "FlashAttention-2's backward multiplies a shared key component into "
    "dQ, Qiu & Yao Eq. 1), the calibrated kernels the monitor's map "
    "predicts to miss there, and this kernel's verdict per rule (worst "
    "value / limit over out, dQ, dK, dV).",
    "",
    table(
      [
        "capture",
        "policy",
        "max logit",
        "near-tied",
        "key offset",
        "value offset",
        "monitor predicts misses by",
        *rules,
      ],
      body,
    ),  # fmt: skip
    "",
    "Per query head (the offsets of the KV head it reads):",
    "",
    table(
      ["capture", "head", "max logit", "key offset", "value offset"], heads
    ),
  ]
