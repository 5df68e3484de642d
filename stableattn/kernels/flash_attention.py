"""Differentiable flash attention: padding, Pallas forward, Pallas backward.

The kernels only see padded arrays: sequence lengths are rounded up to a
multiple of every tile size in use (forward and backward), and on a GPU the
head dimension is rounded up to a power of two (Triton's requirement).
Padding is zeros; padded keys are masked inside the kernels (by index, or
by a token id no query has) and padded query rows and head columns are
sliced off here, so padding never reaches a result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.contract.masking import (
  KEY_PAD_ID,
  QUERY_PAD_ID,
  MaskOperands,
  block_ranges,
)
from stableattn.contract.tiling import MIN_GPU_BLOCK, next_power_of_two
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.pallas_backward import flash_backward
from stableattn.kernels.pallas_forward import flash_forward
from stableattn.kernels.quantization import (
  QuantScales,
  straight_through,
  v_per_channel,
)
from stableattn.numerics.rounding import PolicyArithmetic


def padded_head_dim(head_dim: int, interpret: bool) -> int:
  if interpret:
    return head_dim
  return max(MIN_GPU_BLOCK, next_power_of_two(head_dim))


def pad_to(x, length: int, head_dim: int):
  pad = [(0, 0), (0, length - x.shape[1]), (0, 0), (0, head_dim - x.shape[3])]
  if all(p == (0, 0) for p in pad):
    return x
  return jnp.pad(x, pad)


def pad_operands(ops: MaskOperands, cfg: KernelConfig) -> MaskOperands:
  """The feature operands at the padded lengths; the sink as rows
  [heads, q_len_padded] (a block of it per query block)."""
  q_len_padded, kv_len_padded = cfg.padded_lengths
  dq, dk = q_len_padded - cfg.q_len, kv_len_padded - cfg.kv_len

  def pad_last(x, before_last, last, **kwargs):
    if x is None or (before_last == 0 and last == 0):
      return x
    widths = [(0, 0)] * (x.ndim - 2) + [(0, before_last), (0, last)]
    return jnp.pad(x, widths, **kwargs)

  def pad_ids(x, amount, pad_id):
    if x is None:
      return None
    return pad_last(x, 0, amount, constant_values=pad_id)

  sink_rows = None
  if ops.sink is not None:
    heads = len(ops.sink)
    sink_rows = jnp.broadcast_to(ops.sink[:, None], (heads, q_len_padded))
  return MaskOperands(
    q_ids=pad_ids(ops.q_ids, dq, QUERY_PAD_ID),
    kv_ids=pad_ids(ops.kv_ids, dk, KEY_PAD_ID),
    kv_pos=pad_last(ops.kv_pos, 0, dk, mode="edge"),
    bias=pad_last(ops.bias, dq, dk),
    mask=pad_last(ops.mask, dq, dk),
    sink=sink_rows,
  )


def tile_ranges(
  ops: MaskOperands, cfg: KernelConfig, block_q: int, block_k: int
):
  if not cfg.mask.skips_blocks:
    return None
  q_len_padded, kv_len_padded = cfg.padded_lengths
  return block_ranges(
    cfg.mask,
    ops,
    q_len_padded=q_len_padded,
    kv_len_padded=kv_len_padded,
    kv_len=cfg.kv_len,
    bq=block_q,
    bk=block_k,
  )


def pad_scales(
  scales: QuantScales | None, cfg: KernelConfig, value_dim_padded=None
):
  """Row scales at the padded lengths: padding rows repeat the last row's
  scale, so a tile's V scale stays one value (padded rows are zeros).
  Per-channel V scales at `value_dim_padded` (the Triton path's padded
  value head dim by default)."""
  if scales is None:
    return None
  q_len_padded, kv_len_padded = cfg.padded_lengths

  def pad(x, length):
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[-1])), mode="edge")

  if v_per_channel(cfg.policy):
    # Per-channel V scales: padded head columns are zeros; any scale does.
    if value_dim_padded is None:
      value_dim_padded = padded_head_dim(cfg.value_dim, cfg.interpret)
    v_scales = pad(scales.v, value_dim_padded)
  else:
    v_scales = pad(scales.v, kv_len_padded)
  return QuantScales(
    q=pad(scales.q, q_len_padded), k=pad(scales.k, kv_len_padded), v=v_scales
  )


def _forward(
  q,
  k,
  v,
  ops: MaskOperands,
  cfg: KernelConfig,
  scales=None,
  residuals=True,
  monitor=False,
):
  """(out, residuals of the backward): the padded q, k, v, operands and
  output, the lse, and {name: extra residual} (`residual_names`)."""
  q_len_padded, kv_len_padded = cfg.padded_lengths
  head_dim_padded = padded_head_dim(cfg.head_dim, cfg.interpret)
  q_p = pad_to(q, q_len_padded, head_dim_padded)
  k_p = pad_to(k, kv_len_padded, head_dim_padded)
  v_p = pad_to(v, kv_len_padded, padded_head_dim(cfg.value_dim, cfg.interpret))
  ops_p = pad_operands(ops, cfg)
  ranges = tile_ranges(ops_p, cfg, cfg.block_q, cfg.block_k)
  key_ranges = None if ranges is None else ranges[0]
  out_p, lse, *extra = flash_forward(
    q_p,
    k_p,
    v_p,
    ops_p,
    key_ranges,
    cfg,
    pad_scales(scales, cfg),
    residuals=residuals,
    monitor=monitor,
  )
  out = out_p[:, : cfg.q_len, :, : cfg.value_dim]
  return out, (q_p, k_p, v_p, ops_p, out_p, lse, *extra)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash_attention(q, k, v, ops: MaskOperands, cfg: KernelConfig):
  """Flash attention of unpadded q [B, T, H, D], k [B, S, Hkv, D] and v
  [B, S, Hkv, Dv] (Dv = D, or MLA's value head dim) with the features
  `ops` (see `masking.py`); bias and sink get gradients."""
  return _forward(q, k, v, ops, cfg, residuals=False)[0]


def flash_attention_with_lse(
  q, k, v, ops: MaskOperands, cfg: KernelConfig, scales=None
):
  """Forward only; also returns the log-sum-exp [B, H, T] (no gradient;
  +inf for a row no key attends, as FlashAttention)."""
  out, residuals = _forward(q, k, v, ops, cfg, scales, residuals=False)
  return out, residuals[-1][:, :, : cfg.q_len]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash_attention_and_lse(q, k, v, ops: MaskOperands, cfg: KernelConfig):
  """`flash_attention` that also returns the log-sum-exp [B, H, T] (+inf
  for a row no key attends) as a value beside the output: the lse's own
  cotangent is dropped, so a caller reads it under stop_gradient (which
  rows attend a key, `centring`)."""
  return flash_attention_with_lse(q, k, v, ops, cfg)


def _and_lse_fwd(q, k, v, ops, cfg: KernelConfig):
  out, residuals = _forward(q, k, v, ops, cfg)
  return (out, residuals[5][:, :, : cfg.q_len]), (residuals, ops)


def _and_lse_bwd(cfg: KernelConfig, saved, cotangents):
  residuals, ops = saved
  return _gradients(cfg, residuals, ops, cotangents[0])


flash_attention_and_lse.defvjp(_and_lse_fwd, _and_lse_bwd)


def flash_attention_with_statistics(
  q, k, v, ops: MaskOperands, cfg: KernelConfig, scales=None
):
  """Forward only; also returns, per row [B, H, T], the log-sum-exp
  ("lse"), the largest score ("row_max") and the second largest
  ("second", equal to the largest where it is tied) as the kernel
  computed them in its one pass, in natural-log units (a base-2 kernel's
  scores are converted), for the attention monitor. No gradient."""
  out, residuals = _forward(
    q, k, v, ops, cfg, scales, residuals=False, monitor=True
  )
  lse, found = residuals[-2], residuals[-1]
  rows = slice(0, cfg.q_len)
  scale = np.log(2.0) if cfg.policy.exp2 else 1.0
  return out, {
    "lse": lse[:, :, rows],
    **{
      name: found[name][:, :, rows].astype(lse.dtype) * scale
      for name in ("row_max", "second")
    },
  }


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def quantized_flash_attention(q, k, v, ops, scales, cfg: KernelConfig):
  """Attention under a policy with operands below 16 bits (FP8, FP4, INT8;
  `scales` from `quantization.prepare`).

  The backward is straight-through (see `quantization.straight_through`):
  the kernel backward of the operands the forward's matmuls saw,
  dequantized, under the policy's wide stages.
  """
  return _forward(q, k, v, ops, cfg, scales, residuals=False)[0]


def _quantized_fwd(q, k, v, ops, scales, cfg):
  out, residuals = _forward(q, k, v, ops, cfg, scales)
  return out, (residuals, ops, scales)


def _quantized_bwd(cfg, saved, d_out):
  (q_p, k_p, v_p, ops_p, out_p, lse, extra), ops, scales = saved
  policy, dequantized = straight_through(
    cfg.policy, (q_p, k_p, v_p), pad_scales(scales, cfg)
  )
  residuals = (*dequantized, ops_p, out_p, lse, extra)
  bwd_cfg = cfg.with_policy(policy)
  dq, dk, dv, d_ops = _gradients(bwd_cfg, residuals, ops, d_out)
  # Rotated q and k are FP32; their cotangents must be too.
  grads = tuple(
    g.astype(x.dtype) for g, x in zip((dq, dk, dv), (q_p, k_p, v_p))
  )
  no_scale_gradient = jax.tree_util.tree_map(jnp.zeros_like, scales)
  return (*grads, d_ops, no_scale_gradient)


quantized_flash_attention.defvjp(_quantized_fwd, _quantized_bwd)


def _flash_fwd(q, k, v, ops, cfg: KernelConfig):
  out, residuals = _forward(q, k, v, ops, cfg)
  return out, (residuals, ops)


def _flash_bwd(cfg: KernelConfig, saved, d_out):
  residuals, ops = saved
  return _gradients(cfg, residuals, ops, d_out)


def _gradients(cfg: KernelConfig, residuals, ops, d_out):
  """(dq, dk, dv, d_ops) from the padded forward residuals."""
  q_p, k_p, v_p, ops_p, out_p, lse, extra = residuals
  d_out_p = pad_to(d_out.astype(out_p.dtype), out_p.shape[1], out_p.shape[3])
  ranges = tile_ranges(ops_p, cfg, cfg.bwd_block_q, cfg.bwd_block_k)
  dq_p, dk_p, dv_p, sink_terms, dbias_p = flash_backward(
    q_p, k_p, v_p, (out_p, lse, extra), d_out_p, ops_p, ranges, cfg
  )
  batch, kv_len_padded, kv_heads, _ = k_p.shape
  group = q_p.shape[2] // kv_heads

  ar = PolicyArithmetic(cfg.policy)

  def sum_groups(g):
    # Per-query-head gradients of one shared key/value head add up, in the
    # policy's gradient-accumulator format.
    if group == 1:
      return g
    g = g.reshape(batch, kv_len_padded, kv_heads, group, g.shape[-1])
    return ar.sum(g, "grad_accum", axis=3)

  dq = dq_p[:, : cfg.q_len, :, : cfg.head_dim]
  dk = sum_groups(dk_p)[:, : cfg.kv_len, :, : cfg.head_dim]
  dv = sum_groups(dv_p)[:, : cfg.kv_len, :, : cfg.value_dim]
  grads = tuple(ar.stored(g, "inputs") for g in (dq, dk, dv))
  d_ops = jax.tree_util.tree_map(zero_cotangent, ops)
  if dbias_p is not None:
    d_ops = d_ops._replace(bias=bias_gradient(dbias_p, ops.bias, cfg))
  if ops.sink is not None:
    d_ops = d_ops._replace(sink=sink_gradient(ops.sink, lse, sink_terms, cfg))
  return (*grads, d_ops)


def bias_gradient(dbias_p, bias, cfg: KernelConfig):
  """d(bias) in the bias's shape and format from dS [B, H, T, S] at the
  padded lengths: summed (in `grad_accum`) over the axes the bias
  broadcasts."""
  ar = PolicyArithmetic(cfg.policy)
  dbias = dbias_p[:, :, : cfg.q_len, : cfg.kv_len]
  per_example, per_head = cfg.mask.bias
  axes = tuple(a for a, full in ((0, per_example), (1, per_head)) if not full)
  if axes:
    dbias = ar.sum(dbias, "grad_accum", axis=axes, keepdims=True)
  return dbias.astype(bias.dtype)


def sink_gradient(sink, lse, sink_terms, cfg: KernelConfig):
  """d sink = -sum_i p_sink,i delta_i, p_sink,i = exp(sink - lse_i), from
  the padded lse and d(sink)'s (delta, rowsum(P) or None) [B, H, T]."""
  ar = PolicyArithmetic(cfg.policy)
  delta, prob_sums = sink_terms
  lse_rows = lse[:, :, : cfg.q_len].astype(ar.carrier)
  p_sink = jnp.exp(sink.astype(ar.carrier)[None, :, None] - lse_rows)
  delta = delta[:, :, : cfg.q_len].astype(ar.carrier)
  if prob_sums is not None:
    # sink_delta=probs: normalized by the sum of unrounded P, not by the
    # forward's l (which sums P rounded with softmax_sum=rounded_probs),
    # so p_sink and delta are the exact softmax's.
    total = p_sink + prob_sums[:, :, : cfg.q_len]
    total = jnp.where(total == 0, 1.0, total)  # no key and a -inf sink
    p_sink, delta = p_sink / total, delta / total
  d_sink = -ar.sum(p_sink * delta, "grad_accum", axis=(0, 2))
  return d_sink.astype(sink.dtype)


def zero_cotangent(x):
  """The zero cotangent of a feature operand (float0 for integer ids)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


flash_attention.defvjp(_flash_fwd, _flash_bwd)
