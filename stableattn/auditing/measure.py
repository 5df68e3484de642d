"""Measuring one kernel on one input: output and gradients against FP64
and the same-policy Baseline, under every rule, with determinism, NaN
counts and the checks of edge regimes (rows that must be 0, learned
features that must get a gradient)."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from stableattn.auditing.inputs import round_to
from stableattn.contract.golden import (
  golden_attention,
  golden_attention_vjp,
  gradient_logit_sensitivity,
  logit_sensitivity,
)
from stableattn.contract.options import Options
from stableattn.numerics.formats import to_dtype
from stableattn.numerics.metrics import compare
from stableattn.numerics.precision import Precision
from stableattn.numerics.rules import RULES, flashattention_rule
from stableattn.ops.registry import resolve, unaccepted_features

TENSORS = ("out", "dq", "dk", "dv")
# Features that are learned, so get a gradient audited like dQ/dK/dV, in
# the order `golden_attention_vjp` returns them.
GRADIENT_FEATURES = ("bias", "sink")


def quality(golden, x) -> dict:
  """What users quote beside the rules: cosine, relative L1, SNR (dB),
  the signed share of errors (Qiu & Yao), and non-finite counts."""
  g, d = golden.ravel(), (x - golden).ravel()
  finite = np.isfinite(x).ravel()
  norm = np.linalg.norm(g) * np.linalg.norm(x.ravel())
  cosine = float(np.dot(g, x.ravel()) / norm) if norm else float("nan")
  noise, signal = float(np.sum(d**2)), float(np.sum(g**2))
  if noise == 0:
    snr_db = float("inf")
  elif signal == 0:  # a gradient that is exactly 0 (one key per row)
    snr_db = float("-inf")
  else:
    snr_db = 10 * math.log10(signal / noise)
  deviation = compare(golden, x)
  return {
    "cosine": cosine,
    "rel_l1": float(np.sum(np.abs(d)) / max(np.sum(np.abs(g)), 1e-300)),
    "snr_db": snr_db,
    "max_abs": deviation.max_abs,
    "signed_share": deviation.signed_share,
    "nonfinite": int(np.size(x) - np.count_nonzero(finite)),
  }


class ContractError(ValueError):
  """The kernel breaks the calling contract (an output of the wrong shape
  or dtype, a feature its signature cannot take): no case can be judged,
  so the audit stops, where a kernel's own error on one case is a row."""


def first_line(error: BaseException) -> str:
  """ "TypeName: the message's first line", as a report quotes an error."""
  text = str(error).strip()
  first = text.splitlines()[0][:300] if text else ""
  return f"{type(error).__name__}: {first}" if first else type(error).__name__


def interpreter_reset() -> None:
  """jax's GPU interpret mode keeps its simulated memory after a kernel
  raises, so that it can be examined, and every kernel interpreted after
  it in the process then fails too (its documented behaviour, jax
  0.10-0.11): reset it, so that one case's error is not the next
  case's."""
  module = sys.modules.get("jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks")
  if module is not None:
    module.reset_gpu_interpret_mode_state()


def error_row(label: dict, policy: Precision, error: BaseException) -> dict:
  """The row of a case the kernel raised on: its label, the policy and
  the error's type and first line."""
  return {**label, "policy": policy.name, "error": first_line(error)}


def _call(fn, q, k, v, features: dict):
  out = fn(q, k, v, **features)
  expected = (*q.shape[:3], v.shape[3])
  if out is None or tuple(getattr(out, "shape", ())) != expected:
    got = getattr(out, "shape", None) or type(out).__name__
    raise ContractError(
      f"the kernel returned {None if out is None else got}; the contract "
      f"is an output shaped like q with v's head dim, {expected} (a "
      "kernel returning (out, lse) is wrapped to return out)."
    )
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise ContractError(
      f"the kernel returned dtype {out.dtype}; the contract is a floating "
      "output (the inputs' dtype or wider)."
    )
  return out


def _as_f64(arrays) -> list:
  return [np.asarray(jax.device_get(x)).astype(np.float64) for x in arrays]


def _values_and_grads(
  fn, q, k, v, d_out, features: dict, gradients: bool, extra=()
):
  """fn's output and, with `gradients`, (dq, dk, dv) for cotangent d_out,
  then the gradients of the features named in `extra` (of
  `GRADIENT_FEATURES`, in its order), as float64 arrays."""
  if not gradients:
    return _as_f64([_call(fn, q, k, v, features)])

  def forward(q, k, v, *values):
    return _call(fn, q, k, v, {**features, **dict(zip(extra, values))})

  arrays = [jnp.asarray(features[n]) for n in extra]
  out, vjp = jax.vjp(forward, q, k, v, *arrays)
  return _as_f64([out, *vjp(jnp.asarray(d_out).astype(out.dtype))])


def check_accepts(fn, features: dict, kernel: str = "the kernel") -> None:
  """One clear line when fn cannot take a feature the audit passes."""
  missing = unaccepted_features(fn, features)
  if missing:
    raise ContractError(
      f"{kernel} does not accept the feature(s) {missing} that this audit "
      "passes (the contract is fn(q, k, v, **features), jax's names); "
      "audit it without them or add them to its signature."
    )


@dataclasses.dataclass(frozen=True)
class EdgeChecks:
  """What an edge case checks beyond the rules (all optional).

  Attributes:
    empty_rows: [batch, q_len] bool, the query rows no key may attend;
      the kernel's output and dQ there must be exactly 0.
    poison: [batch, kv_len] bool, keys that no query may attend; the
      kernel runs with `poison_value` written into K and V there, the
      golden value and the Baseline on the clean inputs, and each row
      says whether the poisoned run equals the clean run bit for bit.
    unjudged_rows: [batch, q_len] bool, rows whose value is a convention
      (fully masked by a finite bias: 0, or the mean of V): their output
      is left out of the rules and reported against both conventions,
      and their cotangent is 0, so no gradient depends on it.
    d_out: the output cotangent (float64), in place of a random one.
  """

  empty_rows: np.ndarray | None = None
  poison: np.ndarray | None = None
  poison_value: float = float("nan")
  unjudged_rows: np.ndarray | None = None
  d_out: np.ndarray | None = None


def _cotangent(q_shape, v, policy: Precision, seed: int, edge: EdgeChecks):
  """dO: the case's own or a random one, 0 on unjudged rows, rounded."""
  shape = (*q_shape[:3], v.shape[3])
  if edge.d_out is None:
    d_out = np.random.default_rng(10_000 + seed).standard_normal(shape)
  else:
    d_out = np.array(edge.d_out, np.float64)
  if edge.unjudged_rows is not None:
    d_out[np.asarray(edge.unjudged_rows)] = 0.0
  return round_to(d_out, policy.output)


def _poisoned(args, edge: EdgeChecks):
  """(q, k, v) with `edge.poison_value` in the poisoned keys of k and v."""
  if edge.poison is None:
    return args
  keys = jnp.asarray(edge.poison)[:, :, None, None]
  q, k, v = args
  return [q] + [
    jnp.where(keys, jnp.asarray(edge.poison_value, x.dtype), x) for x in (k, v)
  ]


def measure_arrays(
  fn,
  policy: Precision,
  label: dict,
  arrays,
  features: dict,
  repeats: int,
  tensors=TENSORS,
  rules=RULES,
  edge: EdgeChecks = EdgeChecks(),
):
  """Rows (one per tensor, learned features' gradients after dQ/dK/dV) of
  fn on float64 `arrays` (q, k, v) rounded to the policy's inputs, with
  the checks of an edge case (`EdgeChecks`)."""
  gradients = tensors != ("out",)
  q, k, v = (round_to(x, policy.inputs) for x in arrays)
  d_out = _cotangent(q.shape, v, policy, label["seed"], edge)
  check_accepts(fn, features)
  golden = [golden_attention(q, k, v, **features)]
  if gradients:
    golden += golden_attention_vjp(q, k, v, d_out, **features)
    tensors = tuple(tensors) + tuple(
      f"d{n}" for n in GRADIENT_FEATURES if n in features
    )
  dtype = policy.dtype("inputs")
  args = [jnp.asarray(x.astype(dtype)) for x in (q, k, v)]
  d_out = d_out.astype(policy.dtype("output"))

  ours = resolve("reference", Options(precision=policy))
  extra = [n for n in GRADIENT_FEATURES if n in features and gradients]
  baseline = _values_and_grads(ours, *args, d_out, features, gradients, extra)
  wanted = len(extra)
  run_args = _poisoned(args, edge)
  first, extra, note = _first_run(
    fn, run_args, d_out, features, gradients, extra
  )
  tensors = tensors[: len(tensors) - (wanted - len(extra))]
  if "gradients" in note:
    tensors, gradients = ("out",), False
  runs = [first] + [
    _values_and_grads(fn, *run_args, d_out, features, gradients, extra)
    for _ in range(repeats - 1)
  ]
  clean = None
  if edge.poison is not None:
    clean = _values_and_grads(fn, *args, d_out, features, gradients, extra)
  floor_of = _logit_floors((q, k, v, d_out), features)
  rows = []
  for i, tensor in enumerate(tensors):
    values = (golden[i], [r[i] for r in runs], baseline[i])
    row = _row(
      label, policy, tensor, *_judged(tensor, values, edge),
      _with_logit_floor(rules, tensor, floor_of),
    )  # fmt: skip
    row.update(note)
    row.update(_edge_columns(tensor, runs[0][i], edge, v, clean, i))
    rows.append(row)
  return rows


def _judged(tensor, values, edge: EdgeChecks):
  """(golden, runs, baseline) with the unjudged rows left out of the
  output (they are reported apart, `_edge_columns`)."""
  if tensor != "out" or edge.unjudged_rows is None:
    return values
  keep = ~np.asarray(edge.unjudged_rows)
  golden, runs, baseline = values
  return golden[keep], [r[keep] for r in runs], baseline[keep]


def _edge_columns(tensor, x, edge: EdgeChecks, v, clean, i) -> dict:
  """The edge checks' columns of one tensor's row."""
  out = {}
  if edge.empty_rows is not None and tensor in ("out", "dq"):
    at_empty = x[np.asarray(edge.empty_rows)]
    out["empty_rows_max"] = float(np.max(np.abs(at_empty), initial=0.0))
  if clean is not None:
    out["poison_bitwise"] = bool(np.array_equal(x, clean[i]))
    with np.errstate(invalid="ignore"):
      out["poison_max_diff"] = float(np.max(np.abs(x - clean[i])))
  if edge.unjudged_rows is not None and tensor == "out":
    rows = np.asarray(edge.unjudged_rows)
    at_rows = x[rows]  # [n, heads, head_dim]
    group = x.shape[2] // v.shape[2]
    mean_v = np.repeat(v.mean(axis=1), group, axis=1)  # [B, heads, dv]
    mean_at = np.broadcast_to(mean_v[:, None], x.shape)[rows]
    out["masked_rows_vs_zero"] = float(np.max(np.abs(at_rows), initial=0.0))
    out["masked_rows_vs_mean_v"] = float(
      np.max(np.abs(at_rows - mean_at), initial=0.0)
    )
  return out


def _logit_floors(arrays, features):
  """floor(tensor, dtype): the largest movement of "out", "dq", "dk" or
  "dv" that logits an ulp apart leave: the output's first-order bound
  (`golden.logit_sensitivity`), the gradients' measured change
  (`golden.gradient_logit_sensitivity`, computed once for all three).
  `arrays` are (q, k, v, d_out)."""
  q, k, v, d_out = arrays

  @functools.cache
  def moved_gradients(dtype):
    moved = gradient_logit_sensitivity(q, k, v, d_out, dtype, **features)
    return dict(zip(("dq", "dk", "dv"), moved))

  def floor(tensor, dtype):
    if tensor == "out":
      bound = logit_sensitivity(q, k, v, dtype, **features)
    else:
      bound = moved_gradients(dtype)[tensor]
    return float(np.max(bound, initial=0.0))

  return floor


def _with_logit_floor(rules, tensor, floor_of):
  """At FP32 and FP64, FlashAttention's rule on the output and on dQ, dK
  and dV with the floor that logits an ulp apart leave (`floor_of`, from
  `_logit_floors`). Where logits are in the hundreds and thousands, two
  correct kernels' values differ by more than the rule's multiple of the
  Baseline's error (docs/audit.md, "Large logits off the tuned shapes").
  Computed only where the rule would fail without it."""
  fa = rules.get("flashattention")
  if tensor not in ("out", "dq", "dk", "dv") or fa is not flashattention_rule:
    return rules

  def with_floor(golden, x, baseline, fmt, gradient):
    plain = fa(golden, x, baseline, fmt, gradient)
    wide = fmt in ("fp32", "fp64")
    if plain.passed or not wide or not np.all(np.isfinite(x)):
      return plain
    floor = floor_of(tensor, np.dtype(to_dtype(fmt)))
    return fa(golden, x, baseline, fmt, gradient, logit_floor=floor)

  return {**rules, "flashattention": with_floor}


def _first_run(fn, args, d_out, features, gradients, extra):
  """(values, the feature gradients taken, a note) of fn's first run.

  A kernel that takes its features as constants (one run eagerly outside
  JAX, e.g. PyTorch's) is judged on dQ/dK/dV only; one with no VJP (a
  decode kernel) on its output alone. Each says why in the note; a
  forward that raises raises.
  """
  try:
    values = _values_and_grads(fn, *args, d_out, features, gradients, extra)
    return values, extra, {}
  except ContractError:
    raise
  except Exception as e:  # noqa: BLE001 - any kernel's own refusal
    error = e
  if extra:
    try:
      values = _values_and_grads(fn, *args, d_out, features, gradients)
      taken = f"not taken: {first_line(error)}"
      return values, (), {"feature_gradients": taken}
    except ContractError:
      raise
    except Exception as e:  # noqa: BLE001
      error = e
  if not gradients:
    raise error
  values = _values_and_grads(fn, *args, d_out, features, False)
  why = f"n/a: the kernel has no VJP ({first_line(error)})"
  return values, (), {"gradients": why}


def rule_ratio(row: dict, rule: str) -> float:
  """A row's value / limit under `rule`: inf for NaN, and for a limit of
  0 (the baseline exact) inf unless the value is 0 too."""
  value, limit = row[f"{rule}_value"], row[f"{rule}_limit"]
  if isinstance(value, float) and math.isnan(value):
    return math.inf
  if limit > 0:
    return value / limit
  return math.inf if value > 0 else 0.0


def _row(label, policy, tensor, golden, runs, baseline, rules) -> dict:
  x = runs[0]
  gradient = tensor != "out"
  fmt = policy.output if not gradient else policy.inputs
  # Where the same-policy baseline is exact (one key, one query), a ratio
  # to its error of 0 would demand exactness of every kernel; the golden
  # value rounded to the format stands in, the best any kernel can give.
  baseline_exact = bool(np.array_equal(baseline, golden))
  baseline_max_abs = float(np.max(np.abs(baseline - golden)))
  if baseline_exact:
    baseline = round_to(golden, fmt)
  judged = [rule(golden, x, baseline, fmt, gradient) for rule in rules.values()]
  return {
    **label,
    "tensor": tensor,
    "policy": policy.name,
    "deterministic": all(np.array_equal(x, r, equal_nan=True) for r in runs),
    "repeats": len(runs),
    **{f"{j.rule}_value": j.value for j in judged},
    **{f"{j.rule}_limit": j.limit for j in judged},
    **{f"{j.rule}_passed": j.passed for j in judged},
    **{f"{j.rule}_applies": j.applies for j in judged},
    **{
      f"{j.rule}_logit_floor": j.logit_floor
      for j in judged
      if j.rule == "flashattention"
    },
    **quality(golden, x),
    "baseline_max_abs": baseline_max_abs,
    "baseline_exact": baseline_exact,
    # A learned feature whose gradient never reaches the kernel's inputs
    # (where FP64's is large enough for the format to hold: a sink of
    # 100 leaves d(sink) near 1e-43, below FP32's normal range).
    "no_gradient": bool(
      tensor in ("dbias", "dsink")
      and not np.any(x)
      and np.any(np.abs(golden) >= ml_dtypes.finfo(to_dtype(fmt)).tiny)
    ),
  }
