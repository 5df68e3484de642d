"""The flash backward's delta = rowsum(dO * O), per query row.

dS = P * (dP - delta) cancels dP against delta, so delta's error enters
every dS of its row. FlashAttention-2/3, cuDNN and jax's `mha` read O as
stored (rounded to the input format); the policy option delta_source
reads O in FP32, O_hi + O_lo, or (delta_source=probs) recomputes delta
= rowsum(P * dP) from the backward's own P and dP over every key block:
two more matmuls per tile, consistent with the dS it enters.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stableattn.kernels.block_math import (
  NT_DIMS,
  block_scores,
  recomputed_probs,
  unattended_keys_zeroed,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.kernel_operands import TileReader
from stableattn.numerics.rounding import PolicyArithmetic


def _row_delta(o_parts, do_BqxD, ar: PolicyArithmetic):
  """rowsum(dO * O) of a tile, each operation rounded to `delta`; O is
  the sum of `o_parts` in the carrier (O, or O_hi + O_lo: exact)."""
  o_BqxD = o_parts[0].astype(ar.carrier)
  for part in o_parts[1:]:
    o_BqxD = o_BqxD + part.astype(ar.carrier)
  products_BqxD = ar.round(
    ar.round(o_BqxD, "delta") * ar.round(do_BqxD, "delta"), "delta"
  )
  return ar.sum(products_BqxD, "delta")


def _delta_kernel(*refs, ar: PolicyArithmetic):
  *o_refs, do_ref, delta_ref = refs
  o_parts = [o_ref[...] for o_ref in o_refs]
  delta_ref[...] = _row_delta(o_parts, do_ref[...], ar).astype(delta_ref.dtype)


def delta_operands(out, extra: dict) -> tuple:
  """The parts whose sum is the O that delta reads (policy option
  delta_source): O as stored, O in `out_accum`, or O_hi and O_lo."""
  if "o_fp32" in extra:
    return (extra["o_fp32"],)
  if "o_lo" in extra:
    return (out, extra["o_lo"])
  return (out,)


def output_delta(o_parts, d_out, cfg: KernelConfig):
  """delta = rowsum(dO * O) [batch, heads, q_len_padded], in `delta`, O
  the sum of `o_parts` (`delta_operands`).

  In interpret mode plain XLA computes the same operations (a kernel's
  programs would only add per-program overhead there)."""
  batch, q_len_padded, heads, head_dim_padded = d_out.shape
  if cfg.interpret:
    ar = PolicyArithmetic(cfg.policy)
    delta = _row_delta(o_parts, d_out.astype(ar.carrier), ar)
    return delta.transpose(0, 2, 1).astype(cfg.policy.dtype("delta"))
  block_q = cfg.bwd_block_q
  rows = pl.BlockSpec(
    (None, block_q, None, head_dim_padded), lambda i, b, h: (b, i, h, 0)
  )
  return pl.pallas_call(
    functools.partial(_delta_kernel, ar=cfg.arithmetic),
    grid=(q_len_padded // block_q, batch, heads),
    in_specs=[rows] * (len(o_parts) + 1),
    out_specs=pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i)),
    out_shape=jax.ShapeDtypeStruct(
      (batch, heads, q_len_padded), cfg.policy.dtype("delta")
    ),
    compiler_params=cfg.compiler_params(block_q * head_dim_padded),
    interpret=cfg.interpret,
    name="stableattn_flash_backward_delta",
  )(*o_parts, d_out)


def _probs_delta_kernel(q_ref, k_ref, v_ref, do_ref, *refs, cfg, names, count):
  """One program: delta = rowsum(P * dP) of one query block over its key
  blocks, P recomputed from the `count` softmax residual refs and dP =
  dO V^T, each product and each tile's sum rounded to `delta`."""
  stats_refs, refs = refs[:count], refs[count:]
  *feature_refs, delta_ref = refs
  tiles = TileReader.of(cfg, names, feature_refs, query_major=True)
  ar = cfg.arithmetic
  block_q, block_k = cfg.bwd_block_q, cfg.bwd_block_k
  q_start = pl.program_id(0) * block_q
  q_BqxD = q_ref[...]
  do_BqxD = do_ref[...]
  stats_Bq = tuple(r[...] for r in stats_refs)

  def body(k_index, delta_Bq):
    k_start = pl.multiple_of(k_index * block_k, block_k)
    cols = pl.ds(k_start, block_k)
    mask = tiles.mask(q_start, k_start, block_q, block_k)
    k_BkxD, v_BkxD = unattended_keys_zeroed(
      mask, k_ref[cols, :], v_ref[cols, :]
    )
    s_BqxBk, _ = block_scores(
      q_BqxD,
      k_BkxD,
      ar=ar,
      spec=cfg.mask,
      mask=mask,
      bias=tiles.bias(q_start, k_start, block_q, block_k),
    )
    p_BqxBk = recomputed_probs(s_BqxBk, stats_Bq, ar)
    dp_BqxBk = ar.round(ar.dot(do_BqxD, v_BkxD, NT_DIMS), "softmax_stats")
    products = ar.round(ar.round(p_BqxBk, "delta") * dp_BqxBk, "delta")
    return ar.round(delta_Bq + ar.sum(products, "delta"), "delta")

  first, end = tiles.block_range(k_ref.shape[0] // block_k)
  init = jnp.zeros((block_q,), ar.carrier)
  delta_ref[...] = lax.fori_loop(first, end, body, init).astype(delta_ref.dtype)


def probs_delta(operands, features, specs, cfg: KernelConfig):
  """delta = rowsum(P * dP) [batch, heads, q_len_padded] (policy option
  delta_source=probs), one program per query block. `operands`: q, k, v,
  dO and the softmax residuals; `features`: the feature operands' (names,
  arrays, BlockSpecs); `specs`: the BlockSpecs of q, k, v and dO, and the
  row vector's."""
  q = operands[0]
  batch, q_len_padded, heads, _ = q.shape
  names, arrays, feature_specs = features
  rows, row = specs
  count = len(operands) - 4
  return pl.pallas_call(
    functools.partial(_probs_delta_kernel, cfg=cfg, names=names, count=count),
    grid=(q_len_padded // cfg.bwd_block_q, batch, heads),
    in_specs=[
      *rows,
      *[row] * count,
      *feature_specs,
    ],
    out_specs=row,
    out_shape=jax.ShapeDtypeStruct(
      (batch, heads, q_len_padded), cfg.policy.dtype("delta")
    ),
    compiler_params=cfg.compiler_params(cfg.bwd_block_q * cfg.bwd_block_k),
    interpret=cfg.interpret,
    name="stableattn_flash_backward_delta_probs",
  )(*operands, *arrays)
