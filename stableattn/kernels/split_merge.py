"""Split-KV's combine step: partial outputs and their log-sum-exps merged
into one output, under the policy (the forward kernel's splits, ring
attention's steps)."""

from __future__ import annotations

import jax.numpy as jnp

from stableattn.kernels.kernel_config import KernelConfig
from stableattn.numerics.rounding import PolicyArithmetic


def merge_splits(partial_out, partial_lse, cfg: KernelConfig, final=True):
  """Split-KV's combine step (FlashAttention's `combine_attn_seqk_parallel`):
  lse = max_s lse_s + log(sum_s exp(lse_s - max)), then
  O = sum_s exp(lse_s - lse) O_s, summed over the splits in order.

  Arithmetic in the carrier: exponentials, logs and the lse in
  `softmax_stats`, each weighted partial and the running sum in
  `out_accum`; the result is stored in `output`. An empty split (lse -inf)
  adds exactly 0; a row no split attends gives output 0 and lse +inf.

  Args:
    partial_out: [batch, splits, q_len, heads, head_dim] in `partials`.
    partial_lse: [batch, splits, heads, q_len] in `softmax_stats`.
    final: store the result in `output` with lse +inf for an empty row;
      False keeps it a partial (in `partials`, lse -inf) to merge again,
      as an online merge does.
  """
  ar = PolicyArithmetic(cfg.policy)

  def stats(x):
    return ar.round(x, "softmax_stats")

  def accum(x):
    return ar.round(x, "out_accum")

  lse_BxSxHxT = partial_lse.astype(ar.carrier)
  splits = lse_BxSxHxT.shape[1]
  top_BxHxT = jnp.max(lse_BxSxHxT, axis=1)
  empty_BxHxT = top_BxHxT == -jnp.inf
  top_BxHxT = jnp.where(empty_BxHxT, jnp.zeros_like(top_BxHxT), top_BxHxT)
  total_BxHxT = jnp.zeros_like(top_BxHxT)
  for s in range(splits):
    total_BxHxT = stats(
      total_BxHxT + stats(jnp.exp(stats(lse_BxSxHxT[:, s] - top_BxHxT)))
    )
  total_safe = jnp.where(empty_BxHxT, jnp.ones_like(total_BxHxT), total_BxHxT)
  lse_BxHxT = stats(top_BxHxT + stats(jnp.log(total_safe)))
  out_BxTxHxD = jnp.zeros(
    (partial_out.shape[0], *partial_out.shape[2:]), ar.carrier
  )
  for s in range(splits):
    weight_BxHxT = stats(jnp.exp(stats(lse_BxSxHxT[:, s] - lse_BxHxT)))
    weight_BxTxH = jnp.swapaxes(accum(weight_BxHxT), 1, 2)
    part = partial_out[:, s].astype(ar.carrier)
    out_BxTxHxD = accum(out_BxTxHxD + accum(weight_BxTxH[..., None] * part))
  if not final:
    lse_BxHxT = jnp.where(empty_BxHxT, -jnp.inf, lse_BxHxT)
    return (
      ar.stored(out_BxTxHxD, "partials"),
      ar.stored(lse_BxHxT, "softmax_stats"),
    )
  lse_BxHxT = jnp.where(empty_BxHxT, jnp.inf, lse_BxHxT)
  return (
    ar.stored(out_BxTxHxD, "output"),
    ar.stored(lse_BxHxT, "softmax_stats"),
  )
