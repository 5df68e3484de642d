"""Pallas flash-attention backward kernels (FlashAttention-2 style).

Three `pallas_call`s, each reading top to bottom like the forward file:
  1. `delta = rowsum(dO * O)`, rounded to the policy's `delta` format; Qiu &
     Yao (arXiv 2510.04212) trace biased low-precision training to this
     quantity (`backward_delta.py`; O as the policy option delta_source
     says).
  2. dK and dV: one program per key block, looping over query blocks,
     recomputing P from Q, K and the saved log-sum-exp.
  3. dQ: one program per query block, looping over key blocks.

In interpret mode (programs run one after another, on host memory) steps 2
and 3 are one kernel by default: each key block's program also writes its
dQ contribution to every query block, and the contributions are summed
over key blocks afterwards in the order and rounding of step 3, so P is
recomputed once instead of twice, bit for bit the same gradients (the
emulator proves both paths). It needs one dQ-sized buffer per key block,
so it is used up to `FUSED_PARTIALS_MAX_BYTES` and without a bias.

Stages: dP = dO V^T accumulates in `matmul_accum`; dS = P * (dP - delta) is
computed in `softmax_stats` and rounded like P (the `probs` stage) before it
enters a matmul; running dQ, dK, dV sums are kept in `grad_accum`.

The dK/dV kernel runs per query head; the wrapper sums each group of query
heads (GQA) in `grad_accum` before the final cast.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stableattn.contract.masking import MaskOperands
from stableattn.kernels.backward_delta import (
  delta_operands,
  output_delta,
  probs_delta,
)
from stableattn.kernels.block_math import (
  NN_DIMS,
  NT_DIMS,
  TN_DIMS,
  block_scores,
  recomputed_probs,
  scaled_dot,
  score_gradients,
  unattended_keys_zeroed,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.kernel_operands import TileReader, operand_specs
from stableattn.kernels.residuals import softmax_stats_of, stats_count
from stableattn.numerics.rounding import PolicyArithmetic


def _probs_and_dscores(
  q_BqxD, k_BkxD, v_BkxD, do_BqxD, stats_Bq, delta_Bq, mask, bias, *, cfg
):
  """Recomputes P and returns (P, dS, dS of the biased scores).

  P is rounded to `probs` (a matmul operand), dS is in `softmax_stats`
  (each matmul rounds it to `probs`); dS includes the softcap's slope.
  The third, in `softmax_stats`, is the gradient of the bias (the bias is
  added after the softcap).
  """
  ar = cfg.arithmetic
  s_BqxBk, tanh_BqxBk = block_scores(
    q_BqxD, k_BkxD, ar=ar, spec=cfg.mask, mask=mask, bias=bias
  )
  p_BqxBk = recomputed_probs(s_BqxBk, stats_Bq, ar)
  dp_BqxBk = ar.dot(do_BqxD, v_BkxD, NT_DIMS)
  ds_BqxBk, ds_logits_BqxBk = score_gradients(
    p_BqxBk, dp_BqxBk, delta_Bq, tanh_BqxBk, ar
  )
  return ar.round(p_BqxBk, "probs"), ds_BqxBk, ds_logits_BqxBk


def _dq_step(ds_BqxBk, k_BkxD, cfg: KernelConfig):
  """dS K * scale of one tile in `matmul_accum`: dS rounded to `probs`,
  or with the policy option ds_for_dq=hi_lo as dS_hi + dS_lo, both in
  `probs` (two matmuls): dQ sums dS over keys, whose tied entries cancel,
  and one rounding of dS leaves what they cancel to."""
  ar = cfg.arithmetic
  hi_BqxBk = ar.round(ds_BqxBk, "probs")
  step = scaled_dot(hi_BqxBk, k_BkxD, NN_DIMS, ar, cfg.scale, "matmul_accum")
  if cfg.policy.ds_for_dq != "hi_lo":
    return step
  lo_BqxBk = ar.round(ds_BqxBk - hi_BqxBk, "probs")
  low = scaled_dot(lo_BqxBk, k_BkxD, NN_DIMS, ar, cfg.scale, "matmul_accum")
  return ar.round(step + low, "matmul_accum")


def _dkdv_kernel(
  q_ref, k_ref, v_ref, do_ref, delta_ref, *refs, cfg, names, with_dq
):
  """One program: one key block of one (batch, query head); `with_dq`:
  also this key block's dQ contribution to every query block. `refs`:
  the softmax residuals (`residuals.stats_count`), the features, the
  outputs."""
  stats_refs, refs = refs[: stats_count(cfg)], refs[stats_count(cfg) :]
  if with_dq:
    *feature_refs, dk_ref, dv_ref, dq_ref = refs
    dq_ref[...] = jnp.zeros(dq_ref.shape, dq_ref.dtype)
  else:
    *feature_refs, dk_ref, dv_ref = refs
  tiles = TileReader.of(cfg, names, feature_refs, query_major=False)
  ar = cfg.arithmetic
  block_q, block_k = cfg.bwd_block_q, cfg.bwd_block_k
  q_len_padded = q_ref.shape[0]
  k_start = pl.program_id(0) * block_k
  k_BkxD = k_ref[...]
  v_BkxD = v_ref[...]

  def body(q_index, carry):
    dk_BkxD, dv_BkxD = carry
    q_start = pl.multiple_of(q_index * block_q, block_q)
    rows = pl.ds(q_start, block_q)
    mask = tiles.mask(q_start, k_start, block_q, block_k)
    k_use, v_use = unattended_keys_zeroed(mask, k_BkxD, v_BkxD)
    do_BqxD = do_ref[rows, :]
    q_BqxD = q_ref[rows, :]
    p_BqxBk, ds_BqxBk, _ = _probs_and_dscores(
      q_BqxD,
      k_use,
      v_use,
      do_BqxD,
      tuple(r[rows] for r in stats_refs),
      delta_ref[rows],
      mask,
      tiles.bias(q_start, k_start, block_q, block_k),
      cfg=cfg,
    )
    dv_step = ar.round(ar.dot(p_BqxBk, do_BqxD, TN_DIMS), "grad_accum")
    dk_step = scaled_dot(
      ar.round(ds_BqxBk, "probs"),
      q_BqxD,
      TN_DIMS,
      ar,
      cfg.scale,
      "matmul_accum",
    )
    dk_BkxD = ar.round(dk_BkxD + ar.round(dk_step, "grad_accum"), "grad_accum")
    dv_BkxD = ar.round(dv_BkxD + dv_step, "grad_accum")
    if with_dq:
      dq_step = _dq_step(ds_BqxBk, k_use, cfg)
      dq_ref[rows, :] = ar.round(dq_step, "grad_accum").astype(dq_ref.dtype)
    return dk_BkxD, dv_BkxD

  first, end = tiles.block_range(q_len_padded // block_q)
  init = (
    jnp.zeros((block_k, k_ref.shape[-1]), ar.carrier),
    jnp.zeros((block_k, v_ref.shape[-1]), ar.carrier),
  )
  dk_BkxD, dv_BkxD = lax.fori_loop(first, end, body, init)
  dk_ref[...] = dk_BkxD.astype(dk_ref.dtype)
  dv_ref[...] = dv_BkxD.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, delta_ref, *refs, cfg, names):
  """One program: one query block of one (batch, query head).

  With a bias it also writes the bias gradient of its rows (zeros in the
  key blocks it skips).
  """
  stats_refs, refs = refs[: stats_count(cfg)], refs[stats_count(cfg) :]
  with_bias = cfg.mask.bias is not None
  if with_bias:
    *feature_refs, dq_ref, dbias_ref = refs
  else:
    *feature_refs, dq_ref = refs
  tiles = TileReader.of(cfg, names, feature_refs, query_major=True)
  ar = cfg.arithmetic
  block_q, block_k = cfg.bwd_block_q, cfg.bwd_block_k
  kv_len_padded = k_ref.shape[0]
  head_dim_padded = q_ref.shape[-1]
  q_start = pl.program_id(0) * block_q
  q_BqxD = q_ref[...]
  do_BqxD = do_ref[...]
  stats_Bq = tuple(r[...] for r in stats_refs)
  delta_Bq = delta_ref[...]

  def body(k_index, dq_BqxD):
    k_start = pl.multiple_of(k_index * block_k, block_k)
    cols = pl.ds(k_start, block_k)
    mask = tiles.mask(q_start, k_start, block_q, block_k)
    k_BkxD, v_BkxD = unattended_keys_zeroed(
      mask, k_ref[cols, :], v_ref[cols, :]
    )
    _, ds_BqxBk, ds_logits_BqxBk = _probs_and_dscores(
      q_BqxD,
      k_BkxD,
      v_BkxD,
      do_BqxD,
      stats_Bq,
      delta_Bq,
      mask,
      tiles.bias(q_start, k_start, block_q, block_k),
      cfg=cfg,
    )
    if with_bias:
      dbias_ref[:, cols] = ar.stored(ds_logits_BqxBk, "grad_accum")
    dq_step = _dq_step(ds_BqxBk, k_BkxD, cfg)
    return ar.round(dq_BqxD + ar.round(dq_step, "grad_accum"), "grad_accum")

  num_k_blocks = kv_len_padded // block_k
  first, end = tiles.block_range(num_k_blocks)
  init = jnp.zeros((block_q, head_dim_padded), ar.carrier)
  dq_BqxD = lax.fori_loop(first, end, body, init)
  dq_ref[...] = dq_BqxD.astype(dq_ref.dtype)
  if with_bias:
    zeros = jnp.zeros((block_q, block_k), dbias_ref.dtype)

    def clear(k_index, _):
      start = pl.multiple_of(k_index * block_k, block_k)
      dbias_ref[:, pl.ds(start, block_k)] = zeros
      return 0

    lax.fori_loop(0, first, clear, 0)
    lax.fori_loop(end, num_k_blocks, clear, 0)


# Largest dQ-contribution buffer (one dQ per key block) the fused backward
# allocates; past it the two-kernel path runs.
FUSED_PARTIALS_MAX_BYTES = 256 << 20


def _fuses_dq(cfg: KernelConfig, q_shape, kv_len_padded: int) -> bool:
  """Whether dQ comes from the dK/dV kernel (interpret mode, no bias, the
  contributions' buffer, one dQ in `grad_accum` per key block, within
  bounds)."""
  if not cfg.interpret or cfg.mask.bias is not None:
    return False
  itemsize = jnp.dtype(cfg.policy.dtype("grad_accum")).itemsize
  size = kv_len_padded // cfg.bwd_block_k * math.prod(q_shape) * itemsize
  return size <= FUSED_PARTIALS_MAX_BYTES


def _sum_dq_parts(parts, cfg: KernelConfig):
  """dQ from its per-key-block contributions, summed over key blocks in
  the dQ kernel's order and rounding (`grad_accum` after each block)."""
  ar = PolicyArithmetic(cfg.policy)

  def add(j, dq):
    return ar.round(dq + parts[j].astype(ar.carrier), "grad_accum")

  dq = lax.fori_loop(
    0, parts.shape[0], add, jnp.zeros(parts.shape[1:], ar.carrier)
  )
  return dq.astype(parts.dtype)


def flash_backward(
  q, k, v, saved, d_out, ops: MaskOperands, ranges, cfg: KernelConfig
):
  """Gradients of the padded forward pass.

  Args:
    q, k, v, d_out: padded, layout [batch, seq, heads, head_dim].
    saved: the forward's (out, lse [batch, heads, q_len_padded], {name:
      extra residual}) (`pallas_forward.residual_names`): O, the lse and
      what the policy's stability options keep besides.
    ops: the padded feature operands.
    ranges: (key blocks per query block, query blocks per key block) at the
      backward tiles, or None.
    cfg: the forward's configuration; its `bwd_block_*` must divide the
      padded lengths.

  Returns:
    (dq [batch, q_len_padded, heads, D], dk and dv [batch, kv_len_padded,
    heads, D], all in `grad_accum`, dk/dv per query head, not yet summed
    over GQA groups; d(sink)'s (delta, rowsum(P) or None) [batch, heads,
    q_len_padded], as sink_delta says; the bias gradient [batch, heads,
    q_len_padded, kv_len_padded] or None).
  """
  key_ranges, query_ranges = ranges if ranges is not None else (None, None)
  out, lse, extra = saved
  softmax_stats = softmax_stats_of(lse, extra)

  def recomputed_delta(sums=False):
    lengths = (q.shape[1], k.shape[1])
    features = _feature_specs(cfg, ops, key_ranges, *lengths, query_major=True)
    operands = (q, k, v, d_out, *softmax_stats)
    specs = _query_major_specs(operands, cfg)
    return probs_delta(operands, features, specs, cfg, sums=sums)

  if cfg.policy.delta_source == "probs":
    delta = recomputed_delta()
  else:
    delta = output_delta(delta_operands(out, extra), d_out, cfg)
  sink_terms = (delta, None)
  if cfg.policy.sink_delta == "probs" and ops.sink is not None:
    sink_terms = recomputed_delta(sums=True)
  operands = (q, k, v, d_out, delta, *softmax_stats)
  fused = _fuses_dq(cfg, q.shape, k.shape[1])
  dk, dv, *dq_parts = _key_major_call(operands, ops, query_ranges, cfg, fused)
  if fused:
    return _sum_dq_parts(dq_parts[0], cfg), dk, dv, sink_terms, None
  dq, dbias = _query_major_call(operands, ops, key_ranges, cfg)
  return dq, dk, dv, sink_terms, dbias


def _rows_spec(block, x, index_map):
  """Rows [block, head dim of x] of one head of x [B, len, heads, D]."""
  return pl.BlockSpec((None, block, None, x.shape[-1]), index_map)


def _vec_spec(block, index_map):
  return pl.BlockSpec((None, None, block), index_map)


def _feature_specs(
  cfg, ops, ranges, q_len_padded, kv_len_padded, *, query_major
):
  return operand_specs(
    cfg.mask,
    ops,
    ranges,
    query_major=query_major,
    block_q=cfg.bwd_block_q,
    block_k=cfg.bwd_block_k,
    q_len_padded=q_len_padded,
    kv_len_padded=kv_len_padded,
    with_sink=False,
  )


def _key_major_call(operands, ops, query_ranges, cfg: KernelConfig, fused):
  """dK and dV, one program per key block; with `fused` also each key
  block's dQ contribution [key blocks, batch, q_len_padded, heads, D]."""
  q, k, v, d_out = operands[:4]
  batch, q_len_padded, heads, head_dim_padded = q.shape
  kv_len_padded, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  block_k = cfg.bwd_block_k
  key_blocks = kv_len_padded // block_k
  grad_dtype = cfg.policy.dtype("grad_accum")

  def whole_rows(x):
    return _rows_spec(q_len_padded, x, lambda j, b, h: (b, 0, h, 0))

  def key_block(x, heads_of=lambda h: h // group):
    return _rows_spec(block_k, x, lambda j, b, h: (b, j, heads_of(h), 0))

  whole_vec = _vec_spec(q_len_padded, lambda j, b, h: (b, h, 0))
  # dK and dV per query head (summed over the group later).
  out_specs = [key_block(x, lambda h: h) for x in (k, v)]
  out_shape = [
    jax.ShapeDtypeStruct((batch, kv_len_padded, heads, x.shape[-1]), grad_dtype)
    for x in (k, v)
  ]
  if fused:
    # Key block j's dQ contribution to every query row: [j, b, :, h, :].
    out_specs.append(
      pl.BlockSpec(
        (None, None, q_len_padded, None, head_dim_padded),
        lambda j, b, h: (j, b, 0, h, 0),
      )
    )
    out_shape.append(jax.ShapeDtypeStruct((key_blocks, *q.shape), grad_dtype))
  names, arrays, specs = _feature_specs(
    cfg, ops, query_ranges, q_len_padded, kv_len_padded, query_major=False
  )
  return pl.pallas_call(
    functools.partial(_dkdv_kernel, cfg=cfg, names=names, with_dq=fused),
    grid=(key_blocks, batch, heads),
    in_specs=[
      whole_rows(q),
      key_block(k),
      key_block(v),
      whole_rows(d_out),
      *[whole_vec] * (1 + stats_count(cfg)),  # delta, softmax residuals
      *specs,
    ],
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=cfg.compiler_params(cfg.bwd_block_q * block_k),
    interpret=cfg.interpret,
    name="stableattn_flash_backward_dkdvdq"
    if fused
    else "stableattn_flash_backward_dkdv",
  )(*operands, *arrays)


def _query_major_specs(operands, cfg: KernelConfig):
  """BlockSpecs of a query-major backward kernel (grid: query blocks,
  batch, heads): for q, k, v and dO (`operands`' first four) a query
  block, all keys (or values) of its head's group, a query block of dO;
  then the block's row vector."""
  q, k, v, d_out = operands[:4]
  kv_len_padded = k.shape[1]
  group = q.shape[2] // k.shape[2]
  block_q = cfg.bwd_block_q

  def whole_kv(x):
    return _rows_spec(kv_len_padded, x, lambda i, b, h: (b, 0, h // group, 0))

  def query_block(x):
    return _rows_spec(block_q, x, lambda i, b, h: (b, i, h, 0))

  rows = [query_block(q), whole_kv(k), whole_kv(v), query_block(d_out)]
  return rows, _vec_spec(block_q, lambda i, b, h: (b, h, i))


def _query_major_call(operands, ops, key_ranges, cfg: KernelConfig):
  """(dQ, the bias gradient or None), one program per query block."""
  q, k = operands[:2]
  batch, q_len_padded, heads, _ = q.shape
  kv_len_padded = k.shape[1]
  block_q = cfg.bwd_block_q
  grad_dtype = cfg.policy.dtype("grad_accum")
  rows, row = _query_major_specs(operands, cfg)
  out_specs = [rows[0]]
  out_shape = [jax.ShapeDtypeStruct(q.shape, grad_dtype)]
  if cfg.mask.bias is not None:
    out_specs.append(
      pl.BlockSpec(
        (None, None, block_q, kv_len_padded), lambda i, b, h: (b, h, i, 0)
      )
    )
    out_shape.append(
      jax.ShapeDtypeStruct(
        (batch, heads, q_len_padded, kv_len_padded), grad_dtype
      )
    )
  names, arrays, specs = _feature_specs(
    cfg, ops, key_ranges, q_len_padded, kv_len_padded, query_major=True
  )
  dq, *dbias = pl.pallas_call(
    functools.partial(_dq_kernel, cfg=cfg, names=names),
    grid=(q_len_padded // block_q, batch, heads),
    in_specs=[
      *rows,
      *[row] * (1 + stats_count(cfg)),  # delta, softmax residuals
      *specs,
    ],
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=cfg.compiler_params(block_q * cfg.bwd_block_k),
    interpret=cfg.interpret,
    name="stableattn_flash_backward_dq",
  )(*operands, *arrays)
  return dq, (dbias[0] if dbias else None)
