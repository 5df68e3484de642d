"""The flash backward's delta = rowsum(dO * O), per query row.

dS = P * (dP - delta) cancels dP against delta, so delta's error enters
every dS of its row. FlashAttention-2/3, cuDNN and jax's `mha` read O as
stored (rounded to the input format); the policy option delta_source
reads O in FP32, O_hi + O_lo, or (delta_source=probs) recomputes delta
= rowsum(P * dP) from the backward's own P and dP over every key block:
two more matmuls per tile, consistent with the dS it enters.

The option delta_product=matmul sums O's `matmul_operands` part by a
matmul of the shape that forms dP (the diagonal of dO O^T, O's rows
entering as key tiles) and only the rest as a row sum: where a row's probability
sits on one key, O is that key's V bitwise and dP - delta is exactly 0
there, as eager attention's rowsum(P * dP) gives, instead of the
difference of two summation orders (an ulp of |dO||V|) in every dS.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stableattn.kernels.block_math import (
  NN_DIMS,
  NT_DIMS,
  block_scores,
  plus_probs_delta,
  recomputed_probs,
  unattended_keys_zeroed,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.kernel_operands import TileReader
from stableattn.numerics.rounding import PolicyArithmetic


def row_delta(
  o_parts, do_BqxD, ar: PolicyArithmetic, block_k=None, diagonal=None
):
  """rowsum(dO * O) of a tile, rounded to `delta`, summed as the policy
  option delta_product says; O is the sum of `o_parts` in the carrier
  (O, or O_hi + O_lo: exact). delta_product=matmul takes dO O_hi^T's
  diagonal from `diagonal(O_hi)` where given (the Hopper path's wgmma),
  else from matmuls over key tiles of `block_k` keys, dP = dO V^T's
  (`_tiled_diagonal`), plus rowsum(dO * (O - O_hi)), rounded to `delta`
  once."""
  o_BqxD = o_parts[0].astype(ar.carrier)
  for part in o_parts[1:]:
    o_BqxD = o_BqxD + part.astype(ar.carrier)
  if ar.policy.delta_product != "matmul":
    return _summed_products(o_BqxD, do_BqxD, ar)
  o_hi_BqxD = ar.round(o_BqxD, "matmul_operands")
  if diagonal is None:
    diagonal_Bq = _tiled_diagonal(o_hi_BqxD, do_BqxD, ar, block_k)
  else:
    diagonal_Bq = diagonal(o_hi_BqxD)
  rest_Bq = _summed_products(o_BqxD - o_hi_BqxD, do_BqxD, ar)
  return ar.round(diagonal_Bq + rest_Bq, "delta")


def _summed_products(o_BqxD, do_BqxD, ar: PolicyArithmetic):
  """rowsum(dO * O), each product and the sum rounded to `delta`."""
  products_BqxD = ar.round(
    ar.round(o_BqxD, "delta") * ar.round(do_BqxD, "delta"), "delta"
  )
  return ar.sum(products_BqxD, "delta")


def _tiled_diagonal(o_hi_BqxD, do_BqxD, ar: PolicyArithmetic, block_k: int):
  """delta_product=matmul's diagonal of dO O_hi^T by matmuls of dP's own
  shape, O_hi = O rounded to `matmul_operands`.

  XLA:CPU sums a half-precision matmul in an order that depends on its
  shape, so O_hi enters as key tiles: block_k of its rows at a time
  (zeros past the end), each a matmul with a 0/1 selection matrix
  (exact: one nonzero term per entry), which Triton lowers where a
  slice or a pad of a block would not."""
  block_q = o_hi_BqxD.shape[0]

  def iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)

  diagonal_Bq = jnp.zeros((block_q,), ar.carrier)
  for start in range(0, block_q, block_k):
    picks_BkxBq = iota((block_k, block_q), 0) + start == iota(
      (block_k, block_q), 1
    )
    rows_BkxD = ar.dot(picks_BkxBq.astype(ar.carrier), o_hi_BqxD, NN_DIMS)
    products_BqxBk = ar.dot(do_BqxD, rows_BkxD, NT_DIMS)
    own_BqxBk = (
      iota((block_q, block_k), 0) == iota((block_q, block_k), 1) + start
    )
    # One nonzero term per row over all tiles: the sum is exact.
    diagonal_Bq = diagonal_Bq + jnp.sum(
      jnp.where(own_BqxBk, products_BqxBk, 0), axis=1
    )
  return diagonal_Bq


def _delta_kernel(*refs, ar: PolicyArithmetic, block_k: int):
  *o_refs, do_ref, delta_ref = refs
  o_parts = [o_ref[...] for o_ref in o_refs]
  delta = row_delta(o_parts, do_ref[...], ar, block_k)
  delta_ref[...] = delta.astype(delta_ref.dtype)


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

  In interpret mode plain XLA computes the row sums (a kernel's programs
  would only add per-program overhead there); delta_product=matmul runs
  the programs, so its matmul has the shape of dP's (XLA:CPU sums a
  batched matmul over all tiles in another order)."""
  batch, q_len_padded, heads, head_dim_padded = d_out.shape
  if cfg.interpret:
    ar = PolicyArithmetic(cfg.policy)
    if cfg.policy.delta_product != "matmul":
      delta = row_delta(o_parts, d_out.astype(ar.carrier), ar)
      return delta.transpose(0, 2, 1).astype(cfg.policy.dtype("delta"))
  block_q = cfg.bwd_block_q
  rows = pl.BlockSpec(
    (None, block_q, None, head_dim_padded), lambda i, b, h: (b, i, h, 0)
  )
  return pl.pallas_call(
    functools.partial(
      _delta_kernel, ar=cfg.arithmetic, block_k=cfg.bwd_block_k
    ),
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


def _probs_delta_kernel(
  q_ref, k_ref, v_ref, do_ref, *refs, cfg, names, count, with_sums
):
  """One program: delta = rowsum(P * dP) of one query block over its key
  blocks, P recomputed from the `count` softmax residual refs and dP =
  dO V^T, each product and each tile's sum rounded to `delta`; with
  `with_sums` also rowsum(P) in the carrier, unrounded P."""
  stats_refs, refs = refs[:count], refs[count:]
  *feature_refs, delta_ref = refs[: len(refs) - with_sums]
  tiles = TileReader.of(cfg, names, feature_refs, query_major=True)
  ar = cfg.arithmetic
  block_q, block_k = cfg.bwd_block_q, cfg.bwd_block_k
  q_start = pl.program_id(0) * block_q
  q_BqxD = q_ref[...]
  do_BqxD = do_ref[...]
  stats_Bq = tuple(r[...] for r in stats_refs)

  def body(k_index, carry):
    delta_Bq, sums_Bq = carry
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
    dp_BqxBk = ar.dot(do_BqxD, v_BkxD, NT_DIMS)
    delta_Bq = plus_probs_delta(delta_Bq, p_BqxBk, dp_BqxBk, ar)
    if with_sums:
      sums_Bq = sums_Bq + jnp.sum(p_BqxBk, axis=1)
    return delta_Bq, sums_Bq

  first, end = tiles.block_range(k_ref.shape[0] // block_k)
  init = jnp.zeros((block_q,), ar.carrier)
  delta_Bq, sums_Bq = lax.fori_loop(first, end, body, (init, init))
  delta_ref[...] = delta_Bq.astype(delta_ref.dtype)
  if with_sums:
    refs[-1][...] = sums_Bq.astype(refs[-1].dtype)


def probs_delta(operands, features, specs, cfg: KernelConfig, *, sums=False):
  """delta = rowsum(P * dP) [batch, heads, q_len_padded] (policy option
  delta_source=probs), one program per query block; with `sums`, (delta,
  rowsum(P)), the second in the carrier. `operands`: q, k, v, dO and the
  softmax residuals; `features`: the feature operands' (names, arrays,
  BlockSpecs); `specs`: the BlockSpecs of q, k, v and dO, and the row
  vector's."""
  q = operands[0]
  batch, q_len_padded, heads, _ = q.shape
  names, arrays, feature_specs = features
  rows, row = specs
  count = len(operands) - 4
  rows_of = functools.partial(
    jax.ShapeDtypeStruct, (batch, heads, q_len_padded)
  )
  out_shape = [rows_of(cfg.policy.dtype("delta"))]
  if sums:
    out_shape.append(rows_of(cfg.arithmetic.carrier))
  found = pl.pallas_call(
    functools.partial(
      _probs_delta_kernel, cfg=cfg, names=names, count=count, with_sums=sums
    ),
    grid=(q_len_padded // cfg.bwd_block_q, batch, heads),
    in_specs=[
      *rows,
      *[row] * count,
      *feature_specs,
    ],
    out_specs=[row] * len(out_shape),
    out_shape=out_shape,
    compiler_params=cfg.compiler_params(cfg.bwd_block_q * cfg.bwd_block_k),
    interpret=cfg.interpret,
    name="stableattn_flash_backward_delta_probs",
  )(*operands, *arrays)
  return tuple(found) if sums else found[0]
