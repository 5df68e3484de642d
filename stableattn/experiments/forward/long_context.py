"""Long context and the tensor core's accumulator: decode rows over 1K to
128K keys, FP8 attention whose accumulator keeps about 14 bits (one level,
as FlashAttention-3's FP8 kernel shipped), two-level accumulation at
n = 1, 4, 64 tiles (vllm-project/flash-attention #104, #122), against
FP64 computed for those rows only; and whether a needle survives.

Inputs are drawn in float64 and rounded to BF16 once (the golden value
sees what every policy sees):
  normal     q, k, v ~ N(0, 1);
  outliers   two channels of Q and K ten times the rest, in every token
             (the channel outliers of trained LLMs);
  sink       every query shares a direction that the first key scores
             about 8 on, with a small value (an attention sink).
The needle task (normal background): each query row r has a target key
early in the sequence (first tenth) and a distractor late (last tenth),
scored ln(L) + 1/2 and that minus a margin drawn from (0.01, 0.3), with
values on two axes of their own; the row retrieves its needle if its
output leans more on the target's axis than on the distractor's.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from stableattn.contract.golden import golden_attention
from stableattn.experiments.forward import long_context_report
from stableattn.experiments.forward.study import (
  Study,
  deviation_values,
  policies,
  row,
)
from stableattn.harness.config_values import spec
from stableattn.numerics.rounding import round_to
from stableattn.ops.dispatch import attention

DISTRIBUTIONS = ("normal", "outliers", "sink", "needle")
# Study label -> policy (docs/precision.md has each preset's source).
POLICIES = {
  "bf16-fa2": "bf16-fa2",
  "fp16-fa2": "fp16-fa2",
  # The Hopper preset's operands with an FP32 accumulator: the control
  # every accumulator row is compared with.
  "fp8 (FP32 accumulator)": (
    "fp8-fa3-hopper+matmul_accum=fp32+mma_chunk=0+mma_rounding=nearest"
    "+promote_every=1"
  ),
  "fp8-fa3 (block scales + rotation)": "fp8-fa3",
  # K and V from an FP8 cache (one scale per tensor), BF16 math.
  "fp8 KV cache (BF16 Q)": "bf16-fp8-kv-cache",
  "fp8 one-level (Hopper)": "fp8-fa3-hopper",
  "fp8 one-level (nearest)": "fp8-fa3-hopper+mma_rounding=nearest",
  "two-level n=1": "fp8-fa3-two-level",
  "two-level n=4": "fp8-fa3-two-level+promote_every=4",
  "two-level n=64": "fp8-fa3-two-level+promote_every=64",
}
CONTROL = "fp8 (FP32 accumulator)"
OUTLIER_CHANNELS, OUTLIER_SCALE = 2, 10.0
SINK_SCORE = 8.0
MARGINS = (0.01, 0.3)  # the needle's lead over the distractor, in score


def _labels(raw, name: str) -> tuple[str, ...]:
  names = (
    tuple(raw)
    if not isinstance(raw, str)
    else tuple(n.strip() for n in raw.split(",") if n.strip())
  )
  unknown = [n for n in names if n not in POLICIES]
  if unknown or not names:
    raise ValueError(
      f"config.{name}: {unknown or 'nothing'} given; valid: {list(POLICIES)}."
    )
  policies(",".join(POLICIES[n] for n in names), name)
  return names


@dataclasses.dataclass(frozen=True)
class Config:
  lengths: tuple[int, ...] = spec(minimum=1)
  # Labels of `POLICIES` to measure.
  policies: tuple[str, ...] = spec(parse=_labels)
  distributions: tuple[str, ...] = spec(choices=DISTRIBUTIONS)
  query_rows: int = spec(minimum=1)  # decode rows per sequence
  batch: int = spec(minimum=1)  # sequences per point (needle draws)
  head_dim: int = spec(minimum=1)
  block_k: int = spec(minimum=1)
  seeds: int = spec(minimum=1)


def make_inputs(distribution: str, seed: int, c: Config, length: int):
  """(q, k, v) in float64 (rounded to BF16) and, for the needle task, the
  (target, distractor) value axes of each row [batch, rows, 2]."""
  rng = np.random.default_rng([seed, length, DISTRIBUTIONS.index(distribution)])
  b, r, d = c.batch, c.query_rows, c.head_dim
  q = rng.standard_normal((b, r, 1, d))
  k = rng.standard_normal((b, length, 1, d))
  v = rng.standard_normal((b, length, 1, d))
  axes = None
  if distribution == "outliers":
    q[..., :OUTLIER_CHANNELS] *= OUTLIER_SCALE
    k[..., :OUTLIER_CHANNELS] *= OUTLIER_SCALE
  elif distribution == "sink":
    u = rng.standard_normal(d)
    u *= math.sqrt(d) / np.linalg.norm(u)
    q += u
    # score(q, k0) = q . k0 / sqrt(d) = about SINK_SCORE
    k[:, 0, 0] = u * (SINK_SCORE / math.sqrt(d))
    v[:, 0, 0] *= 0.1
  elif distribution == "needle":
    axes = _plant_needles(rng, q, k, v, length)
  bf16 = lambda x: np.asarray(round_to(jnp.asarray(x), "bf16"), np.float64)  # noqa: E731
  return bf16(q), bf16(k), bf16(v), axes


def _plant_needles(rng, q, k, v, length: int):
  """A target key early and a distractor late for each query row, their
  values on two axes of the row's own; returns the axes [b, rows, 2]."""
  b, r, _, d = q.shape
  if 2 * r > d or length < 20:
    raise ValueError(
      f"the needle task needs 2 x query_rows <= head_dim and at least 20 "
      f"keys; got {r} rows, head dim {d}, length {length}."
    )
  tenth = max(length // 10, r)
  base = math.log(length) + 0.5
  axes = np.zeros((b, r, 2), int)
  for i in range(b):
    targets = rng.choice(tenth, r, replace=False)
    distractors = length - 1 - rng.choice(tenth, r, replace=False)
    for row_index in range(r):
      qr = q[i, row_index, 0]
      margin = rng.uniform(*MARGINS)
      for pos, score, axis in (
        (targets[row_index], base, 2 * row_index),
        (distractors[row_index], base - margin, 2 * row_index + 1),
      ):
        # q . k / sqrt(d) = score
        k[i, pos, 0] = qr * (score * math.sqrt(d) / float(qr @ qr))
        v[i, pos, 0] = 0.0
        v[i, pos, 0, axis] = 4.0
      axes[i, row_index] = (2 * row_index, 2 * row_index + 1)
  return axes


def _leans(out, axes):
  """(target projection, distractor projection) of each needle row."""
  b, r = axes.shape[:2]
  o = out[:, :, 0]
  bi, ri = np.meshgrid(np.arange(b), np.arange(r), indexing="ij")
  return tuple(o[bi, ri, axes[..., j]] for j in (0, 1))


def _values(out, gold, axes, control=None) -> dict:
  """Relative error of the rows and, for the needle task, the retrieval
  rate (and FP64's), the needle's attention mass error against FP64, and
  the share of rows retrieved otherwise than the same operands with an
  FP32 accumulator (`control`) retrieve them."""
  err = float(np.linalg.norm(out - gold) / np.linalg.norm(gold))
  values = {"rel_error": err}
  if axes is None:
    return values
  t_out, d_out = _leans(out, axes)
  t_gold, d_gold = _leans(gold, axes)
  values["retrieved"] = float(np.mean(t_out > d_out))
  values["retrieved_fp64"] = float(np.mean(t_gold > d_gold))
  values["needle_mass_error"] = float(
    np.mean(np.abs(t_out - t_gold) / np.abs(t_gold))
  )
  if control is not None:
    t_ctl, d_ctl = _leans(control, axes)
    values["flips_vs_fp32_accumulator"] = float(
      np.mean((t_out > d_out) != (t_ctl > d_ctl))
    )
  return values


class LongContext(Study):
  name = "long_context"
  title = "Long context and the tensor core's accumulator"
  Config = Config
  extendable = ("seeds",)
  claims = long_context_report.CLAIMS

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    return [
      {"length": n, "distribution": d}
      for n in c.lengths
      for d in c.distributions
    ]

  def measure(self, engine, s, c, p, seed):
    q, k, v, axes = make_inputs(p["distribution"], seed, c, p["length"])
    gold = np.asarray(golden_attention(q, k, v))
    outs = {label: self._output(label, q, k, v, c, p) for label in c.policies}
    control = outs.get(CONTROL)
    return [
      row(
        {"comparison": label, "policy": POLICIES[label]},
        {
          **deviation_values(gold, out),
          **_values(out, gold, axes, control),
        },
      )
      for label, out in outs.items()
    ]

  @staticmethod
  def _output(label, q, k, v, c, p):
    out = attention(
      *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
      precision=POLICIES[label],
      block_q=min(16, c.query_rows),
      block_k=c.block_k,
    )
    out = np.asarray(out.astype(jnp.float64))
    if not np.all(np.isfinite(out)):
      raise FloatingPointError(
        f"long_context: {label} gave non-finite outputs at length "
        f"{p['length']}, {p['distribution']} inputs."
      )
    return out

  def ran(self, s, c):
    return (
      f"{c.batch} sequence(s) x {c.query_rows} decode rows over "
      f"{list(c.lengths)} keys, head dim {c.head_dim}, one head, tiles "
      f"{min(16, c.query_rows)}x{c.block_k}; inputs {list(c.distributions)} "
      f"rounded to BF16; policies {list(c.policies)}; {c.seeds} seed(s)."
    )

  def report(self, ctx):
    return long_context_report.section(ctx)


STUDY = LongContext()
