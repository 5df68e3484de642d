"""What the flash forward keeps for its backward, by the policy's
stability options (`quant_options.STABILITY_OPTIONS`).

FlashAttention-2/3 and cuDNN keep O as stored and one FP32 log-sum-exp
per query row. The options keep more, or compute from it differently:
  * softmax_residuals=max_sum: the row's max m and sum l apart (tokamax's
    residuals), so the backward's P = exp(s - m) * (1 / l) is normalized
    as the forward normalized it, instead of exp(s - lse) with the lse's
    rounding (an ulp of a score near 100 is 8e-6: a relative error of P).
  * delta_source=fp32: O in `out_accum` for delta = rowsum(dO * O);
    delta_source=hi_lo: O's rounding residual O - round(O) in `output`
    beside O (O_hi + O_lo, about twice O's bits); delta_source=probs:
    nothing kept, delta = rowsum(P * dP) recomputed in the backward from
    its own P, as eager attention's backward has it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stableattn.kernels.block_math import no_key_safe
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.numerics.precision import Precision

# What the forward also writes for the attention monitor, per row: the
# largest raw score and the second largest (equal to it where the row's
# maximum is tied), so the monitor's statistics come from the kernel's own
# pass (`stableattn.numerics.monitor.kernel_statistics`).
MONITOR_RESIDUALS = ("row_max", "second")


def residual_names(policy: Precision) -> tuple[str, ...]:
  """The outputs the forward writes for the backward beyond O and the
  log-sum-exp: the row max and sum ("m", "l") with
  softmax_residuals=max_sum; O in `out_accum` ("o_fp32") or O's rounding
  residual in `output` ("o_lo") with delta_source=fp32 or hi_lo."""
  found = ()
  if policy.softmax_residuals == "max_sum":
    found += ("m", "l")
  if policy.delta_source == "fp32":
    found += ("o_fp32",)
  elif policy.delta_source == "hi_lo":
    found += ("o_lo",)
  return found


def store_residuals(refs: dict, ar, acc_BqxD, stats_Bq) -> None:
  """Writes the extra residuals of one query block: the row max (0 where
  no key attends) and sum (1 there), O in `out_accum`, or O - round(O)
  in `output` (exact in the carrier: round(O) is O's nearest
  neighbour). `acc_BqxD` is the normalized output accumulator."""
  m_Bq, l_safe_Bq = stats_Bq
  if "m" in refs:
    refs["m"][...] = ar.stored(no_key_safe(m_Bq), "softmax_stats")
    refs["l"][...] = ar.stored(l_safe_Bq, "softmax_stats")
  if "o_fp32" in refs:
    refs["o_fp32"][...] = ar.stored(acc_BqxD, "out_accum")
  if "o_lo" in refs:
    o_hi = ar.round(acc_BqxD, "output")
    refs["o_lo"][...] = ar.stored(acc_BqxD - o_hi, "output")


def check_split_residuals(cfg: KernelConfig, extra) -> None:
  """Split-KV merges its splits by lse alone (`merge_splits`), so the
  residuals `extra` a stable backward needs do not exist: refused (the
  forward alone runs)."""
  if extra and cfg.blocks_per_split is not None:
    raise ValueError(
      f"precision {cfg.policy.name!r} keeps residuals for a stable "
      "backward, which split-KV (num_splits, split_size) does not "
      "produce: drop the split options or the stability options."
    )


def residual_specs(cfg: KernelConfig, o_shape, specs, extra):
  """BlockSpecs and shapes of the extra residuals `extra`: rows like the
  lse (m, l), tiles like O (o_fp32, o_lo). `o_shape`: O's padded shape;
  `specs`: O's and the lse's BlockSpecs.
  Split-KV writes none: its partial outputs are merged by lse only."""
  if set(extra) & set(MONITOR_RESIDUALS) and cfg.blocks_per_split is not None:
    raise ValueError(
      "the monitor's statistics from the kernel need one pass over each "
      "row's keys; split-KV (num_splits, split_size) splits them: drop the "
      "split options, or take the statistics from q and k "
      "(stableattn.numerics.monitor.attention_statistics)."
    )
  check_split_residuals(cfg, extra)
  o_spec, lse_spec = specs
  batch, q_len_padded, heads, _ = o_shape
  dtype = cfg.policy.dtype
  rows = (batch, heads, q_len_padded)
  shapes = {
    "m": (lse_spec, jax.ShapeDtypeStruct(rows, dtype("softmax_stats"))),
    "l": (lse_spec, jax.ShapeDtypeStruct(rows, dtype("softmax_stats"))),
    "o_fp32": (o_spec, jax.ShapeDtypeStruct(o_shape, dtype("out_accum"))),
    "o_lo": (o_spec, jax.ShapeDtypeStruct(o_shape, dtype("output"))),
    # Scores as the kernel rounded them: exact in the scores' format.
    "row_max": (lse_spec, jax.ShapeDtypeStruct(rows, dtype("scores"))),
    "second": (lse_spec, jax.ShapeDtypeStruct(rows, dtype("scores"))),
  }
  return [shapes[n][0] for n in extra], [shapes[n][1] for n in extra]


def softmax_stats_of(lse, extra: dict) -> tuple:
  """The row vectors the backward recomputes P from: (lse,) or (m, l)."""
  return (extra["m"], extra["l"]) if "m" in extra else (lse,)


def stats_count(cfg: KernelConfig) -> int:
  """How many row vectors the softmax residuals are: lse, or m and l."""
  return 2 if cfg.policy.softmax_residuals == "max_sum" else 1


def residual_bytes_per_row(policy: Precision, head_dim: int) -> dict:
  """Bytes the forward writes and the backward keeps per query row and
  head beyond the base kernel's (O and one lse): {name: bytes}."""
  dtype = policy.dtype
  sizes = {
    # Beside the lse, which the sink's gradient and return_lse still read.
    "m": dtype("softmax_stats").itemsize,
    "l": dtype("softmax_stats").itemsize,
    "o_fp32": head_dim * dtype("out_accum").itemsize,
    "o_lo": head_dim * dtype("output").itemsize,
  }
  return {name: sizes[name] for name in residual_names(policy)}


def initial_top_two(refs: dict, ar, block_q: int) -> tuple:
  """The running (largest, second largest) score of each row before the
  first key block, where the monitor's residuals are asked for; else ()."""
  if "row_max" not in refs:
    return ()
  no_score = jnp.full((block_q,), -jnp.inf, ar.carrier)
  return no_score, no_score


def merged_top_two(top_two, s_BqxBk):
  """The running largest and second largest raw score of each row, with
  this block's: the second equals the largest where the largest is tied
  (two keys at it), in this block or across blocks. `()` (the monitor's
  residuals not asked for) stays `()`."""
  if not top_two:
    return top_two
  top_Bq, second_Bq = top_two
  block_top = jnp.max(s_BqxBk, axis=-1)
  at_top = s_BqxBk == block_top[:, None]
  rest = jnp.max(jnp.where(at_top, -jnp.inf, s_BqxBk), axis=-1)
  tied = jnp.sum(at_top.astype(jnp.int32), axis=-1) > 1
  block_second = jnp.where(tied, block_top, rest)
  second_Bq = jnp.maximum(
    jnp.minimum(top_Bq, block_top), jnp.maximum(second_Bq, block_second)
  )
  return jnp.maximum(top_Bq, block_top), second_Bq


def store_top_two(refs: dict, ar, top_two) -> None:
  """Writes each row's largest and second largest score (`row_max`,
  `second`), exact in the scores' format."""
  for name, value in zip(MONITOR_RESIDUALS, top_two):
    refs.pop(name)[...] = ar.stored(value, "scores")
