"""The flash backward as two Pallas Mosaic GPU kernels (Hopper, sm_90).

dK dV: one thread block per (batch, query head, 64-key block) walks the
query blocks that can attend it, working on the transposed tile S^T = K
Q^T so that P^T and dS^T, the A operands of dV += P^T dO and dK += dS^T
Q, come out in the layout wgmma takes. dQ: one block per 64 query rows
walks the key blocks. delta = rowsum(dO O) comes in from the Triton
path's delta (`backward_delta.output_delta`), so both paths share it.

The steps and their roundings are `pallas_backward`'s: P = exp(S - lse)
in FP32, dP = dO V^T, dS = P (dP - delta); dV takes P rounded to the
probs format, dK and dQ take dS rounded to it, each product times the
scale. Operands every product needs transposed come transposed from
global memory (Q^T, dO^T, K^T, V^T), as in the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.mosaic_support import (
  ROWS,
  MosaicPlan,
  as_columns,
  as_rows,
  block_mask,
  causal_block_bounds,
  column_vector,
  query_block_bounds,
  recomputed_probs,
  row_vector,
  smem_tile,
  softcap_slope,
  softcapped,
  stats_names,
)


def _product(shape, a_smem, b_smem):
  """A B in FP32 (one wgmma into a fresh accumulator)."""

  def run(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    return acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _staged(x, smem):
  """x rounded to the buffer's format and stored there as a wgmma
  operand."""
  smem[...] = x.astype(smem.dtype)
  plgpu.commit_smem()
  return smem


def _copy(src, dst, barrier):
  plgpu.copy_gmem_to_smem(src, dst, barrier)
  plgpu.barrier_wait(barrier)


def _zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _scoped(program, scratch: dict):
  """Runs program(buffers by name) with the named scratch allocated (the
  barrier last, under "bar")."""
  names = list(scratch)

  def body(*buffers):
    program(dict(zip(names, buffers)))

  pl.run_scoped(body, *scratch.values())


def _token_ids(g, smem, plan: MosaicPlan, side: int, span, vector):
  """One side's token ids (0: the queries', 1: the keys') over `span`
  ((batch, rows)), by TMA, in registers as `vector` lays them out; None
  without lengths or segments."""
  if not plan.token_ids:
    return None
  _copy(g["ids"][side].at[span], smem["ids"][side], smem["bar"].at[0])
  return vector(smem["ids"][side], plan.interpret)


def _ids_scratch(plan: MosaicPlan, kv_rows: int):
  if not plan.token_ids:
    return ()
  return (plgpu.SMEM((ROWS,), jnp.int32), plgpu.SMEM((kv_rows,), jnp.int32))


def _row_scratch(plan: MosaicPlan) -> dict:
  """Shared memory for the softmax residuals' and delta's row vectors."""
  names = (*stats_names(plan), "delta")
  return {n: plgpu.SMEM((ROWS,), jnp.float32) for n in names}


def _dkdv_step(g, smem, at, i, carry, plan: MosaicPlan):
  """dK, dV += one query block's share, on the transposed tile."""
  batch, head, k_start, kv_ids = at
  dk, dv = carry
  rows = pl.ds(i * ROWS, ROWS)
  bar = smem["bar"].at[0]
  for name, index in (
    ("q", (batch, rows, head)),
    ("qt", (batch, head, slice(None), rows)),
    ("do", (batch, rows, head)),
    ("dot", (batch, head, slice(None), rows)),
    *((n, (batch, head, rows)) for n in (*stats_names(plan), "delta")),
  ):
    _copy(g[name].at[index], smem[name], bar)
  s_t, tanh_t = softcapped(
    _product((ROWS, ROWS), smem["k"], smem["qt"]), plan, plan.scale
  )
  q_ids = _token_ids(g, smem, plan, 0, (batch, rows), column_vector)
  allowed = block_mask(
    plan, i * ROWS, k_start, q_ids, kv_ids, cols=ROWS, transposed=True
  )
  s_t = jnp.where(allowed, s_t, -jnp.inf)
  stats = [column_vector(smem[n], plan.interpret) for n in stats_names(plan)]
  p_t = recomputed_probs(s_t, stats, as_columns)
  dp_t = _product((ROWS, ROWS), smem["v"], smem["dot"])
  delta = column_vector(smem["delta"], plan.interpret)
  ds_t = softcap_slope(p_t * (dp_t - as_columns(delta, dp_t.shape)), tanh_t)
  dims = plan.head_dim, plan.value_dim
  dv = dv + _product((ROWS, dims[1]), _staged(p_t, smem["ds"]), smem["do"])
  dk_step = _product((ROWS, dims[0]), _staged(ds_t, smem["ds"]), smem["q"])
  return dk + dk_step * jnp.float32(plan.scale), dv


def _operands(refs, names, outputs: int, block_axis: str, plan: MosaicPlan):
  """The inputs by name (the token ids, if any, as "ids"), the outputs,
  and this thread block's (batch, query head, key/value head, first row
  of its block)."""
  inputs = dict(zip(names, refs))
  inputs["ids"] = refs[len(names) : len(refs) - outputs]
  batch, head, block = (
    lax.axis_index(n) for n in ("batch", "heads", block_axis)
  )
  kv_head = lax.div(head, jnp.int32(plan.group))
  return (
    inputs,
    refs[len(refs) - outputs :],
    (batch, head, kv_head, block * ROWS),
  )


def _dkdv_kernel(*refs, plan: MosaicPlan):
  names = ("q", "qt", "k", "v", "do", "dot", *stats_names(plan), "delta")
  g, (dk_ref, dv_ref), place = _operands(refs, names, 2, "k", plan)
  batch, head, kv_head, k_start = place
  keys = pl.ds(k_start, ROWS)
  dims = plan.head_dim, plan.value_dim

  def program(smem):
    bar = smem["bar"].at[0]
    _copy(g["k"].at[batch, keys, kv_head], smem["k"], bar)
    _copy(g["v"].at[batch, keys, kv_head], smem["v"], bar)
    kv_ids = _token_ids(g, smem, plan, 1, (batch, keys), row_vector)
    at = (batch, head, k_start, kv_ids)
    step = functools.partial(_dkdv_step, g, smem, at, plan=plan)
    init = (_zeros((ROWS, dims[0])), _zeros((ROWS, dims[1])))
    first, end = query_block_bounds(
      plan, k_start, ROWS, plan.q_len_padded // ROWS
    )
    dk, dv = lax.fori_loop(first, end, step, init)
    smem["dk"][...] = dk
    smem["dv"][...] = dv
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem["dk"], dk_ref.at[batch, keys, head])
    plgpu.copy_smem_to_gmem(smem["dv"], dv_ref.at[batch, keys, head])
    plgpu.wait_smem_to_gmem(0)

  dtype = plan.operand_dtype
  _scoped(
    program,
    dict(
      k=smem_tile((ROWS, dims[0]), dtype),
      v=smem_tile((ROWS, dims[1]), dtype),
      q=smem_tile((ROWS, dims[0]), dtype),
      qt=smem_tile((dims[0], ROWS), dtype),
      do=smem_tile((ROWS, dims[1]), dtype),
      dot=smem_tile((dims[1], ROWS), dtype),
      ds=smem_tile((ROWS, ROWS), dtype),  # P^T, then dS^T
      dk=smem_tile((ROWS, dims[0]), jnp.float32),
      dv=smem_tile((ROWS, dims[1]), jnp.float32),
      **_row_scratch(plan),
      ids=_ids_scratch(plan, ROWS),
      bar=plgpu.Barrier(num_barriers=1),
    ),
  )


def _dq_step(g, smem, at, j, dq, plan: MosaicPlan):
  """dQ += one key block's dS K * scale; with ds_for_dq=hi_lo dS enters
  as dS_hi + dS_lo, two products (`pallas_backward._dq_step`)."""
  batch, kv_head, q_start, q_ids, stats, delta = at
  keys = pl.ds(j * plan.block_k, plan.block_k)
  bar = smem["bar"].at[0]
  _copy(g["kt"].at[batch, kv_head, :, keys], smem["kt"], bar)
  _copy(g["vt"].at[batch, kv_head, :, keys], smem["vt"], bar)
  _copy(g["k"].at[batch, keys, kv_head], smem["k"], bar)
  tile = (ROWS, plan.block_k)
  s, tanh = softcapped(_product(tile, smem["q"], smem["kt"]), plan, plan.scale)
  kv_ids = _token_ids(g, smem, plan, 1, (batch, keys), column_vector)
  allowed = block_mask(plan, q_start, j * plan.block_k, q_ids, kv_ids)
  s = jnp.where(allowed, s, -jnp.inf)
  p = recomputed_probs(s, stats, as_rows)
  dp = _product(tile, smem["do"], smem["vt"])
  ds = softcap_slope(p * (dp - as_rows(delta, dp.shape)), tanh)
  scale = jnp.float32(plan.scale)
  out = (ROWS, plan.head_dim)
  step = _product(out, _staged(ds, smem["ds"]), smem["k"]) * scale
  if plan.ds_hi_lo:
    low = ds - ds.astype(plan.operand_dtype).astype(jnp.float32)
    step = step + _product(out, _staged(low, smem["ds"]), smem["k"]) * scale
  return dq + step


def _dq_kernel(*refs, plan: MosaicPlan):
  names = ("q", "k", "kt", "vt", "do", *stats_names(plan), "delta")
  g, (dq_ref,), place = _operands(refs, names, 1, "q", plan)
  batch, head, kv_head, q_start = place
  rows = pl.ds(q_start, ROWS)
  dims = plan.head_dim, plan.value_dim

  def program(smem):
    bar = smem["bar"].at[0]
    _copy(g["q"].at[batch, rows, head], smem["q"], bar)
    _copy(g["do"].at[batch, rows, head], smem["do"], bar)
    for name in (*stats_names(plan), "delta"):
      _copy(g[name].at[batch, head, rows], smem[name], bar)
    q_ids = _token_ids(g, smem, plan, 0, (batch, rows), row_vector)
    stats = [row_vector(smem[n], plan.interpret) for n in stats_names(plan)]
    delta = row_vector(smem["delta"], plan.interpret)
    at = (batch, kv_head, q_start, q_ids, stats, delta)
    step = functools.partial(_dq_step, g, smem, at, plan=plan)
    first, _, end = causal_block_bounds(plan, q_start)
    dq = lax.fori_loop(first, end, step, _zeros((ROWS, dims[0])))
    smem["dq"][...] = dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem["dq"], dq_ref.at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)

  dtype, block_k = plan.operand_dtype, plan.block_k
  _scoped(
    program,
    dict(
      q=smem_tile((ROWS, dims[0]), dtype),
      do=smem_tile((ROWS, dims[1]), dtype),
      k=smem_tile((block_k, dims[0]), dtype),
      kt=smem_tile((dims[0], block_k), dtype),
      vt=smem_tile((dims[1], block_k), dtype),
      ds=smem_tile((ROWS, block_k), dtype),
      dq=smem_tile((ROWS, dims[0]), jnp.float32),
      **_row_scratch(plan),
      ids=_ids_scratch(plan, block_k),
      bar=plgpu.Barrier(num_barriers=1),
    ),
  )


def mosaic_backward(q, k, v, d_out, stats, delta, ids, plan: MosaicPlan):
  """(dq [B, T, H, D], dk and dv [B, S, H, D] per query head) in FP32 of
  padded q, k, v, d_out, the forward's softmax residuals `stats` ((lse,)
  or (m, l), `stats_names`) and delta, each [B, H, T]."""
  batch, q_len, heads, _ = q.shape
  kv_len = k.shape[1]
  qt, dot = (jnp.transpose(x, (0, 2, 3, 1)) for x in (q, d_out))
  kt, vt = (jnp.transpose(x, (0, 2, 3, 1)) for x in (k, v))
  f32 = jnp.float32
  dkdv = plgpu.kernel(
    functools.partial(_dkdv_kernel, plan=plan),
    out_type=(
      jax.ShapeDtypeStruct((batch, kv_len, heads, plan.head_dim), f32),
      jax.ShapeDtypeStruct((batch, kv_len, heads, plan.value_dim), f32),
    ),
    grid=(batch, heads, kv_len // ROWS),
    grid_names=("batch", "heads", "k"),
    interpret=plan.interpret_params,
    kernel_name="stableattn_mosaic_backward_dkdv",
  )
  dk, dv = dkdv(q, qt, k, v, d_out, dot, *stats, delta, *ids)
  dq_call = plgpu.kernel(
    functools.partial(_dq_kernel, plan=plan),
    out_type=jax.ShapeDtypeStruct((batch, q_len, heads, plan.head_dim), f32),
    grid=(batch, heads, q_len // ROWS),
    grid_names=("batch", "heads", "q"),
    interpret=plan.interpret_params,
    kernel_name="stableattn_mosaic_backward_dq",
  )
  dq = dq_call(q, k, kt, vt, d_out, *stats, delta, *ids)
  return dq, dk, dv
