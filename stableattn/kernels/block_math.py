"""Per-block arithmetic shared by the forward and backward Pallas kernels.

Every function takes 2-D tiles already loaded from refs and a
`PolicyArithmetic`, which rounds each result to its stage (see
`rounding.py`). Values come back in the carrier format. Names carry shapes:
`BqxD` is a tile of `block_q` rows and `D` columns, `BqxBk` a tile of
scores.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stableattn.contract.masking import logits_in_base, scores, softcap_slope
from stableattn.numerics.formats import format_name
from stableattn.numerics.rounding import PolicyArithmetic

# Contract the last dimension of both operands: A @ B^T.
NT_DIMS = (((1,), (1,)), ((), ()))
# Plain A @ B.
NN_DIMS = (((1,), (0,)), ((), ()))
# Contract the first dimension of both operands: A^T @ B.
TN_DIMS = (((0,), (0,)), ((), ()))


def scaled_dot(a, b, dims, ar: PolicyArithmetic, scale: float, stage: str):
  """(A B) * scale: the product rounded to `matmul_accum`, then to `stage`."""
  product = ar.dot(a, b, dims)
  return ar.round(product * jnp.asarray(scale, product.dtype), stage)


def block_scores(
  q_BqxD,
  k_BkxD,
  *,
  ar: PolicyArithmetic,
  spec,
  mask,
  bias,
  scales=None,
  base2: bool = False,
):
  """S = Q K^T * scale (softcapped if set) in `scores`, held in
  `softmax_stats`, plus the bias (rounded to `scores`) if any; with
  `base2` in base 2 (`masking.scores`), the forward's softmax under the
  policy option `exp2`.

  Masked pairs are -inf.

  Args:
    spec: the `masking.MaskSpec`.
    mask: boolean [block_q, block_k] or None when every pair attends.
    bias: [block_q, block_k] or None.
    scales: (q row scales [block_q], k row scales [block_k]) of operands
      below 16 bits (see `quantization.py`), or None.

  Returns:
    (S, tanh of the softcap or None), both [block_q, block_k].
  """
  dot = ar.dot
  if ar.policy.mma_chunk:
    dot = ar.mma_dot
  elif ar.policy.score_chunk:
    dot = ar.blocked_dot
  if scales is None:
    product = dot(q_BqxD, k_BkxD, NT_DIMS)
  else:
    q_scale, k_scale = scales
    product = dot(
      q_BqxD * (1.0 / q_scale)[:, None],
      k_BkxD * (1.0 / k_scale)[:, None],
      NT_DIMS,
    ) * (q_scale[:, None] * k_scale[None, :])
  s, tanh = scores(
    product, spec, ar, base2, functools.partial(kept_scaled, ar=ar)
  )
  s = ar.round(s, "softmax_stats")
  if bias is not None:
    bias = logits_in_base(bias, ar, base2, "scores")
    s = ar.round(s + bias, "softmax_stats")
  if mask is not None:
    s = masked_fill(mask, s, -jnp.inf)
  return s, tanh


# The name scope of `kept_scaled`'s product: not one of the algorithm's
# matmuls.
KEPT_SCALED_SCOPE = "kept_scaled"


def kept_scaled(x_BqxBk, factor, *, ar: PolicyArithmetic):
  """x * factor rounded once, as the policy says, also where XLA would
  not keep that rounding.

  Inside an XLA program (interpret mode) with scores in the carrier's
  format, no rounding op follows the product, and XLA:CPU copies the
  cheap product into each consumer's fusion, where LLVM contracts it with
  the subtraction of the row max into one fused multiply-add: the
  forward's softmax sum then adds exp(x c - m) unrounded while m is the
  max of the rounded x c, and the backward, which keeps S, gets P as the
  rounded scores give it. At a score of 7,000 (an ulp of 4.9e-4) one
  query over 37 keys had dV 126x FlashAttention's limit. A product with
  the diagonal matrix factor * I is a dot, which XLA neither copies nor
  contracts, and each of its entries has one nonzero term: x * factor,
  rounded once. Non-finite entries (a NaN key in padding) would spread
  through the dot's zero terms, so they take the plain product. In a
  compiled Triton body the product is written as it is.
  """
  narrower = format_name(ar.policy.scores) != format_name(ar.carrier)
  if ar.casts_round or narrower or x_BqxBk.ndim != 2:
    return x_BqxBk * factor
  finite = jnp.isfinite(x_BqxBk)
  columns = x_BqxBk.shape[-1]
  diagonal = jnp.eye(columns, dtype=x_BqxBk.dtype) * factor
  # The scope names it for a count of the algorithm's matmuls.
  with jax.named_scope(KEPT_SCALED_SCOPE):
    product = lax.dot_general(
      jnp.where(finite, x_BqxBk, jnp.zeros_like(x_BqxBk)),
      diagonal,
      NN_DIMS,
      precision=lax.Precision.HIGHEST,
      preferred_element_type=x_BqxBk.dtype,
    )
  return jnp.where(finite, product, x_BqxBk * factor)


def unattended_keys_zeroed(mask, *tiles_BkxD):
  """K or V tiles with 0 in the rows of keys that no query of the tile
  attends (`mask` [block_q, block_k], or None: every key is attended).

  P is 0 at such keys, but 0 x NaN is NaN: padding or a cache's unused
  slots holding NaN or Inf would reach the output through P V and the
  gradients through dO V^T and dS K.
  """
  if mask is None:
    return tiles_BkxD
  # A max, not jnp.any: Triton's lowering has no reduce_or.
  attended_Bk = jnp.max(mask.astype(jnp.int32), axis=0)
  return tuple(
    masked_fill(jnp.broadcast_to(attended_Bk[:, None], t.shape), t, 0.0)
    for t in tiles_BkxD
  )


_BITS = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def masked_fill(keep, x, fill: float):
  """jnp.where(keep, x, fill) with no boolean tile at a select.

  `keep`: booleans or 0/1 integers of x's shape. Triton keeps a select's
  condition tile as i1, and moving an i1 tile between register layouts
  goes through shared memory, which Triton refuses below a byte
  (triton-lang/triton #10351: split-KV decoding with key lengths stopped
  compiling). Here the condition becomes an all-ones or all-zeros integer
  mask of x's width, and the result is x's bits ANDed with it, ORed with
  the fill's bits where it is zero: exact for every x, NaN included.
  """
  bits = _BITS[jnp.dtype(x.dtype).itemsize]
  ones = -(keep.astype(bits))  # two's complement: -1 is every bit set
  x_bits = lax.bitcast_convert_type(x, bits)
  fill_bits = np.asarray(fill, x.dtype).view(bits)
  return lax.bitcast_convert_type(
    (x_bits & ones) | (fill_bits & ~ones), x.dtype
  )


def no_key_safe(m):
  """The maximum to subtract: 0 for a row with no key yet (m = -inf), so
  exp(-inf - m) is 0, never exp(-inf + inf) = NaN."""
  return jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)


def stats_exp(x, ar: PolicyArithmetic, base2: bool = False):
  """exp(x), or 2^x with `base2`, rounded to `softmax_stats` (x already in
  that format)."""
  return ar.round(jnp.exp2(x) if base2 else jnp.exp(x), "softmax_stats")


def stored_lse(m, l_sum, ar: PolicyArithmetic, base2: bool = False):
  """The log-sum-exp m + log(l) in `softmax_stats`, in natural log: with
  `base2` (m in base 2) (m + log2(l)) * ln(2)."""

  def stats(x):
    return ar.round(x, "softmax_stats")

  if not base2:
    return m + stats(jnp.log(l_sum))
  lse2 = stats(m + stats(jnp.log2(l_sum)))
  return stats(lse2 * jnp.asarray(math.log(2.0), lse2.dtype))


def _per_row(vector_Bq, shape):
  """A per-row vector placed on a tile of `shape` (by broadcasting)."""
  return vector_Bq[:, None]


def recomputed_probs(s_BqxBk, stats_Bq, ar: PolicyArithmetic, per_row=_per_row):
  """P from the scores and the forward's softmax residuals: (lse,) gives
  exp(s - lse); (m, l) gives exp(s - m) * (1 / l) (the policy option
  softmax_residuals=max_sum), as the forward normalized it. In
  `softmax_stats`. `per_row(vector, shape)` places a per-query vector on
  the tile (the Hopper path's broadcasts by register layout, and on its
  transposed tiles along columns)."""

  def stats(x):
    return ar.round(x, "softmax_stats")

  shape = s_BqxBk.shape
  if len(stats_Bq) == 1:
    (lse_Bq,) = stats_Bq
    return stats_exp(stats(s_BqxBk - per_row(stats(lse_Bq), shape)), ar)
  m_Bq, l_Bq = (stats(x) for x in stats_Bq)
  inverse_Bq = stats(1.0 / l_Bq)
  p_BqxBk = stats_exp(stats(s_BqxBk - per_row(m_Bq, shape)), ar)
  return stats(p_BqxBk * per_row(inverse_Bq, shape))


def score_gradients(
  p_BqxBk, dp_BqxBk, delta_Bq, tanh_BqxBk, ar: PolicyArithmetic,
  per_row=_per_row,
):  # fmt: skip
  """(dS, dS of the scores before the softcap: the bias's gradient) from
  P, dP = dO V^T as the matmul gave it, and delta: dS = P (dP - delta),
  times the softcap's slope, each in `softmax_stats`."""

  def stats(x):
    return ar.round(x, "softmax_stats")

  dp_BqxBk = stats(dp_BqxBk)
  delta_tile = per_row(stats(delta_Bq), dp_BqxBk.shape)
  ds_BqxBk = stats(p_BqxBk * stats(dp_BqxBk - delta_tile))
  if tanh_BqxBk is None:
    return ds_BqxBk, ds_BqxBk
  return stats(ds_BqxBk * softcap_slope(tanh_BqxBk, ar)), ds_BqxBk


def plus_probs_delta(delta_Bq, p_BqxBk, dp_BqxBk, ar: PolicyArithmetic):
  """delta = rowsum(P * dP) from the recomputed P with one more key block
  (delta_source=probs; d(sink) under sink_delta=probs): dP in
  `softmax_stats`, each product, the tile's sum and the running sum
  rounded to `delta`."""
  dp_BqxBk = ar.round(dp_BqxBk, "softmax_stats")
  products = ar.round(ar.round(p_BqxBk, "delta") * dp_BqxBk, "delta")
  return ar.round(delta_Bq + ar.sum(products, "delta"), "delta")


def row_sum(x_BqxBk, ar: PolicyArithmetic):
  """Row sum within one block, accumulated like a dot product."""
  return ar.round(ar.sum(x_BqxBk, "matmul_accum"), "softmax_stats")


def summed_probs(p_BqxBk, ar):
  """A tile's share of the softmax sum: rowsum(P), or with the policy
  option softmax_sum=rounded_probs the sum of P as rounded to `probs`,
  the P that multiplies V (flash-attention #2721), so O = P V / l is a
  weighted mean of V."""
  if ar.policy.softmax_sum == "rounded_probs":
    p_BqxBk = ar.round(p_BqxBk, "probs")
  return row_sum(p_BqxBk, ar)


def tie_cap(ar: PolicyArithmetic) -> float:
  """The largest shift of the maximum that keeps exp of the tie normal.

  Half the natural-log range of the statistics format's normal numbers
  (43.7 for FP32 and BF16, 4.9 for FP16): exp(r_m - m) of the row's largest
  entries then stays a normal number, so the softmax sum cannot underflow
  to zero (Qiu & Yao's beta = 7 does once the row maximum exceeds about
  14.6 in FP32).
  """
  tiny = float(jnp.finfo(ar.policy.dtype("softmax_stats")).tiny)
  return -0.5 * math.log(tiny)


def tie_safe_max(s, r_m, ar: PolicyArithmetic, options, per_row=None):
  """The maximum to subtract before exp, with Qiu & Yao's fix (Alg. 1).

  Qiu & Yao (arXiv 2510.04212): where several scores of a row tie at its
  maximum r_m, those probabilities are exactly 1 and PV rounds with a
  bias. With r_s the number of entries equal to r_m: m = beta * r_m if
  r_m > 0 and r_s > 1, m = 0 if r_m < 0 and r_s > 1, else m = r_m, so no
  probability is exactly 1.

  Fallback: a shift m - r_m beyond `tie_cap` would underflow the sum; it
  is wrapped into [cap - 1, cap) instead (by its fractional part). A
  constant shift would give every row the same tied probability and so the
  same rounding of it, a bias of its own; the wrapped shift still varies
  from row to row, and every probability stays below 1.

  Args:
    s: scores [..., n] in the statistics format; -inf where masked.
    r_m: s.max(-1), shape [...].
    options: what holds `tie_beta` (`Options`, or the Hopper path's plan):
      beta > 1, or None for the standard safe softmax (m = r_m).
    per_row: places r_m across the tile's columns (the Hopper path's
      `as_rows`); None: by indexing.
  """
  beta = options.tie_beta
  if beta is None:
    return r_m
  stats = lambda x: ar.round(x, "softmax_stats")  # noqa: E731
  one, zero = jnp.asarray(1.0, s.dtype), jnp.asarray(0.0, s.dtype)
  r_tile = r_m[..., None] if per_row is None else per_row(r_m, s.shape)
  tied = jnp.sum(jnp.where(s == r_tile, one, zero), axis=-1) > 1
  # Comparisons rather than isfinite, which Mosaic GPU does not lower.
  finite = (r_m > -jnp.inf) & (r_m < jnp.inf)
  r_safe = jnp.where(finite, r_m, zero)
  shift = jnp.where(
    tied & (r_safe > 0),
    jnp.asarray(beta - 1.0, s.dtype) * r_safe,
    jnp.where(tied & (r_safe < 0), -r_safe, zero),
  )
  cap = jnp.asarray(tie_cap(ar), s.dtype)
  wrapped = cap - one + (shift - _floor_of_nonnegative(shift))
  shift = jnp.where(shift > cap, wrapped, shift)
  # A row with no key here (r_m = -inf) keeps r_m.
  return jnp.where(finite, stats(r_safe + shift), r_m)


def _floor_of_nonnegative(x):
  """floor(x) for x >= 0, exactly; for FP32 by truncation to int32 below
  2^23 (above it every FP32 number is an integer), which Mosaic GPU
  lowers and floor it does not."""
  if x.dtype != jnp.float32:
    return jnp.floor(x)
  integral = jnp.asarray(2.0**23, jnp.float32)
  return jnp.where(x < integral, x.astype(jnp.int32).astype(x.dtype), x)


def descaled(ar: PolicyArithmetic, pv, descale):
  """P V times its descale factor (if any), in `out_accum`."""
  return ar.round(pv if descale is None else pv * descale, "out_accum")


def probs_times_values(
  p_BqxBk,
  v_BkxD,
  ar: PolicyArithmetic,
  v_scale=None,
  per_channel=False,
  acc=None,
):
  """(P V before descaling, the descale factor or None); `descaled`
  applies the factor, in `out_accum`.

  P enters rounded to `probs`. With operands below 16 bits P enters as
  round(P * p_scale) and V as round(V * (1 / s_v)) (s_v constant over a
  tile's rows, or one per column if `per_channel`); the factor is then
  s_v * (1 / p_scale). (Divisions are written as reciprocal products,
  which XLA would make of them anyway.) With the MMA accumulator (policy
  option mma_chunk) the product is added into `acc` chunk by chunk of
  keys.
  """
  if ar.policy.mma_chunk:
    dot = functools.partial(ar.mma_dot, acc=acc)
  else:
    dot = ar.dot
  p_scale = ar.policy.p_scale
  if v_scale is None and p_scale == 1.0:
    return dot(ar.round(p_BqxBk, "probs"), v_BkxD, NN_DIMS), None
  dtype = p_BqxBk.dtype
  p_hat = ar.round_probs(p_BqxBk * jnp.asarray(p_scale, dtype))
  if v_scale is None:
    pv = dot(p_hat, v_BkxD, NN_DIMS, probs=True)
    return pv, jnp.asarray(1.0 / p_scale, dtype)
  if per_channel:
    pv = dot(p_hat, v_BkxD * (1.0 / v_scale)[None, :], NN_DIMS, probs=True)
    return pv, (v_scale * jnp.asarray(1.0 / p_scale, dtype))[None, :]
  pv = dot(p_hat, v_BkxD * (1.0 / v_scale)[:, None], NN_DIMS, probs=True)
  # One value over the tile (a max: Triton cannot slice a vector).
  return pv, jnp.max(v_scale) * jnp.asarray(1.0 / p_scale, dtype)
