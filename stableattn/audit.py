"""Audit any attention kernel: forward, gradients, determinism, NaN.

A kernel on the contract of `stableattn.attention_fns` is run on inputs
rounded to a policy's input format and compared, output and gradients
(dQ, dK, dV for one random cotangent), against the FP64 golden value and
against our same-policy Baseline. Each tensor is judged by the rules of the
projects users trust, side by side (`RULES`), repeated runs must agree bit
for bit, and any NaN or Inf fails.

Rules (each as its project's tests apply it; see the README for sources):
  * flashattention — max|x - golden| <= 2 x the same-policy baseline's
    (3 x for gradients) + FlashAttention-3's floor,
    2 max|(golden + 0.3 - 0.3) - golden| in the output format
    (Dao-AILab/flash-attention, tests/test_flash_attn.py and hopper/).
  * flexattention — mean|x - golden| <= 1.1 x the same-format baseline's
    for FP16/BF16 (PyTorch, test/inductor/test_flex_attention.py).
  * tokamax — a fixed tolerance per dtype, FP32 1e-6, BF16 1e-2, FP16
    5e-4, gradients 2x (openxla/tokamax), read as an allclose with atol =
    rtol = the tolerance; our reference is FP64, theirs XLA at highest
    precision.
  * transformer_engine — RMSE <= 0.11 x the golden value's range
    (NVIDIA TransformerEngine's attention tests).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.attention_fns import resolve
from stableattn.golden import golden_attention, golden_attention_vjp
from stableattn.inputs import (
  DISTRIBUTIONS,
  Shape,
  make_inputs,
  round_to,
  shape_from_spec,
)
from stableattn.metrics import compare, rounding_floor
from stableattn.precision import Precision

TENSORS = ("out", "dq", "dk", "dv")
TOKAMAX_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-2, "fp16": 5e-4, "fp64": 1e-12}


@dataclasses.dataclass(frozen=True)
class Judgement:
  """One rule on one tensor: the measured value against its limit
  (`applies` False where the rule's project does not use it, e.g.
  FlexAttention's 1.1x at FP32; such a rule passes)."""

  rule: str
  value: float
  limit: float
  passed: bool
  applies: bool = True


def _finite(x) -> bool:
  return bool(np.all(np.isfinite(x)))


def flashattention_rule(golden, x, baseline, fmt, gradient) -> Judgement:
  factor = 3.0 if gradient else 2.0
  error = float(np.max(np.abs(x - golden)))
  limit = factor * float(np.max(np.abs(baseline - golden)))
  limit += rounding_floor(golden, fmt)
  ok = _finite(x) and error <= limit
  return Judgement("flashattention", error, limit, ok)


def flexattention_rule(golden, x, baseline, fmt, gradient) -> Judgement:
  error = float(np.mean(np.abs(x - golden)))
  limit = 1.1 * float(np.mean(np.abs(baseline - golden)))
  if fmt not in ("bf16", "fp16"):  # the 1.1x rule is for half formats
    return Judgement("flexattention", error, limit, _finite(x), False)
  ok = _finite(x) and error <= limit
  return Judgement("flexattention", error, limit, ok)


def tokamax_rule(golden, x, baseline, fmt, gradient) -> Judgement:
  """An allclose with atol = rtol = the dtype's tolerance: the value is the
  worst |x - golden| / (tol (1 + |golden|)), at most 1 to pass."""
  del baseline
  tol = TOKAMAX_TOLERANCE[fmt] * (2.0 if gradient else 1.0)
  worst = float(np.max(np.abs(x - golden) / (tol * (1.0 + np.abs(golden)))))
  return Judgement("tokamax", worst, 1.0, _finite(x) and worst <= 1.0)


def transformer_engine_rule(golden, x, baseline, fmt, gradient) -> Judgement:
  del baseline, fmt, gradient
  rmse = float(np.sqrt(np.mean((x - golden) ** 2)))
  limit = 0.11 * float(np.max(golden) - np.min(golden))
  ok = _finite(x) and rmse <= limit
  return Judgement("transformer_engine", rmse, limit, ok)


RULES = {
  "flashattention": flashattention_rule,
  "flexattention": flexattention_rule,
  "tokamax": tokamax_rule,
  "transformer_engine": transformer_engine_rule,
}


def quality(golden, x) -> dict:
  """What users quote beside the rules: cosine, relative L1, SNR (dB),
  the signed share of errors (Qiu & Yao), and non-finite counts."""
  g, d = golden.ravel(), (x - golden).ravel()
  finite = np.isfinite(x).ravel()
  norm = np.linalg.norm(g) * np.linalg.norm(x.ravel())
  cosine = float(np.dot(g, x.ravel()) / norm) if norm else float("nan")
  noise = float(np.sum(d**2))
  deviation = compare(golden, x)
  return {
    "cosine": cosine,
    "rel_l1": float(np.sum(np.abs(d)) / max(np.sum(np.abs(g)), 1e-300)),
    "snr_db": 10 * math.log10(float(np.sum(g**2)) / noise)
    if noise > 0
    else float("inf"),
    "max_abs": deviation.max_abs,
    "signed_share": deviation.signed_share,
    "nonfinite": int(np.size(x) - np.count_nonzero(finite)),
  }


@dataclasses.dataclass(frozen=True)
class Case:
  """One audited input: shape, distribution and seed."""

  shape: Shape
  distribution: str
  seed: int

  @property
  def label(self) -> str:
    s = self.shape
    return (
      f"B{s.batch} T{s.q_len} S{s.kv_len} H{s.heads}/{s.kv_heads} D{s.head_dim}"
    )


def _values_and_grads(fn, q, k, v, d_out, causal):
  """fn's output and (dq, dk, dv) for cotangent d_out, as float64 arrays."""

  def call(q, k, v):
    return fn(q, k, v, causal=causal)

  out, vjp = jax.vjp(call, q, k, v)
  if out is None or getattr(out, "shape", None) != q.shape:
    raise ValueError(
      f"the kernel returned {None if out is None else out.shape}; the "
      f"contract is an output shaped like q, {q.shape}."
    )
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise ValueError(
      f"the kernel returned dtype {out.dtype}; the contract is a floating "
      "output (the inputs' dtype or wider)."
    )
  grads = vjp(jnp.asarray(d_out).astype(out.dtype))
  return [
    np.asarray(jax.device_get(x)).astype(np.float64) for x in (out, *grads)
  ]


def measure_case(fn, policy: Precision, case: Case, causal: bool, repeats):
  """Rows (one per tensor) of one case: rules, quality, determinism."""
  q, k, v = (
    round_to(x, policy.inputs)
    for x in make_inputs(case.distribution, case.seed, case.shape)
  )
  d_out = round_to(
    np.random.default_rng(10_000 + case.seed).standard_normal(q.shape),
    policy.output,
  )
  golden = [
    golden_attention(q, k, v, causal),
    *golden_attention_vjp(q, k, v, d_out, causal),
  ]
  dtype = policy.dtype("inputs")
  args = [jnp.asarray(x.astype(dtype)) for x in (q, k, v)]
  d_out = d_out.astype(policy.dtype("output"))

  ours = resolve("reference", precision=policy)
  baseline = _values_and_grads(ours, *args, d_out, causal)
  runs = [_values_and_grads(fn, *args, d_out, causal) for _ in range(repeats)]
  rows = []
  for i, tensor in enumerate(TENSORS):
    x = runs[0][i]
    gradient = tensor != "out"
    fmt = policy.output if not gradient else policy.inputs
    judged = [
      rule(golden[i], x, baseline[i], fmt, gradient) for rule in RULES.values()
    ]
    identical = all(np.array_equal(x, r[i], equal_nan=True) for r in runs)
    rows.append(
      {
        "shape": case.label,
        "distribution": case.distribution,
        "seed": case.seed,
        "tensor": tensor,
        "policy": policy.name,
        "deterministic": identical,
        "repeats": repeats,
        **{f"{j.rule}_value": j.value for j in judged},
        **{f"{j.rule}_limit": j.limit for j in judged},
        **{f"{j.rule}_passed": j.passed for j in judged},
        **{f"{j.rule}_applies": j.applies for j in judged},
        **quality(golden[i], x),
        "baseline_max_abs": float(np.max(np.abs(baseline[i] - golden[i]))),
      }
    )
  return rows


def cases(shapes, distributions, seeds: int) -> list[Case]:
  bad = [d for d in distributions if d not in DISTRIBUTIONS]
  if bad or not distributions:
    raise ValueError(
      f"distributions {list(distributions)}: unknown {bad}; valid: "
      f"{list(DISTRIBUTIONS)} (at least one)."
    )
  if not shapes or seeds < 1:
    raise ValueError("an audit needs at least one shape and one seed.")
  return [
    Case(shape_from_spec(spec), distribution, seed)
    for spec in shapes
    for distribution in distributions
    for seed in range(seeds)
  ]


def failures(rows, rules=tuple(RULES)) -> list[str]:
  """Every failed rule, non-deterministic tensor and NaN, in words."""
  out = []
  for r in rows:
    where = (
      f"{r['tensor']} at {r['shape']}, {r['distribution']} inputs, seed "
      f"{r['seed']}, {r['policy']}"
    )
    if r["nonfinite"]:
      out.append(f"{r['nonfinite']} NaN/Inf values in {where}")
    if not r["deterministic"]:
      out.append(f"{where} differs between {r['repeats']} identical runs")
    for rule in rules:
      if not r[f"{rule}_passed"]:
        out.append(
          f"{rule} rule fails on {where}: {r[f'{rule}_value']:.3g} > "
          f"limit {r[f'{rule}_limit']:.3g}"
        )
  return out


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The rows of an audit and what failed (`passed`: nothing did)."""

  rows: tuple[dict, ...]
  gate: tuple[str, ...]

  @property
  def failures(self) -> list[str]:
    return failures(self.rows, self.gate)

  @property
  def passed(self) -> bool:
    return not self.failures

  def __str__(self) -> str:
    lines = [
      f"{'tensor':>6} {'policy':>16} {'causal':>6} "
      + " ".join(f"{rule:>18}" for rule in RULES)
      + "  deterministic"
    ]
    for r in self.rows:
      cells = [
        f"{r[f'{rule}_value']:.2e}/{r[f'{rule}_limit']:.1e}"
        + (" ok" if r[f"{rule}_passed"] else " XX")
        for rule in RULES
      ]
      lines.append(
        f"{r['tensor']:>6} {r['policy']:>16} {str(r['causal']):>6} "
        + " ".join(f"{c:>18}" for c in cells)
        + f"  {r['deterministic']}"
      )
    lines += self.failures
    lines.append("PASSED" if self.passed else "FAILED")
    return "\n".join(lines)


def audit(
  fn,
  *,
  precision: str | Precision = "bf16-framework",
  shapes=((1, 128, 2, 64),),
  distributions=("normal",),
  seeds: int = 1,
  causal: bool = False,
  repeats: int = 3,
  gate=("flashattention", "flexattention"),
) -> AuditReport:
  """Audits fn(q, k, v, *, causal): output and gradients under every rule,
  determinism over `repeats` runs, and NaN/Inf.

  Args:
    fn: a kernel on the contract of `stableattn.attention_fns`.
    precision: the input format and the same-policy baseline.
    shapes: (batch, seq_len, heads, head_dim) or six-field shapes.
    distributions, seeds: inputs per shape (`stableattn.inputs`).
    causal: whether fn is called (and judged) with causal masking.
    repeats: identical runs that must agree bit for bit (at least 2).
    gate: rules that decide `passed` (all are measured).

  Raises:
    ValueError: for bad settings, or a kernel that raises or breaks the
      contract (the message says which case and why).
  """
  policy = Precision.from_name(precision)
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
    raise ValueError(f"repeats must be an integer >= 2, got {repeats!r}.")
  unknown = [g for g in gate if g not in RULES]
  if unknown:
    raise ValueError(f"unknown rules {unknown}; valid: {list(RULES)}.")
  rows = []
  for case in cases(shapes, tuple(distributions), seeds):
    rows += [
      {"causal": causal, **r}
      for r in measure_case(fn, policy, case, causal, repeats)
    ]
  return AuditReport(tuple(rows), tuple(gate))
