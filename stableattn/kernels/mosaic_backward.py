"""The flash backward as two Pallas Mosaic GPU kernels (Hopper, sm_90).

dK dV: one thread block per (batch, query head, 64-key block) walks the
query blocks that can attend it, working on the transposed tile S^T = K
Q^T so that P^T and dS^T, the A operands of dV += P^T dO and dK += dS^T
Q, come out in the layout wgmma takes. dQ: one block per 64 query rows
walks the key blocks. delta = rowsum(dO O) comes in from the Triton
path's delta (`backward_delta.output_delta`), so both paths share it.

The steps and their roundings are `pallas_backward`'s
(`mosaic_block_math`): P = exp(S - lse), dP = dO V^T, dS = P (dP -
delta), each in `softmax_stats`; dV takes P rounded to the probs format,
dK and dQ take dS rounded to it, each product times the scale, and the
accumulators round to `grad_accum` after every block. Operands every
product needs transposed come transposed from global memory (Q^T, dO^T,
K^T, V^T), as in the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.block_math import recomputed_probs, score_gradients
from stableattn.kernels.mosaic_block_math import (
  accumulated,
  block_scores,
  gradient_stored,
  low_part,
  plus_additive,
)
from stableattn.kernels.mosaic_support import (
  ROWS,
  MosaicPlan,
  as_columns,
  as_rows,
  block_mask,
  causal_block_bounds,
  column_vector,
  query_block_bounds,
  range_scratch,
  row_vector,
  smem_tile,
  stats_names,
  tile_values,
  within_range,
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


def _per_token(g, smem, name: str, span, vector, plan: MosaicPlan):
  """A per-token operand's entries over `span` ((batch, rows)): token
  ids ("q_ids", "kv_ids") or key positions ("kv_pos"), by TMA, in
  registers as `vector` lays them out; None where not in use."""
  if name not in g:
    return None
  _copy(g[name].at[span], smem[name], smem["bar"].at[0])
  return vector(smem[name], plan.interpret)


def _feature_scratch(plan: MosaicPlan, names, kv_rows: int, additive) -> dict:
  """Shared memory for the feature operands `names` read: the per-token
  vectors and the additive tile of shape `additive`."""
  scratch = {
    "q_ids": plgpu.SMEM((ROWS,), jnp.int32),
    "kv_ids": plgpu.SMEM((kv_rows,), jnp.int32),
    "kv_pos": plgpu.SMEM((kv_rows,), jnp.int32),
    "additive": smem_tile(additive, jnp.float32),
    "ranges": range_scratch(),
    "query_ranges": range_scratch(),
  }
  return {n: scratch[n] for n in names}


def _added(g, smem, s, index, plan: MosaicPlan):
  """S plus the additive tile at `index` (natural log), or S."""
  if plan.additive is None:
    return s
  _copy(g["additive"].at[index], smem["additive"], smem["bar"].at[0])
  tile = tile_values(smem["additive"], plan.interpret)
  return plus_additive(s, tile, plan, base2=False)


def _narrowed(bounds, g, smem, name: str, start):
  """(first, end) narrowed to this block's range in `name` ("ranges":
  key blocks of a query block; "query_ranges": query blocks of a key
  block), where the plan reads ranges; `start` is the block's first
  row."""
  if name not in g:
    return bounds
  index = (lax.axis_index("batch"), lax.div(start, jnp.int32(ROWS)))
  return within_range(bounds, g[name], index, smem[name], smem["bar"].at[0])


def _row_scratch(plan: MosaicPlan) -> dict:
  """Shared memory for the softmax residuals' and delta's row vectors."""
  names = (*stats_names(plan), "delta")
  return {n: plgpu.SMEM((ROWS,), jnp.float32) for n in names}


def _dkdv_step(g, smem, at, i, carry, plan: MosaicPlan):
  """dK, dV += one query block's share, on the transposed tile."""
  batch, head, k_start, kv_ids, kv_pos = at
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
  s_t, tanh_t = block_scores(
    _product((ROWS, ROWS), smem["k"], smem["qt"]), plan, base2=False
  )
  if plan.additive is not None:
    example, bias_head = plan.additive_index(batch, head)
    keys = pl.ds(k_start, ROWS)
    s_t = _added(g, smem, s_t, (example, bias_head, keys, rows), plan)
  q_ids = _per_token(g, smem, "q_ids", (batch, rows), column_vector, plan)
  allowed = block_mask(
    plan,
    i * ROWS,
    k_start,
    q_ids,
    kv_ids,
    cols=ROWS,
    transposed=True,
    kv_pos=kv_pos,
  )
  s_t = jnp.where(allowed, s_t, -jnp.inf)
  stats = [column_vector(smem[n], plan.interpret) for n in stats_names(plan)]
  p_t = recomputed_probs(s_t, stats, plan.arithmetic, as_columns)
  dp_t = _product((ROWS, ROWS), smem["v"], smem["dot"])
  delta = column_vector(smem["delta"], plan.interpret)
  ds_t, _ = score_gradients(
    p_t, dp_t, delta, tanh_t, plan.arithmetic, as_columns
  )
  dims = plan.head_dim, plan.value_dim
  dv_step = _product((ROWS, dims[1]), _staged(p_t, smem["ds"]), smem["do"])
  dk_step = _product((ROWS, dims[0]), _staged(ds_t, smem["ds"]), smem["q"])
  dk_step = dk_step * jnp.float32(plan.scale)
  return accumulated(dk, dk_step, plan), accumulated(dv, dv_step, plan)


def _operands(refs, names, outputs: int, block_axis: str, plan: MosaicPlan):
  """The inputs by name, the outputs, and this thread block's (batch,
  query head, key/value head, first row of its block)."""
  batch, head, block = (
    lax.axis_index(n) for n in ("batch", "heads", block_axis)
  )
  kv_head = lax.div(head, jnp.int32(plan.group))
  return (
    dict(zip(names, refs)),
    refs[len(names) :],
    (batch, head, kv_head, block * ROWS),
  )


def _dkdv_kernel(*refs, plan: MosaicPlan, features):
  names = ("q", "qt", "k", "v", "do", "dot", *stats_names(plan), "delta")
  g, (dk_ref, dv_ref), place = _operands(
    refs, (*names, *features), 2, "k", plan
  )
  batch, head, kv_head, k_start = place
  keys = pl.ds(k_start, ROWS)
  dims = plan.head_dim, plan.value_dim

  def program(smem):
    bar = smem["bar"].at[0]
    _copy(g["k"].at[batch, keys, kv_head], smem["k"], bar)
    _copy(g["v"].at[batch, keys, kv_head], smem["v"], bar)
    kv_ids, kv_pos = (
      _per_token(g, smem, name, (batch, keys), row_vector, plan)
      for name in ("kv_ids", "kv_pos")
    )
    at = (batch, head, k_start, kv_ids, kv_pos)
    step = functools.partial(_dkdv_step, g, smem, at, plan=plan)
    init = (_zeros((ROWS, dims[0])), _zeros((ROWS, dims[1])))
    first, end = query_block_bounds(
      plan, k_start, ROWS, plan.q_len_padded // ROWS
    )
    first, end = _narrowed((first, end), g, smem, "query_ranges", k_start)
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
      **_feature_scratch(plan, features, ROWS, (ROWS, ROWS)),
      bar=plgpu.Barrier(num_barriers=1),
    ),
  )


def _dq_step(g, smem, at, j, dq, plan: MosaicPlan):
  """dQ += one key block's dS K * scale; with ds_for_dq=hi_lo dS enters
  as dS_hi + dS_lo, two products (`pallas_backward._dq_step`). With a
  bias, the tile's d(bias) (dS before the softcap's slope) is stored."""
  batch, head, kv_head, q_start, q_ids, stats, delta = at
  keys = pl.ds(j * plan.block_k, plan.block_k)
  rows = pl.ds(q_start, ROWS)
  bar = smem["bar"].at[0]
  _copy(g["kt"].at[batch, kv_head, :, keys], smem["kt"], bar)
  _copy(g["vt"].at[batch, kv_head, :, keys], smem["vt"], bar)
  _copy(g["k"].at[batch, keys, kv_head], smem["k"], bar)
  tile = (ROWS, plan.block_k)
  s, tanh = block_scores(
    _product(tile, smem["q"], smem["kt"]), plan, base2=False
  )
  if plan.additive is not None:
    example, bias_head = plan.additive_index(batch, head)
    s = _added(g, smem, s, (example, bias_head, rows, keys), plan)
  kv_ids, kv_pos = (
    _per_token(g, smem, name, (batch, keys), column_vector, plan)
    for name in ("kv_ids", "kv_pos")
  )
  allowed = block_mask(
    plan, q_start, j * plan.block_k, q_ids, kv_ids, kv_pos=kv_pos
  )
  s = jnp.where(allowed, s, -jnp.inf)
  p = recomputed_probs(s, stats, plan.arithmetic, as_rows)
  dp = _product(tile, smem["do"], smem["vt"])
  ds, d_scores = score_gradients(p, dp, delta, tanh, plan.arithmetic, as_rows)
  if plan.bias_grad:
    smem["dbias"][...] = gradient_stored(d_scores, plan)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
      smem["dbias"], g["dbias"].at[batch, head, rows, keys]
    )
    plgpu.wait_smem_to_gmem(0)
  scale = jnp.float32(plan.scale)
  out = (ROWS, plan.head_dim)
  step = _product(out, _staged(ds, smem["ds"]), smem["k"]) * scale
  if plan.ds_hi_lo:
    low = _staged(low_part(ds, plan), smem["ds"])
    step = step + _product(out, low, smem["k"]) * scale
  return accumulated(dq, step, plan)


def _zero_bias_gradient(g, smem, at, blocks, plan: MosaicPlan):
  """d(bias) is 0 on the key blocks the dQ loop skips (no pair there
  attends): a zero tile is stored to each."""
  batch, head, q_start = at
  first, end = blocks
  smem["dbias"][...] = _zeros((ROWS, plan.block_k))
  plgpu.commit_smem()

  def store(j, _):
    keys = pl.ds(j * plan.block_k, plan.block_k)
    rows = pl.ds(q_start, ROWS)
    plgpu.copy_smem_to_gmem(
      smem["dbias"], g["dbias"].at[batch, head, rows, keys]
    )

  lax.fori_loop(jnp.int32(0), first, store, None)
  lax.fori_loop(end, jnp.int32(plan.kv_len_padded // plan.block_k), store, None)
  plgpu.wait_smem_to_gmem(0)


def _dq_kernel(*refs, plan: MosaicPlan, features):
  names = ("q", "k", "kt", "vt", "do", *stats_names(plan), "delta")
  outputs = ("dq", "dbias") if plan.bias_grad else ("dq",)
  g, out_refs, place = _operands(
    refs, (*names, *features), len(outputs), "q", plan
  )
  g.update(zip(outputs, out_refs))
  batch, head, kv_head, q_start = place
  rows = pl.ds(q_start, ROWS)
  dims = plan.head_dim, plan.value_dim

  def program(smem):
    bar = smem["bar"].at[0]
    _copy(g["q"].at[batch, rows, head], smem["q"], bar)
    _copy(g["do"].at[batch, rows, head], smem["do"], bar)
    for name in (*stats_names(plan), "delta"):
      _copy(g[name].at[batch, head, rows], smem[name], bar)
    q_ids = _per_token(g, smem, "q_ids", (batch, rows), row_vector, plan)
    stats = [row_vector(smem[n], plan.interpret) for n in stats_names(plan)]
    delta = row_vector(smem["delta"], plan.interpret)
    first, _, end = causal_block_bounds(plan, q_start)
    first, end = _narrowed((first, end), g, smem, "ranges", q_start)
    if plan.bias_grad:
      _zero_bias_gradient(g, smem, (batch, head, q_start), (first, end), plan)
    at = (batch, head, kv_head, q_start, q_ids, stats, delta)
    step = functools.partial(_dq_step, g, smem, at, plan=plan)
    dq = lax.fori_loop(first, end, step, _zeros((ROWS, dims[0])))
    smem["dq"][...] = dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem["dq"], g["dq"].at[batch, rows, head])
    plgpu.wait_smem_to_gmem(0)

  dtype, block_k = plan.operand_dtype, plan.block_k
  dbias = {}
  if plan.bias_grad:
    dbias = dict(dbias=smem_tile((ROWS, block_k), jnp.float32))
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
      **_feature_scratch(plan, features, block_k, (ROWS, block_k)),
      **dbias,
      bar=plgpu.Barrier(num_barriers=1),
    ),
  )


def mosaic_backward(q, k, v, d_out, stats, delta, features, plan: MosaicPlan):
  """(dq [B, T, H, D], dk and dv [B, S, H, D] per query head in FP32,
  d(bias) [B, H, T, S] FP32 or None) of padded q, k, v, d_out, the
  forward's softmax residuals `stats` ((lse,) or (m, l), `stats_names`)
  and delta, each [B, H, T], and the forward's feature operands
  {name: array} (`mosaic_forward.input_names`; the sink is not read)."""
  batch, q_len, heads, _ = q.shape
  kv_len = k.shape[1]
  qt, dot = (jnp.transpose(x, (0, 2, 3, 1)) for x in (q, d_out))
  kt, vt = (jnp.transpose(x, (0, 2, 3, 1)) for x in (k, v))
  f32 = jnp.float32
  # dQ reads the key blocks of its query block ("ranges"), dK dV the
  # query blocks of its key block ("query_ranges"), on S^T tiles: its
  # additive tile enters transposed too.
  transposed = {
    n: x for n, x in features.items() if n not in ("sink", "ranges")
  }
  features = {
    n: x for n, x in features.items() if n not in ("sink", "query_ranges")
  }
  if "additive" in features:
    transposed["additive"] = jnp.swapaxes(features["additive"], 2, 3)
  dkdv = plgpu.kernel(
    functools.partial(_dkdv_kernel, plan=plan, features=tuple(transposed)),
    out_type=(
      jax.ShapeDtypeStruct((batch, kv_len, heads, plan.head_dim), f32),
      jax.ShapeDtypeStruct((batch, kv_len, heads, plan.value_dim), f32),
    ),
    grid=(batch, heads, kv_len // ROWS),
    grid_names=("batch", "heads", "k"),
    interpret=plan.interpret_params,
    kernel_name="stableattn_mosaic_backward_dkdv",
  )
  dk, dv = dkdv(q, qt, k, v, d_out, dot, *stats, delta, *transposed.values())
  dq_types = [jax.ShapeDtypeStruct((batch, q_len, heads, plan.head_dim), f32)]
  if plan.bias_grad:
    dq_types.append(jax.ShapeDtypeStruct((batch, heads, q_len, kv_len), f32))
  dq_call = plgpu.kernel(
    functools.partial(_dq_kernel, plan=plan, features=tuple(features)),
    out_type=tuple(dq_types),
    grid=(batch, heads, q_len // ROWS),
    grid_names=("batch", "heads", "q"),
    interpret=plan.interpret_params,
    kernel_name="stableattn_mosaic_backward_dq",
  )
  dq, *dbias = dq_call(q, k, kt, vt, d_out, *stats, delta, *features.values())
  return dq, dk, dv, (dbias[0] if dbias else None)
