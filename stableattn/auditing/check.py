"""`check`: is a user's attention kernel's error normal for its format?

The audit (`stableattn.auditing.kernel_audit`) restricted to the forward
output and FlashAttention's rule: the kernel's max error against the FP64 golden
value must be at most `factor` times the error of the same-policy
baseline attention, plus FlashAttention-3's absolute floor of a few ULPs.
"""

from __future__ import annotations

import dataclasses
import functools

from stableattn.auditing.kernel_audit import audit
from stableattn.numerics.metrics import safe_ratio
from stableattn.numerics.precision import Precision
from stableattn.numerics.rules import flashattention_rule

DEFAULT_SHAPES = ((1, 128, 4, 64), (2, 97, 4, 64), (1, 256, 2, 128))


@dataclasses.dataclass(frozen=True)
class CheckRow:
  shape: str
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
        f"{r.shape:>22} {r.distribution:>8} {r.error:10.3e} "
        f"{r.baseline_error:10.3e} {r.ratio:7.2f} {r.floor:9.2e}  "
        f"{'pass' if r.passed else 'FAIL'}"
      )
    lines.append("PASSED" if self.passed else "FAILED")
    return "\n".join(lines)


def _row(r: dict, factor: float) -> CheckRow:
  error, limit = r["flashattention_value"], r["flashattention_limit"]
  baseline_error = r["baseline_max_abs"]
  return CheckRow(
    shape=r["shape"],
    distribution=r["distribution"],
    seed=r["seed"],
    error=error,
    baseline_error=baseline_error,
    ratio=safe_ratio(error, baseline_error),
    floor=limit - factor * baseline_error,
    passed=r["flashattention_passed"],
  )


def check(
  fn,
  *,
  precision: str | Precision = "bf16-fa2",
  shapes=None,
  causal: bool = False,
  features=None,
  distributions=("normal",),
  seeds: int = 1,
  factor: float = 2.0,
) -> CheckReport:
  """Runs `fn(q, k, v, **features)` against golden and the same-policy
  baseline, forward only.

  Args:
    fn: attention function taking q [B,T,H,D], k, v [B,S,Hkv,D] (JAX arrays
      in the policy's input format) and the features that are set, and
      returning [B,T,H,D].
    precision: policy of the baseline; inputs are rounded to its format.
    shapes: (batch, seq_len, heads, head_dim) or (batch, q_len, kv_len,
      heads, kv_heads, head_dim) tuples; a few defaults if None.
    causal, features: as for `stableattn.auditing.kernel_audit`.
    distributions: input distributions from `stableattn.auditing.inputs`
      ("normal,uniform", a list or one name).
    seeds: inputs per shape and distribution.
    factor: allowed error ratio (FlashAttention uses 2; 3 for gradients).

  Returns:
    A `CheckReport`; `str(report)` is a table, `report.passed` the verdict.

  Raises:
    ValueError: for settings that would check nothing (no seeds, shapes or
      distributions), an unknown distribution, or a feature fn does not
      accept.
  """
  policy = Precision.from_name(precision)
  report = audit(
    fn,
    precision=policy,
    shapes=DEFAULT_SHAPES if shapes is None else shapes,
    distributions=distributions,
    seeds=seeds,
    features=features,
    causal=causal,
    repeats=1,
    gate=("flashattention",),
    tensors=("out",),
    rules={
      "flashattention": functools.partial(flashattention_rule, factor=factor)
    },
  )
  rows = tuple(_row(r, factor) for r in report.rows)
  return CheckReport(policy.name, factor, rows)
