"""Differentiable flash attention: padding, Pallas forward, Pallas backward.

The kernels only see padded arrays: sequence lengths are rounded up to a
multiple of every tile size in use (forward and backward), and on a GPU the
head dimension is rounded up to a power of two (Triton's requirement).
Padding is zeros; padded keys are masked by index inside the kernels and
padded query rows and head columns are sliced off here, so padding never
reaches a result.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from stableattn.pallas_backward import flash_backward
from stableattn.pallas_forward import KernelConfig, flash_forward
from stableattn.rounding import PolicyArithmetic
from stableattn.tiling import MIN_GPU_BLOCK, next_power_of_two, round_up


def padded_head_dim(head_dim: int, interpret: bool) -> int:
  if interpret:
    return head_dim
  return max(MIN_GPU_BLOCK, next_power_of_two(head_dim))


def _padded_lengths(cfg: KernelConfig) -> tuple[int, int]:
  q_multiple = math.lcm(cfg.block_q, cfg.bwd_block_q)
  k_multiple = math.lcm(cfg.block_k, cfg.bwd_block_k)
  return round_up(cfg.q_len, q_multiple), round_up(cfg.kv_len, k_multiple)


def _pad_to(x, length: int, head_dim: int):
  pad = [(0, 0), (0, length - x.shape[1]), (0, 0), (0, head_dim - x.shape[3])]
  if all(p == (0, 0) for p in pad):
    return x
  return jnp.pad(x, pad)


def _forward(q, k, v, cfg: KernelConfig):
  q_len_padded, kv_len_padded = _padded_lengths(cfg)
  head_dim_padded = padded_head_dim(cfg.head_dim, cfg.interpret)
  q_p = _pad_to(q, q_len_padded, head_dim_padded)
  k_p = _pad_to(k, kv_len_padded, head_dim_padded)
  v_p = _pad_to(v, kv_len_padded, head_dim_padded)
  out_p, lse = flash_forward(q_p, k_p, v_p, cfg)
  out = out_p[:, : cfg.q_len, :, : cfg.head_dim]
  return out, (q_p, k_p, v_p, out_p, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash_attention(q, k, v, cfg: KernelConfig):
  """Flash attention of unpadded q [B, T, H, D], k and v [B, S, Hkv, D]."""
  return _forward(q, k, v, cfg)[0]


def flash_attention_with_lse(q, k, v, cfg: KernelConfig):
  """Forward only; also returns the log-sum-exp [B, H, T] (no gradient)."""
  out, residuals = _forward(q, k, v, cfg)
  return out, residuals[-1][:, :, : cfg.q_len]


def _flash_fwd(q, k, v, cfg: KernelConfig):
  return _forward(q, k, v, cfg)


def _flash_bwd(cfg: KernelConfig, residuals, d_out):
  q_p, k_p, v_p, out_p, lse = residuals
  d_out_p = _pad_to(d_out.astype(out_p.dtype), out_p.shape[1], out_p.shape[3])
  dq_p, dk_p, dv_p = flash_backward(q_p, k_p, v_p, out_p, lse, d_out_p, cfg)
  batch, kv_len_padded, kv_heads, head_dim_padded = k_p.shape
  group = q_p.shape[2] // kv_heads

  ar = PolicyArithmetic(cfg.policy)

  def sum_groups(g):
    # Per-query-head gradients of one shared key/value head add up, in the
    # policy's gradient-accumulator format.
    if group == 1:
      return g
    g = g.reshape(batch, kv_len_padded, kv_heads, group, head_dim_padded)
    return ar.sum(g, "grad_accum", axis=3)

  dq = dq_p[:, : cfg.q_len, :, : cfg.head_dim]
  dk = sum_groups(dk_p)[:, : cfg.kv_len, :, : cfg.head_dim]
  dv = sum_groups(dv_p)[:, : cfg.kv_len, :, : cfg.head_dim]
  return tuple(ar.stored(g, "inputs") for g in (dq, dk, dv))


flash_attention.defvjp(_flash_fwd, _flash_bwd)
