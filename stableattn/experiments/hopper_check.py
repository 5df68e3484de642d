"""The Hopper path (`implementation="mosaic_gpu"`) against the Triton path
on a CPU, both in interpret mode, case by case: where the policy fixes the
arithmetic they differ only where the products' FP32 sums are added in
another order (wgmma's in the GPU interpreter, XLA's dots in Triton's).

Each row is one case's output and gradients: how many entries differ, the
largest difference over the tensor's largest entry, each path's largest
error against FP64 (the same scale), and the interpreter's seconds for
the Hopper path's forward and backward. `launch/hopper_check.py` writes
the rows; docs/performance.md quotes `table(rows)`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.numerics.formats import to_dtype
from stableattn.numerics.precision import Precision
from stableattn.ops.dispatch import attention

TENSORS = ("out", "dq", "dk", "dv")
_FEATURE_RNG = np.random.default_rng(11)


def _bias_and_mask(q_len: int, kv_len: int) -> dict:
  """A per-head bias (2 heads) and a per-example dense mask (batch 2),
  drawn in turn from the cases' generator."""
  return {
    "bias": _FEATURE_RNG.standard_normal((1, 2, q_len, kv_len)).astype(
      np.float32
    ),
    "mask": _FEATURE_RNG.random((2, 1, q_len, kv_len)) < 0.7,
  }


# Split-KV decoding of a KV cache: 3 splits, merged by lse.
SPLIT_KV_DECODE = {
  "num_splits": 3,
  "causal": True,
  "causal_alignment": "bottom_right",
  "key_value_seq_lengths": np.array([230, 300]),
}
# name -> (precision, q_len, kv_len, heads, kv_heads, head_dim, features),
# head_dim an int or MLA's (query/key, value) pair: ragged on purpose, no
# length a multiple of the tiles but one.
CASES = {
  "causal-gqa": ("bf16-fa2", 96, 80, 2, 1, 64, {"causal": True}),
  "ragged-gqa": ("bf16-fa2", 70, 130, 4, 2, 64, {}),
  "fp16-causal-d128": ("fp16-fa2", 100, 100, 2, 1, 128, {"causal": True}),
  "exp2": ("bf16-fa2+exp2=on", 96, 96, 2, 2, 64, {}),
  "rounded-sum": ("bf16-fa2+softmax_sum=rounded_probs", 96, 96, 2, 2, 64, {}),
  # The smallest head dim: 16 columns padded to wgmma's 64.
  "causal-d16": ("bf16-fa2", 70, 90, 2, 1, 16, {"causal": True}),
  "key-lengths-d48": (
    "bf16-fa2", 96, 96, 2, 2, 48,
    {"key_value_seq_lengths": np.array([50, 96])},
  ),
  "bottom-right-empty-rows": (
    "bf16-fa2", 128, 64, 2, 2, 64,
    {"causal": True, "causal_alignment": "bottom_right"},
  ),
  "segments": (
    "bf16-fa2", 96, 96, 2, 2, 64,
    {"segment_ids": np.array([[0] * 40 + [1] * 56] * 2)},
  ),
  "bf16-stable-causal": ("bf16-fa2-stable", 96, 80, 2, 1, 64, {"causal": True}),
  "fp16-stable": ("fp16-fa2-stable", 96, 80, 2, 1, 64, {}),
  "mla-192-128": ("bf16-fa2", 96, 96, 2, 1, (192, 128), {"causal": True}),
  # A window narrower than a tile: key blocks before it are skipped in the
  # forward and dQ, query blocks past it in dK dV.
  "window-causal": (
    "bf16-fa2", 200, 200, 2, 1, 64,
    {"causal": True, "local_window_size": (40, 0)},
  ),
  "window-two-sided": (
    "bf16-fa2+exp2=on", 96, 150, 2, 2, 64, {"local_window_size": (30, 70)},
  ),
  # A per-head bias and a per-example dense mask on ragged lengths.
  "bias-mask": (
    "bf16-fa2", 96, 110, 2, 1, 64,
    _bias_and_mask(96, 110),
  ),
  # A KV cache: the last query on the last key of each example's own
  # lengths (per-example key positions).
  "bottom-right-lengths": (
    "bf16-fa2", 100, 130, 2, 1, 64,
    {
      "causal": True,
      "causal_alignment": "bottom_right",
      "query_seq_lengths": np.array([70, 100]),
      "key_value_seq_lengths": np.array([90, 130]),
    },
  ),
  "split-kv-decode": (
    "bf16-fa2", 4, 300, 4, 1, 64,
    SPLIT_KV_DECODE,
  ),
  # A cap near the scores' spread, so tanh bends them.
  "softcap": ("bf16-fa2", 96, 110, 2, 1, 64, {"causal": True, "softcap": 2.0}),
  # A sink per head (d(sink) too), one of them strong enough to take most
  # of each row's weight.
  "sink": (
    "bf16-fa2+exp2=on", 96, 90, 2, 1, 64,
    {"causal": True, "sink": np.array([0.5, 4.0], np.float32)},
  ),
  # Presets whose scores, statistics and accumulators are 16-bit: every
  # stage rounded where the Triton path rounds it.
  "bf16-every-stage": ("bf16", 96, 80, 2, 1, 64, {"causal": True}),
  "fp16-every-stage-d128": ("fp16", 100, 100, 2, 1, 128, {"causal": True}),
  "bf16-framework-ragged": ("bf16-framework", 70, 130, 4, 2, 64, {}),
  "fp16-framework-softcap": (
    "fp16-framework", 96, 110, 2, 1, 64, {"causal": True, "softcap": 2.0},
  ),
  # A bias and a sink rounded to 16-bit stages, in base 2.
  "bf16-every-stage-bias-sink": (
    "bf16+exp2=on", 96, 90, 2, 1, 64,
    {
      "causal": True,
      "bias": _FEATURE_RNG.standard_normal((1, 2, 96, 90)).astype(np.float32),
      "sink": np.array([0.5, 4.0], np.float32),
    },
  ),
  # m and l kept apart (softmax_residuals=max_sum) over 16-bit
  # statistics.
  "bf16-every-stage-max-sum": (
    "bf16+softmax_residuals=max_sum",
    96, 80, 2, 1, 64, {"causal": True},
  ),
  # Absorbed MLA (DeepSeek-V3's decoding form): the value dim in two
  # thread blocks of 256 columns, one K/V ring slot; in the backward
  # dQ and dK in three parts of 192 columns, dV in two of 256.
  "mla-576-512-decode": (
    "bf16-fa2", 1, 200, 8, 1, (576, 512),
    {"key_value_seq_lengths": np.array([150, 200])},
  ),
  "mla-576-512-causal": (
    "bf16-fa2", 70, 90, 2, 1, (576, 512), {"causal": True},
  ),
  # Decoding from an FP8 KV cache (read as BF16 before the kernel).
  "fp8-kv-cache-decode": (
    "bf16-fp8-kv-cache", 4, 300, 4, 1, 64,
    {
      "causal": True,
      "causal_alignment": "bottom_right",
      "key_value_seq_lengths": np.array([230, 300]),
    },
  ),
  # FP8 operands with FlashAttention-3's and SageAttention's scales
  # (forward only): per tensor with FP16 scores and statistics, per tile
  # with the Hadamard rotation, per token and per channel with P * 448.
  "fp8-baseline-lengths": (
    "fp8-baseline", 96, 130, 4, 2, 64,
    {"causal": True, "key_value_seq_lengths": np.array([90, 130])},
  ),
  "fp8-fa3-bias-mask": (
    "fp8-fa3", 96, 110, 2, 1, 64,
    _bias_and_mask(96, 110),
  ),
  "fp8-sage-split-kv-decode": (
    "fp8-sage", 4, 300, 4, 1, 64,
    SPLIT_KV_DECODE,
  ),
  # Head dim 256: dV and dK each in thread blocks of their own (the two
  # accumulators together would take 256 registers per thread).
  "causal-d256": ("bf16-fa2", 70, 90, 2, 1, 256, {"causal": True}),
  # A bias at head dim 320: dQ and dK in two column parts of 192 (Q and
  # K zero-padded to 384), S summed over two chunks, d(bias) stored by
  # the first part's thread block.
  "bias-d320": (
    "bf16-fa2", 70, 90, 2, 1, (320, 64),
    {"bias": _FEATURE_RNG.standard_normal((1, 2, 70, 90)).astype(np.float32)},
  ),
}  # fmt: skip


def inputs(case):
  """(q, k, v, d_out) in the case's input format, and its features."""
  precision, q_len, kv_len, heads, kv_heads, head_dim, features = case
  rng = np.random.default_rng(sum(map(ord, precision)) + q_len)
  dim, value_dim = head_dim if isinstance(head_dim, tuple) else (head_dim,) * 2
  shapes = (
    (2, q_len, heads, dim),
    (2, kv_len, kv_heads, dim),
    (2, kv_len, kv_heads, value_dim),
    (2, q_len, heads, value_dim),
  )
  dtype = to_dtype(Precision.from_name(precision).inputs)
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes], features


def differentiable(case) -> bool:
  """Whether the Hopper path has the case's gradient: operands of 16
  bits (FP8's is refused)."""
  return not Precision.from_name(case[0]).quantizes


def value_and_grads(implementation: str, case, **options) -> list[np.ndarray]:
  """[out, dq, dk, dv] in FP64 of one implementation on the case, under
  the case's policy (or `options`' precision); [out] where the case is
  not `differentiable`."""
  (q, k, v, d_out), features = inputs(case)
  if options.get("precision") == "fp64":  # the golden: the inputs widened
    q, k, v, d_out = (
      jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, d_out)
    )
  options = {"precision": case[0], **options}

  def fn(q, k, v):
    return attention(
      q, k, v, implementation=implementation, **features, **options
    )

  if not differentiable(case):
    return [np.asarray(fn(q, k, v), np.float64)]
  out, vjp = jax.vjp(fn, q, k, v)
  return [np.asarray(x, np.float64) for x in (out, *vjp(d_out))]


def golden(case) -> list[np.ndarray]:
  """[out, dq, dk, dv] of the FP64 reference on the case's inputs."""
  return value_and_grads("reference", case, precision="fp64")


def case_row(name: str) -> dict:
  """One case measured (needs jax's 64-bit mode for the golden)."""
  case = CASES[name]
  started = time.perf_counter()
  ours = value_and_grads("mosaic_gpu", case)
  seconds = time.perf_counter() - started
  triton = value_and_grads("pallas", case)
  wide = golden(case)
  row = {"case": name, "precision": case[0], "hopper_seconds": seconds}
  for tensor, a, b, g in zip(TENSORS, ours, triton, wide):
    scale = float(np.abs(g).max())
    row[tensor] = {
      "differ": int(np.sum(a != b)),
      "entries": int(a.size),
      "largest_difference": float(np.abs(a - b).max() / scale),
      "error_hopper": float(np.abs(a - g).max() / scale),
      "error_triton": float(np.abs(b - g).max() / scale),
      "finite": bool(np.isfinite(a).all()),
    }
  return row


def table(rows: list[dict]) -> str:
  """Per case: entries that differ (of all), the largest difference, and
  the two paths' largest errors against FP64, each over the tensor's
  largest FP64 entry."""
  columns = (
    "case", "policy", "tensor", "differ", "largest difference",
    "error, Hopper", "error, Triton", "seconds",
  )  # fmt: skip
  lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
  for r in rows:
    for i, tensor in enumerate(t for t in TENSORS if t in r):
      t = r[tensor]
      first = (r["case"], r["precision"]) if i == 0 else ("", "")
      seconds = f"{r['hopper_seconds']:.1f}" if i == 0 else ""
      lines.append(
        f"| {first[0]} | {first[1]} | {tensor} | {t['differ']} of "
        f"{t['entries']} | {t['largest_difference']:.1e} | "
        f"{t['error_hopper']:.2e} | {t['error_triton']:.2e} | {seconds} |"
      )
  return "\n".join(lines)


# The stable presets audited at every edge regime on both paths, each at
# the eager policy of its format (the audit's Baseline), as docs/audit.md
# audits them.
STABLE_AUDITS = (("bf16-fa2-stable", "bf16-framework"),
                 ("fp16-fa2-stable", "fp16-framework"))  # fmt: skip
REGIME_SHAPE = (1, 128, 2, 64)


def regime_rows(policy: str, audited: str, regime: str) -> list[dict]:
  """One regime's audit of our flash kernel under `policy` on each path:
  cases judged, cases n/a (a feature the path refuses), failures."""
  from stableattn.auditing.kernel_audit import audit
  from stableattn.ops.registry import resolve

  rows = []
  for implementation in ("mosaic_gpu", "pallas"):
    report = audit(
      resolve(implementation, precision=policy),
      precision=audited,
      regimes=regime,
      shapes=(REGIME_SHAPE,),
    )
    judged = {
      (r.get("detail"), r.get("features"))
      for r in report.rows
      if r.get("regime") == regime
    }
    rows.append({
      "policy": policy, "regime": regime, "implementation": implementation,
      "judged": len(judged), "not_applicable": len(report.regime_notes),
      "failures": list(report.failures),
      "errors": [str(e) for e in report.errors],
    })  # fmt: skip
  return rows


def regime_table(rows: list[dict]) -> str:
  """Per stable preset and regime: each path's judged cases, n/a cases
  and verdict (misses named by tensor)."""

  def cell(r):
    if not r["judged"]:
      return f"n/a ({r['not_applicable']})"
    verdict = (
      "passes"
      if not r["failures"] and not r["errors"]
      else (f"misses {len(r['failures'])}, errors {len(r['errors'])}")
    )
    na = f", {r['not_applicable']} n/a" if r["not_applicable"] else ""
    return f"{verdict} ({r['judged']} cases{na})"

  by_key = {(r["policy"], r["regime"], r["implementation"]): r for r in rows}
  lines = ["| preset | regime | mosaic_gpu | pallas |", "|---|---|---|---|"]
  for policy, regime in dict.fromkeys((r["policy"], r["regime"]) for r in rows):
    ours, triton = (
      by_key[(policy, regime, i)] for i in ("mosaic_gpu", "pallas")
    )
    lines.append(f"| {policy} | {regime} | {cell(ours)} | {cell(triton)} |")
  return "\n".join(lines)
