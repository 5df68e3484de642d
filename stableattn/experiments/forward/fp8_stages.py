"""Stage attribution at FP8: which quantization of FlashAttention-3's FP8
design costs what. From FP16 flash attention (`fp16-fa2`), P alone or Q,
K, V alone go to e4m3; from `fp8-fa3` the FP32 statistics go to FP16, or
the matmul accumulator to 13 fraction bits (Hopper's FP8 tensor cores,
SageAttention 2's "FP22", rounded once per tile and summed across tiles in
FP32, the two-level accumulation SageAttention 2 adopts)."""

from __future__ import annotations

import dataclasses

from stableattn.auditing.inputs import DISTRIBUTIONS, Shape
from stableattn.experiments.engine import Case
from stableattn.experiments.forward import policy_rows
from stableattn.experiments.forward.study import Section, Study
from stableattn.harness.config_values import spec
from stableattn.harness.reporting import num, table

ROWS = {
  "nothing (fp16-fa2)": ("pallas", "fp16-fa2"),
  "P only": ("pallas", "fp16-fa2+probs=fp8_e4m3"),
  "P only, x448": ("pallas", "fp16-fa2+probs=fp8_e4m3+p_scale=448"),
  "Q, K, V only": ("pallas", "fp8-fa3+probs=fp16"),
  "all (fp8-fa3)": ("pallas", "fp8-fa3"),
  "all, FP16 softmax": ("pallas", "fp8-fa3+scores=fp16+softmax_stats=fp16"),
  "all, fp22 accumulator": ("pallas", "fp8-fa3+matmul_accum=fp22"),
}
ALL = "all (fp8-fa3)"
KEYS = ("distribution", "head_dim")
# The accumulator claim: a 13-bit accumulator, summed across tiles in
# FP32, costs at most this factor.
FP22_COST = 1.1


@dataclasses.dataclass(frozen=True)
class Config:
  seq_len: int = spec(minimum=1)
  head_dims: tuple[int, ...] = spec(minimum=1)
  distributions: tuple[str, ...] = spec(choices=DISTRIBUTIONS)
  seeds: int = spec(minimum=1)


class FP8Stages(Study):
  name = "fp8_stages"
  title = "Stage attribution at FP8: which quantization costs what"
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
      f"FP16 flash attention and `fp8-fa3`, one quantization changed per "
      f"row; inputs {list(c.distributions)}; length {c.seq_len}, {s.heads} "
      f"heads, head dims {list(c.head_dims)}, tiles {s.block_q}x"
      f"{s.block_k}, FP16 inputs, {c.seeds} seed(s)."
    )

  def report(self, ctx):
    rows = [r for r in ctx.rows if r["comparison"] in ROWS]
    if not rows:
      return None
    claims = stage_claims(rows)
    ctx.headline["fp8_stages"] = claims
    body = table(
      ["inputs", "head dim", "row", "policy", "RMSE vs FP64"],
      policy_rows.rmse_table_rows(rows, ROWS, KEYS),
    )
    findings = [
      policy_rows.claim_finding(
        f"A 13-bit (fp22) matmul accumulator, summed across tiles in FP32, "
        f"costs at most {FP22_COST}x",
        claims["fp22"],
        KEYS,
        "{:.3f}x",
      ),
      _dominant_finding(claims["dominant"]),
    ]
    figure = policy_rows.plot(
      ctx, "fp8_stages.png", ROWS, rows, KEYS, "FP8 stage attribution"
    )
    return Section(body, findings, [figure.name])


def stage_claims(rows) -> dict:
  """ "fp22": its RMSE over fp8-fa3's, judged; "dominant": per setting, the
  RMSE of P alone and of Q, K, V alone over fp8-fa3's. Raises without
  rows."""
  settings = policy_rows.settings(rows, KEYS)
  fp22 = [
    {
      **dict(zip(KEYS, s)),
      "value": policy_rows.ratio(rows, "all, fp22 accumulator", ALL, KEYS, s),
    }
    for s in settings
  ]
  shares = []
  for s in settings:
    p_only = policy_rows.ratio(rows, "P only", ALL, KEYS, s)
    qkv_only = policy_rows.ratio(rows, "Q, K, V only", ALL, KEYS, s)
    if p_only is not None and qkv_only is not None:
      shares.append(
        {**dict(zip(KEYS, s)), "p_only": p_only, "qkv_only": qkv_only}
      )
  if not shares:
    raise ValueError("fp8_stages: no setting has the single-stage rows.")
  return {
    "fp22": policy_rows.judged(
      fp22, lambda v: v <= FP22_COST, "fp8_stages", "fp22"
    ),
    "dominant": shares,
  }


def _dominant_finding(shares) -> str:
  parts = "; ".join(
    f"{policy_rows.where_text(KEYS, (m[KEYS[0]], m[KEYS[1]]))}: P alone "
    f"{num(m['p_only'])}x, Q, K, V alone {num(m['qkv_only'])}x"
    for m in shares
  )
  return (
    "RMSE of one quantization alone over all of fp8-fa3's (P in e4m3, no "
    f"scale; Q, K, V in e4m3 with the rotation and tile scales): {parts}."
  )


STUDY = FP8Stages()
