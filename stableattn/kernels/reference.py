"""Baseline attention: materialized softmax(Q K^T * scale) V in jnp.

Applies the same precision policy as the flash kernel at its own stages:
the whole score matrix S is stored in `scores`, the softmax runs in
`softmax_stats` and P is normalized *before* PV and stored in `probs`.
The `out_accum`, `delta` and `grad_accum` stages belong to the blocked
algorithm; here the PV product goes straight to the output, and gradients
come from autodiff, which rounds where the forward pass rounds. The
features (masks, softcap, bias, sink) follow `masking.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from stableattn.contract.masking import (
  MaskOperands,
  MaskSpec,
  allowed_pairs,
  keys_some_query_attends,
  logits_in_base,
  scores,
  without_unattended_keys,
)
from stableattn.contract.options import Options
from stableattn.kernels.block_math import (
  no_key_safe,
  stats_exp,
  tie_safe_max,
)
from stableattn.kernels.quantization import QuantScales, v_per_channel
from stableattn.numerics.precision import Precision
from stableattn.numerics.rounding import PolicyArithmetic


def _grouped(x, kv_heads: int):
  """[B|1, H|1, T, S] -> [B|1, Hkv|1, G|1, T, S] to match the scores."""
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kv_heads, -1, *x.shape[2:])


def reference_attention(
  q,
  k,
  v,
  ops: MaskOperands,
  *,
  options: Options,
  spec: MaskSpec,
  scales: QuantScales | None = None,
):
  """Baseline attention of q [B,T,H,D], k and v [B,S,Hkv,D] under the
  policy of `options`.

  Each operation's result is rounded to its stage (see `rounding.py`).
  Qiu & Yao's safe softmax (an option) applies to each whole row. `scales`
  (operands below 16 bits, `quantization.py`) scale Q, K and V as in the
  kernel; with one scale per key block of V, the Baseline, which has no
  blocks, multiplies V's scales back (in FP32) before its one P V matmul.
  """
  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  policy = options.precision
  ar = PolicyArithmetic(policy)

  def stats(x):
    return ar.round(x, "softmax_stats")

  allowed = allowed_pairs(spec, ops, q_len, kv_len)
  k, v = without_unattended_keys(keys_some_query_attends(allowed), k, v)
  q_BxTxKxGxD = q.reshape(batch, q_len, kv_heads, group, head_dim)
  if scales is None:
    product = ar.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k)
  else:
    q_scale = scales.q.reshape(batch, kv_heads, group, q_len)
    k_scale = scales.k[:, :, None, None, :]  # [B, Hkv, 1, 1, S]
    q_rows = q_scale.transpose(0, 3, 1, 2)[..., None]  # [B, T, Hkv, G, 1]
    k_rows = scales.k.transpose(0, 2, 1)[..., None]  # [B, S, Hkv, 1]
    product = ar.einsum(
      "btkgd,bskd->bkgts",
      q_BxTxKxGxD * (1.0 / q_rows),
      k * (1.0 / k_rows),
    ) * (q_scale[..., None] * k_scale)
  base2 = policy.exp2
  s, _ = scores(product, spec, ar, base2)
  s = stats(s)
  if ops.bias is not None:
    bias = logits_in_base(_grouped(ops.bias, kv_heads), ar, base2, "scores")
    s = stats(s + bias)
  allowed = _grouped(allowed, kv_heads)
  s = jnp.where(allowed, s, jnp.asarray(-jnp.inf, s.dtype))
  m = tie_safe_max(s, jnp.max(s, axis=-1), ar, options)
  sink = None
  if ops.sink is not None:
    sink = logits_in_base(
      ops.sink.astype(ar.carrier), ar, base2, "softmax_stats"
    ).reshape(kv_heads, group, 1)
    sink = jnp.broadcast_to(sink, m.shape)
    m = jnp.maximum(m, sink)
  m = lax.stop_gradient(no_key_safe(m))[..., None]
  p = stats_exp(stats(s - m), ar, base2)
  l_sum = stats(ar.sum(p, "matmul_accum", keepdims=True))
  if sink is not None:
    l_sum = stats(l_sum + stats_exp(stats(sink[..., None] - m), ar, base2))
  # A row no key attends has l = 0 and p = 0: its output is 0.
  l_safe = jnp.where(l_sum == 0, jnp.ones_like(l_sum), l_sum)
  if scales is None and policy.p_scale == 1.0:
    p = ar.round(stats(p * stats(1.0 / l_safe)), "probs")
    o = ar.einsum("bkgts,bskd->btkgd", p, v)
  else:
    o = _scaled_pv(stats(p * stats(1.0 / l_safe)), v, ar, scales)
  o = ar.stored(ar.round(o, "out_accum"), "output")
  return o.reshape(batch, q_len, heads, v.shape[3])


def _scaled_pv(p, v, ar: PolicyArithmetic, scales):
  """P V with P as round(P * p_scale) and V as round(V * (1 / s_v)), then
  times s_v * (1 / p_scale); per-block V scales are multiplied back before
  the matmul."""
  dtype = p.dtype
  p_scale = ar.policy.p_scale
  p_hat = ar.round_probs(p * jnp.asarray(p_scale, dtype))
  if scales is None:
    o = ar.einsum("bkgts,bskd->btkgd", p_hat, v, probs=True)
    return o * jnp.asarray(1.0 / p_scale, dtype)
  if v_per_channel(ar.policy):
    # One scale per output column: it factors out of the sum over keys.
    channels = scales.v[:, None, :, None, :]  # [B, 1, Hkv, 1, D]
    o = ar.einsum(
      "bkgts,bskd->btkgd", p_hat, v * (1.0 / scales.v[:, None]), probs=True
    )
    return o * (channels * jnp.asarray(1.0 / p_scale, dtype))
  v_rows = scales.v.transpose(0, 2, 1)[..., None]  # [B, S, Hkv, 1]
  if ar.policy.scaling != "block":
    # One scale for all of V: it factors out of the sum over keys.
    o = ar.einsum("bkgts,bskd->btkgd", p_hat, v * (1.0 / v_rows), probs=True)
    return o * (scales.v[0, 0, 0] * jnp.asarray(1.0 / p_scale, dtype))
  v_dequantized = ar.round(v * (1.0 / v_rows), "matmul_operands") * v_rows
  o = jnp.einsum(
    "bkgts,bskd->btkgd",
    p_hat,  # in `probs`, as the kernel's P enters its P V
    v_dequantized,
    precision=lax.Precision.HIGHEST,
    preferred_element_type=ar.carrier,
  )
  return ar.round(o, "matmul_accum") * jnp.asarray(1.0 / p_scale, dtype)


def xla_attention(q, k, v, ops: MaskOperands, *, policy: Precision, spec):
  """`jax.nn.dot_product_attention` as users call it (implementation="xla").

  It honors only the input and output formats of the policy; everything in
  between is its own choice (it computes the softmax in FP32 whatever the
  input format, so even an FP64 policy is only FP32-accurate here). Masks
  reach it as one dense mask; a row no key attends is set to 0, as in every
  implementation here (jax alone would average every value).
  """
  mask = None
  if spec.skips_blocks or spec.dense_mask is not None:
    mask = allowed_pairs(spec, ops, q.shape[1], k.shape[1])
    # jax.nn lets NaN in keys no query attends through (0 x NaN in P V).
    k, v = without_unattended_keys(keys_some_query_attends(mask), k, v)
  out = jax.nn.dot_product_attention(
    q,
    k,
    v,
    bias=ops.bias,
    mask=mask,
    scale=spec.scale,
    implementation="xla",
  )
  if mask is not None:
    has_key = jnp.any(mask, axis=-1)  # [B|1, H|1, T]
    out = jnp.where(jnp.swapaxes(has_key, 1, 2)[..., None], out, 0)
  return out.astype(policy.dtype("output"))
