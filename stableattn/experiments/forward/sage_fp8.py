"""SageAttention 2's directions in FP8 (Zhang et al., arXiv 2411.10958):
smoothing K, per-token against per-block scales, and the format of P in
P V (e4m3, e5m2, FP16), each a change of the `fp8-sage` preset, mapped over
inputs (a channel bias in K, normal, outliers) and the head dim.

SageAttention 2 measured cosine similarity on real models' activations
with Q and K in INT4/INT8; here every operand is e4m3 and the inputs are
synthetic ("key_bias" stands for the bias it found in K), so the
directions compare, not the numbers."""

from __future__ import annotations

import dataclasses

from stableattn.auditing.inputs import DISTRIBUTIONS, Shape
from stableattn.experiments.engine import Case
from stableattn.experiments.forward import policy_rows
from stableattn.experiments.forward.study import Section, Study
from stableattn.harness.config_values import spec
from stableattn.harness.reporting import table

ROWS = {
  "sage": ("pallas", "fp8-sage"),
  "no_smoothing": ("pallas", "fp8-sage+smooth_k=off"),
  "per_block": ("pallas", "fp8-sage+scaling=block"),
  "p_e5m2": ("pallas", "fp8-sage+probs=fp8_e5m2"),
  "p_fp16": ("pallas", "fp8-sage+probs=fp16+p_scale=1"),
  "fp16_flash": ("pallas", "fp16-fa2"),
}
KEYS = ("distribution", "head_dim")
# Smoothing K must lower the RMSE at least this much where K has a bias
# (SageAttention 2: cosine similarity 80.0% -> 98.1%) ...
SMOOTHING_GAIN = 1.5
# ... e4m3 P must stay within this factor of FP16 P (99.44% vs 99.45%) ...
P_E4M3_WITHIN = 1.1
# ... and "more accurate" means an RMSE lower by at least this factor.
CLEARLY = 1.05
CLAIM_TEXT = {
  "smoothing": (
    f"Smoothing K lowers the RMSE at least {SMOOTHING_GAIN}x where K has "
    "a channel bias (SageAttention 2: cosine 80.0% -> 98.1%)"
  ),
  "granularity": (
    f"Per-token scales of Q and K are more accurate than per-block (RMSE "
    f"{CLEARLY}x lower; SageAttention 2: 99.5% vs 98.0%)"
  ),
  "p_e4m3": (
    f"P in e4m3 is within {P_E4M3_WITHIN}x of P in FP16 (SageAttention 2: "
    "99.44% vs 99.45%)"
  ),
  "p_e5m2": (
    f"P in e5m2 is less accurate than in e4m3 (RMSE {CLEARLY}x higher; "
    "SageAttention 2: 99.20% vs 99.44%)"
  ),
}
# claim -> (numerator row, denominator row, test of the RMSE ratio)
RATIOS = {
  "smoothing": ("no_smoothing", "sage", lambda r: r >= SMOOTHING_GAIN),
  "granularity": ("per_block", "sage", lambda r: r >= CLEARLY),
  "p_e4m3": ("sage", "p_fp16", lambda r: r <= P_E4M3_WITHIN),
  "p_e5m2": ("p_e5m2", "sage", lambda r: r >= CLEARLY),
}


@dataclasses.dataclass(frozen=True)
class Config:
  seq_len: int = spec(minimum=1)
  head_dims: tuple[int, ...] = spec(minimum=1)
  distributions: tuple[str, ...] = spec(choices=DISTRIBUTIONS)
  seeds: int = spec(minimum=1)


class SageFP8(Study):
  name = "sage_fp8"
  title = "SageAttention 2's directions in FP8"
  Config = Config
  extendable = ("seeds",)

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    return [
      {"distribution": dist, "head_dim": d}
      for dist in c.distributions
      for d in c.head_dims
    ]

  def measure(self, engine, s, c, p, seed):
    shape = Shape(1, c.seq_len, c.seq_len, s.heads, s.heads, p["head_dim"])
    case = Case(p["distribution"], shape, "fp16", seed)
    return policy_rows.measure(engine, s, case, ROWS)

  def ran(self, s, c):
    return (
      f"`fp8-sage` and its changes; inputs {list(c.distributions)}; length "
      f"{c.seq_len}, {s.heads} heads, head dims {list(c.head_dims)}, tiles "
      f"{s.block_q}x{s.block_k}, FP16 inputs, {c.seeds} seed(s)."
    )

  def report(self, ctx):
    rows = [r for r in ctx.rows if r["comparison"] in ROWS]
    if not rows:
      return None
    claims = sage_claims(rows)
    ctx.headline["sage_fp8"] = claims
    body = table(
      ["inputs", "head dim", "row", "policy", "RMSE vs FP64"],
      policy_rows.rmse_table_rows(rows, ROWS, KEYS),
    )
    findings = [
      policy_rows.claim_finding(CLAIM_TEXT[key], claim, KEYS, "{:.2f}x")
      for key, claim in claims.items()
    ]
    figure = policy_rows.plot(
      ctx, "sage_fp8.png", ROWS, rows, KEYS, "fp8-sage and its changes"
    )
    return Section(body, findings, [figure.name])


def sage_claims(rows) -> dict:
  """Each claim's RMSE ratio at every setting (smoothing: only inputs with
  a channel bias in K), judged; raises without rows."""
  out = {}
  for key, (top, bottom, holds) in RATIOS.items():
    values = [
      {
        **dict(zip(KEYS, setting)),
        "value": policy_rows.ratio(rows, top, bottom, KEYS, setting),
      }
      for setting in policy_rows.settings(rows, KEYS)
      if key != "smoothing" or setting[0] == "key_bias"
    ]
    out[key] = policy_rows.judged(values, holds, "sage_fp8", key)
  return out


STUDY = SageFP8()
