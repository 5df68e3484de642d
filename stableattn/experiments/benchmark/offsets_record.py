"""The offsets stage of a GPU session (`launch/gpu_session.sh`): each
kernel's audit of the `key_offset` regime and the `key_shift` invariance,
as the table docs/performance.md quotes.

A record's `offsets/<name>.jsonl` holds one audit's rows (`launch/audit.py
--config.regimes=key_offset --config.invariances=key_shift`, BF16).
"""

from __future__ import annotations

from stableattn.auditing.measure import rule_ratio
from stableattn.harness.reporting import table

RULES = ("flashattention", "flexattention")
# The rows a stage's table reads: the base grid, the regime, the invariance.
REGIMES = ("none", "key_offset", "key_shift")


def _worst(rows, rule: str, tensors) -> str:
  """The largest (value / limit) of `rule` over `tensors`' rows, and the
  tensor it is on; '-' where none applies."""
  found = [
    (rule_ratio(r, rule), r["tensor"])
    for r in rows
    if r["tensor"] in tensors and r.get(f"{rule}_applies")
  ]
  if not found:
    return "-"
  ratio, tensor = max(found)
  return f"{ratio:.3g}x ({tensor})"


def _passed(rows) -> bool:
  return all(
    r.get(f"{rule}_passed", True) or not r.get(f"{rule}_applies")
    for r in rows
    for rule in RULES
  ) and not any(r.get("nonfinite") for r in rows)


def offsets_table(audits: dict) -> str:
  """Per audit: its shape; the worst dQ against FlashAttention's and
  FlexAttention's limits in the regime and under the invariance; the worst
  other tensor against Flex's; the base grid's worst; whether two runs
  agreed bit for bit; and whether every row passed both rules."""
  body = []
  for name, rows in sorted(audits.items()):
    by = {
      regime: [r for r in rows if r["regime"] == regime] for regime in REGIMES
    }
    every = [r for regime in REGIMES for r in by[regime]]
    shapes = sorted({r["shape"] for r in every})
    body.append(
      [
        f"`{name}`",
        ", ".join(shapes),
        _worst(by["key_offset"], "flashattention", ("dq",)),
        _worst(by["key_offset"], "flexattention", ("dq",)),
        _worst(by["key_shift"], "flexattention", ("dq",)),
        _worst(
          by["key_offset"] + by["key_shift"],
          "flexattention",
          ("out", "dk", "dv"),
        ),
        _worst(by["none"], "flexattention", ("out", "dq", "dk", "dv")),
        "yes" if all(r.get("deterministic", True) for r in every) else "**no**",
        "passes" if _passed(every) else "**fails**",
      ]
    )
  header = [
    "audit", "shape", "key_offset dQ (x FA)", "key_offset dQ (x Flex)",
    "key_shift dQ (x Flex)", "out, dK, dV (x Flex)", "base grid (x Flex)",
    "runs identical", "both rules",
  ]  # fmt: skip
  return table(header, body)
