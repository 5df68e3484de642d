"""Pallas flash-attention backward kernels (FlashAttention-2 style).

Three `pallas_call`s, each reading top to bottom like the forward file:
  1. `delta = rowsum(dO * O)`, rounded to the policy's `delta` format; Qiu &
     Yao (arXiv 2510.04212) trace biased low-precision training to this
     quantity.
  2. dK and dV: one program per key block, looping over query blocks,
     recomputing P from Q, K and the saved log-sum-exp.
  3. dQ: one program per query block, looping over key blocks.

Stages: dP = dO V^T accumulates in `matmul_accum`; dS = P * (dP - delta) is
computed in `softmax_stats` and rounded like P (the `probs` stage) before it
enters a matmul; running dQ, dK, dV sums are kept in `grad_accum`.

The dK/dV kernel runs per query head; the wrapper sums each group of query
heads (GQA) in `grad_accum` before the final cast.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stableattn.block_math import (
  NN_DIMS,
  NT_DIMS,
  TN_DIMS,
  block_scores,
  key_mask,
  scaled_dot,
  stats_exp,
)
from stableattn.pallas_forward import KernelConfig
from stableattn.rounding import PolicyArithmetic


def _delta_kernel(o_ref, do_ref, delta_ref, *, ar: PolicyArithmetic):
  o_BqxD = ar.round(o_ref[...], "delta")
  do_BqxD = ar.round(do_ref[...], "delta")
  products_BqxD = ar.round(o_BqxD * do_BqxD, "delta")
  delta_ref[...] = ar.sum(products_BqxD, "delta").astype(delta_ref.dtype)


def _probs_and_dscores(
  q_BqxD, k_BkxD, v_BkxD, do_BqxD, lse_Bq, delta_Bq, mask, *, cfg: KernelConfig
):
  """Recomputes P and returns (P, dS), both rounded to `probs`."""
  ar = cfg.arithmetic

  def stats(x):
    return ar.round(x, "softmax_stats")

  s_BqxBk = block_scores(q_BqxD, k_BkxD, ar=ar, scale=cfg.scale, mask=mask)
  p_BqxBk = stats_exp(stats(s_BqxBk - stats(lse_Bq)[:, None]), ar)
  dp_BqxBk = stats(ar.dot(do_BqxD, v_BkxD, NT_DIMS))
  ds_BqxBk = stats(p_BqxBk * stats(dp_BqxBk - stats(delta_Bq)[:, None]))
  return ar.round(p_BqxBk, "probs"), ar.round(ds_BqxBk, "probs")


def _dkdv_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  dk_ref,
  dv_ref,
  *,
  cfg: KernelConfig,
):
  """One program: one key block of one (batch, query head)."""
  ar = cfg.arithmetic
  block_q, block_k = cfg.bwd_block_q, cfg.bwd_block_k
  q_len_padded = q_ref.shape[0]
  head_dim_padded = k_ref.shape[-1]
  k_start = pl.program_id(0) * block_k
  k_BkxD = k_ref[...]
  v_BkxD = v_ref[...]
  needs_mask = cfg.causal or cfg.kv_len % block_k != 0

  def body(q_index, carry):
    dk_BkxD, dv_BkxD = carry
    q_start = pl.multiple_of(q_index * block_q, block_q)
    rows = pl.ds(q_start, block_q)
    mask = None
    if needs_mask:
      mask = key_mask(
        q_start, k_start, block_q, block_k, kv_len=cfg.kv_len, causal=cfg.causal
      )
    do_BqxD = do_ref[rows, :]
    q_BqxD = q_ref[rows, :]
    p_BqxBk, ds_BqxBk = _probs_and_dscores(
      q_BqxD,
      k_BkxD,
      v_BkxD,
      do_BqxD,
      lse_ref[rows],
      delta_ref[rows],
      mask,
      cfg=cfg,
    )
    dv_step = ar.round(ar.dot(p_BqxBk, do_BqxD, TN_DIMS), "grad_accum")
    dk_step = scaled_dot(
      ds_BqxBk, q_BqxD, TN_DIMS, ar, cfg.scale, "matmul_accum"
    )
    dk_BkxD = ar.round(dk_BkxD + ar.round(dk_step, "grad_accum"), "grad_accum")
    dv_BkxD = ar.round(dv_BkxD + dv_step, "grad_accum")
    return dk_BkxD, dv_BkxD

  num_q_blocks = q_len_padded // block_q
  # Causal: query blocks that end before this key block starts see none of
  # its keys.
  lower = lax.div(k_start, jnp.int32(block_q)) if cfg.causal else 0
  init = (
    jnp.zeros((block_k, head_dim_padded), ar.carrier),
    jnp.zeros((block_k, head_dim_padded), ar.carrier),
  )
  dk_BkxD, dv_BkxD = lax.fori_loop(lower, num_q_blocks, body, init)
  dk_ref[...] = dk_BkxD.astype(dk_ref.dtype)
  dv_ref[...] = dv_BkxD.astype(dv_ref.dtype)


def _dq_kernel(
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, cfg: KernelConfig
):
  """One program: one query block of one (batch, query head)."""
  ar = cfg.arithmetic
  block_q, block_k = cfg.bwd_block_q, cfg.bwd_block_k
  kv_len_padded = k_ref.shape[0]
  head_dim_padded = q_ref.shape[-1]
  q_start = pl.program_id(0) * block_q
  q_BqxD = q_ref[...]
  do_BqxD = do_ref[...]
  lse_Bq = lse_ref[...]
  delta_Bq = delta_ref[...]
  needs_mask = cfg.causal or cfg.kv_len % block_k != 0

  def body(k_index, dq_BqxD):
    k_start = pl.multiple_of(k_index * block_k, block_k)
    cols = pl.ds(k_start, block_k)
    k_BkxD = k_ref[cols, :]
    mask = None
    if needs_mask:
      mask = key_mask(
        q_start, k_start, block_q, block_k, kv_len=cfg.kv_len, causal=cfg.causal
      )
    _, ds_BqxBk = _probs_and_dscores(
      q_BqxD, k_BkxD, v_ref[cols, :], do_BqxD, lse_Bq, delta_Bq, mask, cfg=cfg
    )
    dq_step = scaled_dot(
      ds_BqxBk, k_BkxD, NN_DIMS, ar, cfg.scale, "matmul_accum"
    )
    return ar.round(dq_BqxD + ar.round(dq_step, "grad_accum"), "grad_accum")

  num_k_blocks = kv_len_padded // block_k
  if cfg.causal:
    upper = jnp.minimum(
      lax.div(q_start + (block_q - 1), jnp.int32(block_k)) + 1, num_k_blocks
    )
  else:
    upper = num_k_blocks
  init = jnp.zeros((block_q, head_dim_padded), ar.carrier)
  dq_BqxD = lax.fori_loop(0, upper, body, init)
  dq_ref[...] = dq_BqxD.astype(dq_ref.dtype)


def _delta(out, d_out, cfg: KernelConfig):
  """delta = rowsum(dO * O) [batch, heads, q_len_padded], in `delta`."""
  batch, q_len_padded, heads, head_dim_padded = out.shape
  block_q = cfg.bwd_block_q
  rows = pl.BlockSpec(
    (None, block_q, None, head_dim_padded), lambda i, b, h: (b, i, h, 0)
  )
  return pl.pallas_call(
    functools.partial(_delta_kernel, ar=cfg.arithmetic),
    grid=(q_len_padded // block_q, batch, heads),
    in_specs=[rows, rows],
    out_specs=pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
    out_shape=jax.ShapeDtypeStruct(
      (batch, heads, q_len_padded), cfg.policy.dtype("delta")
    ),
    compiler_params=cfg.compiler_params(block_q * head_dim_padded),
    interpret=cfg.interpret,
    name="stableattn_flash_backward_delta",
  )(out, d_out)


def flash_backward(q, k, v, out, lse, d_out, cfg: KernelConfig):
  """Gradients of the padded forward pass.

  Args:
    q, k, v, out, d_out: padded, layout [batch, seq, heads, head_dim].
    lse: [batch, heads, q_len_padded] from the forward kernel.
    cfg: the forward's configuration; its `bwd_block_*` must divide the
      padded lengths.

  Returns:
    (dq [batch, q_len_padded, heads, D], dk and dv [batch, kv_len_padded,
    heads, D]), all in `grad_accum`; dk/dv are per query head, not yet
    summed over GQA groups.
  """
  batch, q_len_padded, heads, head_dim_padded = q.shape
  kv_len_padded, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  policy = cfg.policy
  block_q, block_k = cfg.bwd_block_q, cfg.bwd_block_k
  params = cfg.compiler_params(block_q * block_k)

  def rows_spec(block, head_of):
    return pl.BlockSpec((None, block, None, head_dim_padded), head_of)

  def vec_spec(block, index_map):
    return pl.BlockSpec((None, None, block), index_map)

  delta = _delta(out, d_out, cfg)

  grad_dtype = policy.dtype("grad_accum")
  whole_q = rows_spec(q_len_padded, lambda j, b, h: (b, 0, h, 0))
  whole_kv = rows_spec(kv_len_padded, lambda j, b, h: (b, 0, h // group, 0))
  whole_vec = vec_spec(q_len_padded, lambda j, b, h: (b, h, 0))
  key_block = rows_spec(block_k, lambda j, b, h: (b, j, h // group, 0))
  key_block_out = rows_spec(block_k, lambda j, b, h: (b, j, h, 0))
  dk, dv = pl.pallas_call(
    functools.partial(_dkdv_kernel, cfg=cfg),
    grid=(kv_len_padded // block_k, batch, heads),
    in_specs=[whole_q, key_block, key_block, whole_q, whole_vec, whole_vec],
    out_specs=[key_block_out, key_block_out],
    out_shape=[
      jax.ShapeDtypeStruct(
        (batch, kv_len_padded, heads, head_dim_padded), grad_dtype
      ),
    ]
    * 2,
    compiler_params=params,
    interpret=cfg.interpret,
    name="stableattn_flash_backward_dkdv",
  )(q, k, v, d_out, lse, delta)

  query_block = rows_spec(block_q, lambda i, b, h: (b, i, h, 0))
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, cfg=cfg),
    grid=(q_len_padded // block_q, batch, heads),
    in_specs=[
      query_block,
      whole_kv,
      whole_kv,
      query_block,
      vec_spec(block_q, lambda i, b, h: (b, h, i)),
      vec_spec(block_q, lambda i, b, h: (b, h, i)),
    ],
    out_specs=query_block,
    out_shape=jax.ShapeDtypeStruct(q.shape, grad_dtype),
    compiler_params=params,
    interpret=cfg.interpret,
    name="stableattn_flash_backward_dq",
  )(q, k, v, d_out, lse, delta)
  return dq, dk, dv
