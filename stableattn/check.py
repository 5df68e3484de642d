"""`check`: is a user's attention kernel's error normal for its format?

Applies FlashAttention's test rule: the kernel's max error against the FP64
golden value must be at most `factor` times the error of the same-policy
baseline attention, plus FlashAttention-3's absolute floor of a few ULPs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.dispatch import attention
from stableattn.golden import golden_attention
from stableattn.inputs import (
  DISTRIBUTIONS,
  make_inputs,
  round_to,
  shape_from_spec,
)
from stableattn.metrics import compare, rounding_floor, safe_ratio
from stableattn.precision import Precision

DEFAULT_SHAPES = ((1, 128, 4, 64), (2, 97, 4, 64), (1, 256, 2, 128))


@dataclasses.dataclass(frozen=True)
class CheckRow:
  shape: tuple[int, ...]
  distribution: str
  seed: int
  error: float  # max |fn - golden|
  baseline_error: float  # max |reference - golden|, same policy
  ratio: float
  floor: float
  passed: bool


@dataclasses.dataclass(frozen=True)
class CheckReport:
  precision: str
  factor: float
  rows: tuple[CheckRow, ...]

  @property
  def passed(self) -> bool:
    return all(r.passed for r in self.rows)

  def __str__(self) -> str:
    lines = [
      f"FlashAttention rule at {self.precision}: error <= {self.factor} x "
      "baseline error + floor",
      f"{'shape':>22} {'inputs':>8} {'error':>10} {'baseline':>10} "
      f"{'ratio':>7} {'floor':>9}  verdict",
    ]
    for r in self.rows:
      lines.append(
        f"{str(r.shape):>22} {r.distribution:>8} {r.error:10.3e} "
        f"{r.baseline_error:10.3e} {r.ratio:7.2f} {r.floor:9.2e}  "
        f"{'pass' if r.passed else 'FAIL'}"
      )
    lines.append("PASSED" if self.passed else "FAILED")
    return "\n".join(lines)


def _checked_settings(seeds, distributions: tuple, shapes) -> tuple:
  """Raises for settings that would check nothing; the distributions."""
  if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
    raise ValueError(f"seeds must be an integer >= 1, got {seeds!r}.")
  if not distributions:
    raise ValueError(
      f"distributions is empty; give at least one of {list(DISTRIBUTIONS)}."
    )
  bad = [d for d in distributions if d not in DISTRIBUTIONS]
  if bad:
    raise ValueError(
      f"Unknown distributions {bad}; valid: {list(DISTRIBUTIONS)}."
    )
  if shapes is not None and not len(shapes):
    raise ValueError("shapes is empty; give at least one shape, or None.")
  return distributions


def _check_one(fn, policy, spec, distribution, seed, causal, factor):
  """One input: fn's error and the same-policy baseline's, against golden."""
  q, k, v = (
    round_to(x, policy.inputs)
    for x in make_inputs(distribution, seed, shape_from_spec(spec))
  )
  golden = golden_attention(q, k, v, causal)
  # Exact: the inputs are already rounded to the policy's input format, and
  # NumPy holds it (no float64 reaches JAX, so no x64 warning).
  q, k, v = (jnp.asarray(x.astype(policy.dtype("inputs"))) for x in (q, k, v))
  baseline = attention(
    q, k, v, implementation="reference", precision=policy, causal=causal
  )
  out = fn(q, k, v)
  if out is None:
    raise ValueError(
      "fn returned None; it must return the attention output "
      f"[batch, q_len, heads, head_dim], here {golden.shape}."
    )
  out = np.asarray(jax.device_get(out)).astype(np.float64)
  if out.shape != golden.shape:
    raise ValueError(f"fn returned shape {out.shape}; expected {golden.shape}.")
  error = compare(golden, out).max_abs
  baseline = np.asarray(jax.device_get(baseline)).astype(np.float64)
  baseline_error = compare(golden, baseline).max_abs
  floor = rounding_floor(golden, policy.output)
  return CheckRow(
    shape=tuple(spec),
    distribution=distribution,
    seed=seed,
    error=error,
    baseline_error=baseline_error,
    ratio=safe_ratio(error, baseline_error),
    floor=floor,
    passed=bool(error <= factor * baseline_error + floor),
  )


def check(
  fn,
  *,
  precision: str | Precision = "bf16-fa2",
  shapes=None,
  causal: bool = False,
  distributions=("normal",),
  seeds: int = 1,
  factor: float = 2.0,
) -> CheckReport:
  """Runs `fn(q, k, v)` against golden and the same-policy baseline.

  Args:
    fn: attention function taking q [B,T,H,D], k, v [B,S,Hkv,D] (JAX arrays
      in the policy's input format) and returning [B,T,H,D].
    precision: policy of the baseline; inputs are rounded to its format.
    shapes: (batch, seq_len, heads, head_dim) or (batch, q_len, kv_len,
      heads, kv_heads, head_dim) tuples; a few defaults if None.
    causal: whether fn is causal (the references follow).
    distributions: input distributions from `stableattn.inputs`.
    seeds: inputs per shape and distribution.
    factor: allowed error ratio (FlashAttention uses 2; 3 for gradients).

  Returns:
    A `CheckReport`; `str(report)` is a table, `report.passed` the verdict.

  Raises:
    ValueError: for settings that would check nothing (no seeds, shapes or
      distributions) or an unknown distribution.
  """
  policy = Precision.from_name(precision)
  distributions = _checked_settings(seeds, tuple(distributions), shapes)
  rows = [
    _check_one(fn, policy, spec, distribution, seed, causal, factor)
    for spec in shapes or DEFAULT_SHAPES
    for distribution in distributions
    for seed in range(seeds)
  ]
  return CheckReport(policy.name, factor, tuple(rows))
