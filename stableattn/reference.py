"""Baseline attention: materialized softmax(Q K^T / sqrt(d)) V in jnp.

Applies the same precision policy as the flash kernel at its own stages:
the whole score matrix S is stored in `scores`, the softmax runs in
`softmax_stats` and P is normalized *before* PV and stored in `probs`.
The `out_accum`, `delta` and `grad_accum` stages belong to the blocked
algorithm; here the PV product goes straight to the output, and gradients
come from autodiff, which rounds where the forward pass rounds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from stableattn.block_math import tie_safe_max
from stableattn.precision import Precision
from stableattn.rounding import PolicyArithmetic


def reference_attention(
  q, k, v, *, policy: Precision, causal: bool, tie_beta: float | None = None
):
  """Baseline attention of q [B,T,H,D], k and v [B,S,Hkv,D] under `policy`.

  Each operation's result is rounded to its stage (see `rounding.py`).
  `tie_beta` applies Qiu & Yao's safe softmax to each whole row.
  """
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  ar = PolicyArithmetic(policy)

  def stats(x):
    return ar.round(x, "softmax_stats")

  q_BxTxKxGxD = q.reshape(batch, q_len, kv_heads, group, head_dim)
  s = ar.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k)
  s = stats(ar.round(s * jnp.asarray(head_dim**-0.5, s.dtype), "scores"))
  if causal:
    allowed_TxS = jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))
    s = jnp.where(allowed_TxS, s, jnp.asarray(-jnp.inf, s.dtype))
  m = tie_safe_max(s, jnp.max(s, axis=-1), ar, tie_beta)
  m = lax.stop_gradient(m)[..., None]
  p = stats(jnp.exp(stats(s - m)))
  l_sum = stats(ar.sum(p, "matmul_accum", keepdims=True))
  p = ar.round(stats(p * stats(1.0 / l_sum)), "probs")

  o = ar.einsum("bkgts,bskd->btkgd", p, v)
  o = ar.stored(ar.round(o, "out_accum"), "output")
  return o.reshape(batch, q_len, heads, head_dim)


def xla_attention(q, k, v, *, policy: Precision, causal: bool):
  """`jax.nn.dot_product_attention` as users call it (implementation="xla").

  It honors only the input and output formats of the policy; everything in
  between is its own choice (it computes the softmax in FP32 whatever the
  input format, so even an FP64 policy is only FP32-accurate here).
  """
  out = jax.nn.dot_product_attention(
    q, k, v, is_causal=causal, implementation="xla"
  )
  return out.astype(policy.dtype("output"))
