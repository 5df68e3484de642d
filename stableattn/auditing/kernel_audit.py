"""Audit any attention kernel: forward, gradients, determinism, NaN.

A kernel on the contract of `stableattn.ops.registry`, `fn(q, k, v,
**features)`, is run on inputs rounded to a policy's input format with
the features the audit names, and compared, output and gradients (dQ, dK,
dV for one random cotangent), against the FP64 golden value with the
same features and against our same-policy Baseline. Each tensor is judged
by the rules of the projects users trust, side by side
(`stableattn.numerics.rules`), repeated runs must agree bit for bit, and any NaN
or Inf fails. `check` is the same audit restricted to the forward output
and FlashAttention's rule.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.auditing import invariance
from stableattn.auditing.feature_recipes import FeatureRecipe
from stableattn.auditing.inputs import (
  DISTRIBUTIONS,
  Shape,
  make_inputs,
  round_to,
  shape_from_spec,
)
from stableattn.contract.arguments import names
from stableattn.contract.features import Features
from stableattn.contract.golden import golden_attention, golden_attention_vjp
from stableattn.contract.options import Options
from stableattn.numerics.metrics import compare
from stableattn.numerics.precision import Precision
from stableattn.numerics.rules import RULES
from stableattn.ops.registry import resolve, unaccepted_features

TENSORS = ("out", "dq", "dk", "dv")


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
  """One audited input: shape, distribution, seed and features."""

  shape: Shape
  distribution: str
  seed: int
  features: FeatureRecipe | Features = FeatureRecipe()

  @property
  def label(self) -> str:
    s = self.shape
    return (
      f"B{s.batch} T{s.q_len} S{s.kv_len} H{s.heads}/{s.kv_heads} D{s.head_dim}"
    )

  @property
  def features_label(self) -> str:
    return features_label(self.features)

  def built_features(self) -> Features:
    if isinstance(self.features, Features):
      return self.features
    return self.features.build(self.shape)


def features_label(features) -> str:
  """ "none", or the set features' names ("causal,local_window_size")."""
  if isinstance(features, FeatureRecipe):
    return features.label
  return ",".join(features.kwargs()) or "none"


def _call(fn, q, k, v, features: dict):
  out = fn(q, k, v, **features)
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
  return out


def _as_f64(arrays) -> list:
  return [np.asarray(jax.device_get(x)).astype(np.float64) for x in arrays]


def _values_and_grads(fn, q, k, v, d_out, features: dict, gradients: bool):
  """fn's output and, with `gradients`, (dq, dk, dv) for cotangent d_out,
  as float64 arrays."""
  if not gradients:
    return _as_f64([_call(fn, q, k, v, features)])
  out, vjp = jax.vjp(lambda q, k, v: _call(fn, q, k, v, features), q, k, v)
  return _as_f64([out, *vjp(jnp.asarray(d_out).astype(out.dtype))])


def check_accepts(fn, features: dict, kernel: str = "the kernel") -> None:
  """One clear line when fn cannot take a feature the audit passes."""
  missing = unaccepted_features(fn, features)
  if missing:
    raise ValueError(
      f"{kernel} does not accept the feature(s) {missing} that this audit "
      "passes (the contract is fn(q, k, v, **features), jax's names); "
      "audit it without them or add them to its signature."
    )


def measure_case(
  fn, policy: Precision, case: Case, repeats, tensors=TENSORS, rules=RULES
):
  """Rows (one per tensor) of one case: rules, quality, determinism."""
  gradients = tensors != ("out",)
  q, k, v = (
    round_to(x, policy.inputs)
    for x in make_inputs(case.distribution, case.seed, case.shape)
  )
  d_out = round_to(
    np.random.default_rng(10_000 + case.seed).standard_normal(q.shape),
    policy.output,
  )
  features = case.built_features().kwargs()
  check_accepts(fn, features)
  golden = [golden_attention(q, k, v, **features)]
  if gradients:
    golden += golden_attention_vjp(q, k, v, d_out, **features)[:3]
  dtype = policy.dtype("inputs")
  args = [jnp.asarray(x.astype(dtype)) for x in (q, k, v)]
  d_out = d_out.astype(policy.dtype("output"))

  ours = resolve("reference", Options(precision=policy))
  baseline = _values_and_grads(ours, *args, d_out, features, gradients)
  runs = [
    _values_and_grads(fn, *args, d_out, features, gradients)
    for _ in range(repeats)
  ]
  return [
    _row(
      case, policy, tensor, golden[i], [r[i] for r in runs], baseline[i], rules
    )
    for i, tensor in enumerate(tensors)
  ]


def _row(case, policy, tensor, golden, runs, baseline, rules) -> dict:
  x = runs[0]
  gradient = tensor != "out"
  fmt = policy.output if not gradient else policy.inputs
  judged = [rule(golden, x, baseline, fmt, gradient) for rule in rules.values()]
  return {
    "shape": case.label,
    "distribution": case.distribution,
    "seed": case.seed,
    "features": case.features_label,
    "tensor": tensor,
    "policy": policy.name,
    "deterministic": all(np.array_equal(x, r, equal_nan=True) for r in runs),
    "repeats": len(runs),
    **{f"{j.rule}_value": j.value for j in judged},
    **{f"{j.rule}_limit": j.limit for j in judged},
    **{f"{j.rule}_passed": j.passed for j in judged},
    **{f"{j.rule}_applies": j.applies for j in judged},
    **quality(golden, x),
    "baseline_max_abs": float(np.max(np.abs(baseline - golden))),
  }


def cases(shapes, distributions, seeds: int, features=None):
  features = FeatureRecipe() if features is None else features
  bad = [d for d in distributions if d not in DISTRIBUTIONS]
  if bad or not distributions:
    raise ValueError(
      f"distributions {list(distributions)}: unknown {bad}; valid: "
      f"{list(DISTRIBUTIONS)} (at least one)."
    )
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise ValueError(f"seeds must be an integer >= 1, got {seeds!r}.")
  if shapes is not None and not len(shapes):
    raise ValueError("an audit needs at least one shape.")
  return [
    Case(shape_from_spec(spec), distribution, seed, features)
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
      f"{r['seed']}, {r['policy']}, features {r['features']}"
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


# The opt-in gate that fails a kernel whose rows are not bitwise invariant.
INVARIANCE_GATE = "invariance"


def check_gate(gate, rules) -> None:
  unknown = [g for g in gate if g not in rules and g != INVARIANCE_GATE]
  if unknown:
    raise ValueError(
      f"unknown gate {unknown}; valid: {[*rules, INVARIANCE_GATE]}."
    )


@dataclasses.dataclass(frozen=True)
class AuditReport:
  """The rows of an audit and what failed (`passed`: nothing did);
  `invariance_rows` are the probes of `stableattn.auditing.invariance`."""

  rows: tuple[dict, ...]
  gate: tuple[str, ...]
  invariance_rows: tuple[dict, ...] = ()

  @property
  def invariant(self) -> dict:
    """{invariance: True, False or None (n/a)} for the probes run."""
    return invariance.verdicts(self.invariance_rows)

  @property
  def failures(self) -> list[str]:
    found = failures(self.rows, [g for g in self.gate if g in RULES])
    if INVARIANCE_GATE in self.gate:
      found += invariance.failures(self.invariance_rows)
    return found

  @property
  def passed(self) -> bool:
    return not self.failures

  def __str__(self) -> str:
    rules = [r for r in RULES if f"{r}_passed" in self.rows[0]]
    lines = [
      f"{'tensor':>6} {'policy':>16} {'features':>16} "
      + " ".join(f"{rule:>18}" for rule in rules)
      + "  deterministic"
    ]
    for r in self.rows:
      cells = [
        f"{r[f'{rule}_value']:.2e}/{r[f'{rule}_limit']:.1e}"
        + (" ok" if r[f"{rule}_passed"] else " XX")
        for rule in rules
      ]
      lines.append(
        f"{r['tensor']:>6} {r['policy']:>16} {r['features']:>16} "
        + " ".join(f"{c:>18}" for c in cells)
        + f"  {r['deterministic']}"
      )
    for r in self.invariance_rows:
      if r["invariant"] is None:
        said = f"n/a: {r['reason']}"
      elif r["invariant"]:
        said = "bitwise equal"
      else:
        said = (
          f"differ by {r['diff_ulps']:.3g} ulps (error vs FP64 "
          f"{r['error_ulps']:.3g} ulps)"
        )
      lines.append(f"{r['invariance']:>16} {r['detail']:>36}  {said}")
    lines += self.failures
    lines.append("PASSED" if self.passed else "FAILED")
    return "\n".join(lines)


def as_recipe(features, causal: bool = False):
  """`features` (None, "causal,window,...", a FeatureRecipe or Features)
  as a recipe or fixed Features, with `causal` sugar applied."""
  if features is None or isinstance(features, str):
    features = FeatureRecipe.from_names(features or "")
  if not isinstance(features, (FeatureRecipe, Features)):
    raise ValueError(
      "features must be None, names such as 'causal,window', a "
      f"FeatureRecipe or a stableattn.Features; got {type(features).__name__}."
    )
  if causal:
    features = dataclasses.replace(features, causal=True)
  return features


def audit(
  fn,
  *,
  precision: str | Precision = "bf16-framework",
  shapes=((1, 128, 2, 64),),
  distributions=("normal",),
  seeds: int = 1,
  features=None,
  causal: bool = False,
  repeats: int = 3,
  gate=("flashattention", "flexattention"),
  tensors=TENSORS,
  rules=None,
  invariances=None,
) -> AuditReport:
  """Audits fn(q, k, v, **features): output and gradients under every
  rule, determinism over `repeats` runs, and NaN/Inf.

  Args:
    fn: a kernel on the contract of `stableattn.ops.registry`.
    precision: the input format and the same-policy baseline.
    shapes: (batch, seq_len, heads, head_dim) or six-field shapes.
    distributions, seeds: inputs per shape (`stableattn.auditing.inputs`).
    distributions, gate, tensors, invariances: names as 'a,b', a list or
      tuple, or one name (`stableattn.contract.arguments.names`).
    features: what fn is called (and judged) with: None, names of
      `stableattn.contract.features.RECIPE_NAMES` ("causal,window,segments"),
      built for each shape, or a `stableattn.Features` that fits every
      shape. Only the features that are set are passed.
    causal: sugar for adding `causal` to the features.
    repeats: identical runs that must agree bit for bit (at least 2; 1
      leaves determinism unjudged).
    gate: rules that decide `passed` (all are measured).
    tensors: ("out", "dq", "dk", "dv"), or ("out",) for a forward-only
      kernel.
    rules: name -> rule of `stableattn.numerics.rules` to measure; None:
      `RULES`.
    invariances: names of `stableattn.auditing.invariance.INVARIANCES` ("batch,
      decode", a sequence or "all"): the same rows computed the ways
      inference computes them, at the first shape's length, heads and
      head dim, bitwise or in ulps beside the error against FP64. The
      gate "invariance" fails a kernel that is not bitwise invariant.

  Raises:
    ValueError: for bad settings, a feature the kernel does not accept, or
      a kernel that raises or breaks the contract (the message says which
      case and why).
  """
  policy = Precision.from_name(precision)
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}.")
  rules = RULES if rules is None else rules
  gate = names(gate, "gate")
  tensors = names(tensors, "tensors")
  distributions = names(distributions, "distributions")
  check_gate(gate, rules)
  probes = invariance.parse(invariances)
  if tuple(tensors) not in (TENSORS, ("out",)):
    raise ValueError(f"tensors must be {TENSORS} or ('out',), got {tensors}.")
  recipe = as_recipe(features, causal)
  rows = []
  all_cases = cases(shapes, distributions, seeds, recipe)
  for case in all_cases:
    rows += measure_case(fn, policy, case, repeats, tuple(tensors), rules)
  invariance_rows = ()
  if probes:
    first = all_cases[0]
    invariance_rows = tuple(
      invariance.measure(
        fn, policy, first.shape, probes, distribution=first.distribution
      )
    )
  return AuditReport(tuple(rows), tuple(gate), invariance_rows)
