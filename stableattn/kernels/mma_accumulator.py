"""The tensor core's MMA accumulator in the forward kernel (policy options
mma_chunk and promote_every): P V held in the MMA accumulator across key
tiles and promoted into the FP32 output accumulator every n tiles
(vllm-project/flash-attention #104), or never (FlashAttention-3's FP8
kernel before it)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def two_level_update(ar, every: int, visited, o_state, mma, raw_pv):
  """One key tile with the running P V in the MMA accumulator (policy
  options mma_chunk, promote_every != 1): both accumulators rescaled by
  alpha in FP32, P V added into the MMA one chunk by chunk, and every
  `every` tiles (never if 0) the MMA accumulator, descaled, added into
  the FP32 output accumulator and restarted from zero."""
  acc_BqxD, alpha_Bq = o_state
  t_BqxD, _ = mma

  def accum(x):
    return ar.round(x, "out_accum")

  alpha = accum(alpha_Bq)[:, None]
  t_BqxD, descale = raw_pv(acc=accum(alpha * t_BqxD))
  descale_Bq = jnp.broadcast_to(
    jnp.ones((), t_BqxD.dtype) if descale is None else descale,
    alpha_Bq.shape,
  )
  acc_BqxD = accum(alpha * acc_BqxD)
  if every == 0:
    return acc_BqxD, (t_BqxD, descale_Bq)
  count = jnp.asarray(visited, jnp.int32) + jnp.int32(1)
  due = lax.rem(count, jnp.int32(every)) == jnp.int32(0)
  promoted = promote(ar, acc_BqxD, (t_BqxD, descale_Bq))
  acc_BqxD = jnp.where(due, promoted, acc_BqxD)
  t_BqxD = jnp.where(due, jnp.zeros_like(t_BqxD), t_BqxD)
  return acc_BqxD, (t_BqxD, descale_Bq)


def promote(ar, acc_BqxD, mma):
  """The output accumulator plus the MMA accumulator, descaled, in FP32."""
  t_BqxD, descale_Bq = mma
  pv = ar.round(t_BqxD * descale_Bq[:, None], "out_accum")
  return ar.round(acc_BqxD + pv, "out_accum")
