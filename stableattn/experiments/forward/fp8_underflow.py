"""P cast to FP8 underflows (arXiv 2606.06521): with P rounded to e4m3
before P V, probabilities below e4m3's smallest subnormal (2^-9) become 0.
A static scale of P (256, 448) moves that threshold down; the order in
which the kernel visits key blocks decides which running maximum each
block's P is measured against. Mapped over inputs and causal masking,
in FlashAttention-3's FP8 design (`fp8-fa3`, where Q, K and V are e4m3
too) and with P the only value in e4m3 (`fp16-fa2+probs=fp8_e4m3`)."""

from __future__ import annotations

import dataclasses

from stableattn.auditing.inputs import DISTRIBUTIONS, Shape
from stableattn.experiments.engine import Case
from stableattn.experiments.forward import policy_rows
from stableattn.experiments.forward.study import Section, Study
from stableattn.harness.config_values import booleans, spec
from stableattn.harness.reporting import table

BASES = {"fp8-fa3": "fp8-fa3", "P only": "fp16-fa2+probs=fp8_e4m3"}
ORDERS = ("forward", "reversed")
P_SCALES = (1, 256, 448)
ROWS = {
  f"{base}: {order}, P x{scale}": (
    "pallas",
    f"{policy}+key_order={order}+p_scale={scale}",
  )
  for base, policy in BASES.items()
  for order in ORDERS
  for scale in P_SCALES
}
# The claim: reversed order with P scaled by 256 lowers the MSE this many
# times against forward order unscaled ...
MSE_BAND = (3.0, 10.0)
# ... and the order or the scale alone helps where it lowers the MSE at
# least this much.
HELPS = 1.1
# claim -> (the better row's order and scale, test of the MSE ratio)
CLAIMS = {
  "fix": (("reversed", 256), lambda v: MSE_BAND[0] <= v <= MSE_BAND[1]),
  "order": (("reversed", 1), lambda v: v >= HELPS),
  "scale": (("forward", 256), lambda v: v >= HELPS),
}
CLAIM_TEXT = {
  "fix": (
    f"reversed key order with P x256 lowers the MSE {MSE_BAND[0]:g}-"
    f"{MSE_BAND[1]:g}x against forward order unscaled (arXiv 2606.06521)"
  ),
  "order": f"reversed key order alone lowers the MSE at least {HELPS}x",
  "scale": f"P x256 alone lowers the MSE at least {HELPS}x",
}
KEYS = ("distribution", "causal")


@dataclasses.dataclass(frozen=True)
class Config:
  seq_len: int = spec(minimum=1)
  head_dim: int = spec(minimum=1)
  distributions: tuple[str, ...] = spec(choices=DISTRIBUTIONS)
  causal: tuple[bool, ...] = spec(parse=booleans)
  # Static scales of P measured (1 and 256 are the claim's rows).
  p_scales: tuple[int, ...] = spec(minimum=1)
  seeds: int = spec(minimum=1)


class FP8Underflow(Study):
  name = "fp8_underflow"
  title = "FP8 P underflow: key-block order and a static P scale"
  Config = Config
  extendable = ("seeds",)

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    return [
      {"distribution": d, "causal": bool(causal)}
      for d in c.distributions
      for causal in c.causal
    ]

  def measure(self, engine, s, c, p, seed):
    shape = Shape(1, c.seq_len, c.seq_len, s.heads, s.heads, c.head_dim)
    case = Case(p["distribution"], shape, "fp16", seed, causal=p["causal"])
    rows = {
      name: row
      for name, row in ROWS.items()
      if int(name.rsplit("x", 1)[1]) in c.p_scales
    }
    return policy_rows.measure(engine, s, case, rows)

  def ran(self, s, c):
    return (
      f"{list(BASES.values())} with key_order in {list(ORDERS)} and p_scale in "
      f"{list(c.p_scales)}; inputs {list(c.distributions)}, causal "
      f"{list(c.causal)}; length {c.seq_len}, {s.heads} heads, head dim "
      f"{c.head_dim}, tiles {s.block_q}x{s.block_k}, FP16 inputs, "
      f"{c.seeds} seed(s)."
    )

  def report(self, ctx):
    rows = [r for r in ctx.rows if r["comparison"] in ROWS]
    if not rows:
      return None
    claims = underflow_claims(rows)
    ctx.headline["fp8_underflow"] = claims
    body = table(
      ["inputs", "causal", "row", "policy", "RMSE vs FP64"],
      policy_rows.rmse_table_rows(rows, ROWS, KEYS),
    )
    findings = [
      policy_rows.claim_finding(
        f"{base}: {CLAIM_TEXT[key]}", claims[base][key], KEYS, "{:.2f}x"
      )
      for base in claims
      for key in CLAIMS
    ]
    figure = policy_rows.plot(
      ctx, "fp8_underflow.png", ROWS, rows, KEYS, "P's key order and scale"
    )
    return Section(body, findings, [figure.name])


def underflow_claims(rows) -> dict:
  """Per base and claim, the MSE of forward order unscaled over the
  better row's at each (inputs, causal), judged. Raises without rows."""
  out = {}
  for base in BASES:
    plain = f"{base}: forward, P x1"
    measured = {}
    for key, ((order, scale), holds) in CLAIMS.items():
      better = f"{base}: {order}, P x{scale}"
      values = []
      for setting in policy_rows.settings(rows, KEYS):
        r = policy_rows.ratio(rows, plain, better, KEYS, setting)
        values.append(
          {**dict(zip(KEYS, setting)), "value": None if r is None else r * r}
        )
      if any(v["value"] is not None for v in values):
        measured[key] = policy_rows.judged(values, holds, "fp8_underflow", key)
    if measured:
      out[base] = measured
  if not out:
    raise ValueError("fp8_underflow: no setting has the rows of any claim.")
  return out


STUDY = FP8Underflow()
