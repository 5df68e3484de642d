"""`Options(center_kv=True)`: the flash kernel on keys and values less
their per-head mean, an exact change of what it computes.

Subtracting one vector m_k from every key of a head moves each row of
logits by the constant q.m_k, which softmax removes: O, dQ, dK and dV are
unchanged in exact arithmetic. Subtracting m_v from every value moves O
by m_v times the row's attended mass (1 where the row attends a key, 0
where none does), which is added back. What changes is the rounding:
FlashAttention-2's backward forms delta = rowsum(dO * O) from the stored
O, and its rounding error enters dQ along P K (Qiu & Yao, arXiv
2510.04212, Eq. 1). With the shared key component gone P K is small, and
with the value offset gone so is O and its rounding error.

The means are taken over the keys some query may attend (lengths and
segments leave padding out, which may hold NaN), per channel, and only
where a channel's mean is a sizeable part of its spread
(`shared_component`): the centred operands are rounded to the policy's
input format again, which costs little where the offset is large and
would add a second input rounding where there is none. The output is
O_c rounded, plus m_v, rounded: a second rounding of the small O_c. K's
gradient is that of the centring too (autodiff through the mean): the
kernel's dK less its mean over the attended keys, exactly what the chain
rule gives (exact dK sums to zero over the keys, so this removes only
error). V's mean is a constant to autodiff: exact dV sums to the rows'
dO, so the mean's two terms cancel, and dV is the kernel's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stableattn.contract.masking import MaskOperands, keys_of_some_query
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.numerics.rounding import PolicyArithmetic


def refusal(cfg: KernelConfig) -> str | None:
  """Why center_kv cannot run `cfg` exactly, or None."""
  spec, policy = cfg.mask, cfg.policy
  if spec.sink:
    return (
      "center_kv=True with a sink: a sink's logit does not move with the "
      "keys, so the constant q.mean(K) each row loses would change the "
      "sink's weight; run without a sink or without center_kv"
    )
  if spec.softcap is not None:
    return (
      "center_kv=True with a softcap: tanh does not ignore the constant "
      "q.mean(K) a row of logits loses, as softmax does; run without one "
      "of them"
    )
  if policy.quantizes or policy.kv_cache != "none":
    return (
      f"center_kv=True with precision {policy.name!r}: its scales and "
      "cache are taken from the uncentred K and V (smooth_k=on centres K "
      "inside the quantizing policies); use a 16- or 32-bit policy"
    )
  return None


def _attended(ops: MaskOperands, cfg: KernelConfig, k):
  """[B, S, 1, 1] float: 1 at the keys some query may attend."""
  if cfg.mask.token_ids:
    keep = keys_of_some_query(ops)
  else:
    keep = jnp.ones(k.shape[:2], bool)
  return keep[:, :, None, None]


# A channel is centred where its mean exceeds this multiple of its spread.
# On 12 captured BF16 layers (results/cpu/key-offset-2026-11-28) 1.0 left
# dQ 1.2-2.9x FlexAttention's limit on four layers (key offsets 1.3-11),
# 0.25 1.2-3.2x on three, and centring every channel (0) 1.1-4.4x on
# three; 0 also took normal inputs' output past the limit (1.05-1.07x, a
# second rounding of V), which 0.25 leaves as it was (0.53-0.55x).
DOMINANT = 0.25


def shared_component(x, attended):
  """[B, 1, H, D] FP32: per channel, x's mean over the attended tokens
  where it exceeds `DOMINANT` x the channel's spread about it, else 0 (0
  where a sequence has none); tokens outside never enter, NaN included.

  Any vector shared by every token keeps the centring exact; this one
  re-rounds only channels whose mean is a sizeable part of their spread
  (`DOMINANT`), where x - mean is about as large as x or smaller, and
  so is its new rounding error. A channel whose sample mean stays below
  that (zero-mean inputs over a few hundred tokens) is left as it was,
  bit for bit."""
  weights = attended.astype(jnp.float32)
  wide = jnp.where(attended, x.astype(jnp.float32), 0.0)
  count = jnp.maximum(jnp.sum(weights, axis=1, keepdims=True), 1.0)
  mean = jnp.sum(wide, axis=1, keepdims=True) / count
  spread = jnp.sqrt(
    jnp.sum(weights * (wide - mean) ** 2, axis=1, keepdims=True) / count
  )
  dominant = jax.lax.stop_gradient(jnp.abs(mean) > DOMINANT * spread)
  return jnp.where(dominant, mean, 0.0)


def centred_attention(kernel, q, k, v, ops: MaskOperands, cfg: KernelConfig):
  """kernel(q, k - m_k, v - m_v, ops, cfg) -> (out, lse) with m_v added
  back to every row that attends a key (its lse is finite), in the
  policy's output format."""
  ar = PolicyArithmetic(cfg.policy)
  attended = _attended(ops, cfg, k)
  mean_k = shared_component(k, attended)
  # Exact dV sums to the attended rows' dO over the keys, so the mean's
  # own gradient cancels the kernel's: left out, dV is the kernel's dV
  # as it stands, not that plus two terms that cancel to a re-rounding.
  mean_v = jax.lax.stop_gradient(shared_component(v, attended))
  k_c = ar.stored(k.astype(jnp.float32) - mean_k, "inputs")
  v_c = ar.stored(v.astype(jnp.float32) - mean_v, "inputs")
  out_c, lse = kernel(q, k_c, v_c, ops, cfg)
  rows = jnp.isfinite(jax.lax.stop_gradient(lse))  # [B, H, T]
  group = q.shape[2] // k.shape[2]
  mean_v = jnp.repeat(mean_v, group, axis=2)  # [B, 1, H, Dv]
  mass = jnp.transpose(rows, (0, 2, 1))[..., None].astype(jnp.float32)
  out = out_c.astype(jnp.float32) + mass * mean_v
  return ar.stored(out, "output")
