"""The flash backward as Pallas Mosaic GPU kernels (Hopper, sm_90).

dK dV: one thread block per (batch, query head, 64-key block) walks the
query blocks that can attend it, working on the transposed tile S^T = K
Q^T so that P^T and dS^T, the A operands of dV += P^T dO and dK += dS^T
Q, come out in the layout wgmma takes. dQ: one block per 64 query rows
walks the key blocks. delta = rowsum(dO O) comes in computed under the
policy as the Triton path computes it (`mosaic_delta`).
Above head dim 128, and for absorbed MLA's 576/512, the work is split
into column parts and chunks (`mosaic_backward_layout`).

The steps and their roundings are `pallas_backward`'s
(`mosaic_block_math`): P = exp(S - lse), dP = dO V^T, dS = P (dP -
delta), each in `softmax_stats`; dV takes P rounded to the probs format,
dK and dQ take dS rounded to it, each product times the scale, and the
accumulators round to `grad_accum` after every block. Operands every
product needs transposed come transposed from global memory (Q^T, dO^T,
K^T, V^T), as in the forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.block_math import (
  plus_probs_delta,
  recomputed_probs,
  score_gradients,
)
from stableattn.kernels.mosaic_backward_layout import (
  SINK_SUMS,
  BackwardLayout,
  Columns,
  backward_layout,
  dkdv_scopes,
  dq_scopes,
)
from stableattn.kernels.mosaic_backward_steps import (
  Place,
  added,
  chunks_of,
  column_part,
  contraction,
  copy_in,
  narrowed,
  per_token,
  place_of,
  product,
  rows_read,
  scoped,
  staged,
  stored,
  zeros,
)
from stableattn.kernels.mosaic_block_math import (
  accumulated,
  block_scores,
  gradient_stored,
  low_part,
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
  row_vector,
  stats_names,
)


def _dkdv_step(g, smem, at, i, acc, plan: MosaicPlan, layout, outputs):
  """dK, dV (those in `outputs`) += one query block's share, on the
  transposed tile."""
  place, kv_ids, kv_pos = at
  batch, head, kv_head = place.batch, place.head, place.kv_head
  keys, rows = pl.ds(place.start, ROWS), pl.ds(i * ROWS, ROWS)
  bar = smem["bar"].at[0]
  key, value = layout.key, layout.value
  rows_read(g, smem, batch, head, rows, plan)
  chunks = chunks_of(
    key,
    lambda c: g["k"].at[batch, keys, kv_head, c],
    lambda c: g["qt"].at[batch, head, c, rows],
  )
  s_t, tanh_t = block_scores(
    contraction((ROWS, ROWS), chunks, (smem["k"], smem["qt"]), bar),
    plan,
    base2=False,
  )
  if plan.additive is not None:
    example, bias_head = plan.additive_index(batch, head)
    s_t = added(g, smem, s_t, (example, bias_head, keys, rows), plan)
  q_ids = per_token(g, smem, "q_ids", (batch, rows), column_vector, plan)
  allowed = block_mask(
    plan,
    i * ROWS,
    place.start,
    q_ids,
    kv_ids,
    cols=ROWS,
    transposed=True,
    kv_pos=kv_pos,
  )
  s_t = jnp.where(allowed, s_t, -jnp.inf)
  stats = [column_vector(smem[n], plan.interpret) for n in stats_names(plan)]
  p_t = recomputed_probs(s_t, stats, plan.arithmetic, as_columns)
  steps = {}
  if "dv" in outputs:
    copy_in(
      g["do"].at[batch, rows, head, column_part(place.part, value)],
      smem["do"],
      bar,
    )
    p_staged = staged(p_t, smem["ds"])
    steps["dv"] = product((ROWS, value.width), p_staged, smem["do"])
  if "dk" in outputs:
    chunks = chunks_of(
      value,
      lambda c: g["v"].at[batch, keys, kv_head, c],
      lambda c: g["dot"].at[batch, head, c, rows],
    )
    dp_t = contraction((ROWS, ROWS), chunks, (smem["v"], smem["dot"]), bar)
    delta = column_vector(smem["delta"], plan.interpret)
    ds_t, _ = score_gradients(
      p_t, dp_t, delta, tanh_t, plan.arithmetic, as_columns
    )
    copy_in(
      g["q"].at[batch, rows, head, column_part(place.part, key)], smem["q"], bar
    )
    dk_step = product((ROWS, key.width), staged(ds_t, smem["ds"]), smem["q"])
    steps["dk"] = dk_step * jnp.float32(plan.scale)
  return {n: accumulated(acc[n], steps[n], plan) for n in outputs}


def _dkdv_kernel(*refs, plan: MosaicPlan, layout, outputs, features):
  names = ("q", "qt", "k", "v", "do", "dot", *stats_names(plan), "delta")
  g = dict(zip((*names, *features, *outputs), refs))
  place = place_of("k", layout.parts(outputs), plan)
  batch, kv_head = place.batch, place.kv_head
  keys = pl.ds(place.start, ROWS)
  whole, streamed, store = dkdv_scopes(plan, layout, outputs, features)

  def program(smem):
    for name in ("k", "v"):
      if name in whole:
        copy_in(g[name].at[batch, keys, kv_head], smem[name], smem["bar"].at[0])
    kv_ids, kv_pos = (
      per_token(g, smem, name, (batch, keys), row_vector, plan)
      for name in ("kv_ids", "kv_pos")
    )
    at = (place, kv_ids, kv_pos)
    first, end = query_block_bounds(
      plan, place.start, ROWS, plan.q_len_padded // ROWS
    )
    first, end = narrowed((first, end), g, smem, "query_ranges", place.start)
    init = {n: zeros((ROWS, layout.columns(n).width)) for n in outputs}

    def loop(buffers):
      step = functools.partial(
        _dkdv_step,
        g,
        smem | buffers,
        at,
        plan=plan,
        layout=layout,
        outputs=outputs,
      )
      return lax.fori_loop(first, end, step, init)

    acc = scoped(loop, streamed)
    destinations = {
      n: g[n].at[
        batch, keys, place.head, column_part(place.part, layout.columns(n))
      ]
      for n in outputs
    }
    scoped(lambda buffers: stored(buffers, acc, destinations), store)

  scoped(program, whole | {"bar": plgpu.Barrier(num_barriers=1)})


def _dq_step(g, smem, at, j, carry, plan: MosaicPlan, layout: BackwardLayout):
  """dQ += one key block's dS K * scale; with ds_for_dq=hi_lo dS enters
  as dS_hi + dS_lo, two products (`pallas_backward._dq_step`). With a
  bias, the tile's d(bias) (dS before the softcap's slope) is stored, by
  the thread block of the first column part. `carry`: (dQ, the sums
  for d(sink) where the plan keeps them, else ())."""
  dq, sink_rows = carry
  place, q_ids, stats, delta = at
  batch, head, kv_head = place.batch, place.head, place.kv_head
  block_k, key, value = layout.block_k, layout.key, layout.value
  keys = pl.ds(j * block_k, block_k)
  rows = pl.ds(place.start, ROWS)
  bar = smem["bar"].at[0]
  tile = (ROWS, block_k)
  chunks = chunks_of(
    key,
    lambda c: g["q"].at[batch, rows, head, c],
    lambda c: g["kt"].at[batch, kv_head, c, keys],
  )
  s, tanh = block_scores(
    contraction(tile, chunks, (smem["q"], smem["kt"]), bar),
    plan,
    base2=False,
  )
  if plan.additive is not None:
    example, bias_head = plan.additive_index(batch, head)
    s = added(g, smem, s, (example, bias_head, rows, keys), plan)
  kv_ids, kv_pos = (
    per_token(g, smem, name, (batch, keys), column_vector, plan)
    for name in ("kv_ids", "kv_pos")
  )
  allowed = block_mask(
    plan, place.start, j * block_k, q_ids, kv_ids, cols=block_k, kv_pos=kv_pos
  )
  s = jnp.where(allowed, s, -jnp.inf)
  p = recomputed_probs(s, stats, plan.arithmetic, as_rows)
  chunks = chunks_of(
    value,
    lambda c: g["do"].at[batch, rows, head, c],
    lambda c: g["vt"].at[batch, kv_head, c, keys],
  )
  dp = contraction(tile, chunks, (smem["do"], smem["vt"]), bar)
  ds, d_scores = score_gradients(p, dp, delta, tanh, plan.arithmetic, as_rows)
  if plan.sink_sums:
    sink_rows = _summed_for_sink(p, dp, sink_rows, plan.arithmetic)
  if plan.bias_grad:
    destination = {"dbias": g["dbias"].at[batch, head, rows, keys]}
    gradient = {"dbias": gradient_stored(d_scores, plan)}
    _in_first_part(place, layout, lambda: stored(smem, gradient, destination))

  scale = jnp.float32(plan.scale)
  copy_in(
    g["k"].at[batch, keys, kv_head, column_part(place.part, key)],
    smem["k"],
    bar,
  )
  out = (ROWS, key.width)
  step = product(out, staged(ds, smem["ds"]), smem["k"]) * scale
  if plan.ds_hi_lo:
    low = staged(low_part(ds, plan), smem["ds"])
    step = step + product(out, low, smem["k"]) * scale
  return accumulated(dq, step, plan), sink_rows


def _summed_for_sink(p, dp, rows, ar):
  """(rowsum(P dP), rowsum(P)) of the unrounded P with one more key
  block, rounded as the Triton path's (`backward_delta.probs_delta`)."""
  delta, sums = rows
  return plus_probs_delta(delta, p, dp, ar), sums + jnp.sum(p, axis=1)


def _in_first_part(place: Place, layout: BackwardLayout, store) -> None:
  """store() in the thread block of dQ's first column part only: d(bias)
  is one tile per query block, not per part."""
  if layout.key.parts == 1:
    store()
  else:
    pl.when(place.part == 0)(store)


def _zero_bias_gradient(g, smem, place: Place, blocks, block_k: int, plan):
  """d(bias) is 0 on the key blocks the dQ loop skips (no pair there
  attends): a zero tile is stored to each."""
  first, end = blocks
  smem["dbias"][...] = zeros((ROWS, block_k))
  plgpu.commit_smem()

  def store(j, _):
    keys = pl.ds(j * block_k, block_k)
    rows = pl.ds(place.start, ROWS)
    plgpu.copy_smem_to_gmem(
      smem["dbias"], g["dbias"].at[place.batch, place.head, rows, keys]
    )

  lax.fori_loop(jnp.int32(0), first, store, None)
  lax.fori_loop(end, jnp.int32(plan.kv_len_padded // block_k), store, None)
  plgpu.wait_smem_to_gmem(0)


def _dq_kernel(*refs, plan: MosaicPlan, layout: BackwardLayout, features):
  names = ("q", "k", "kt", "vt", "do", *stats_names(plan), "delta")
  outputs = dq_outputs(plan)
  g = dict(zip((*names, *features, *outputs), refs))
  place = place_of("q", layout.key.parts, plan)
  batch, head = place.batch, place.head
  rows = pl.ds(place.start, ROWS)
  whole, streamed, store = dq_scopes(plan, layout, features)
  # The key blocks' bounds at dQ's key block.
  keyed = dataclasses.replace(plan, block_k=layout.block_k)

  def program(smem):
    for name in ("q", "do"):
      if name in whole:
        copy_in(g[name].at[batch, rows, head], smem[name], smem["bar"].at[0])
    rows_read(g, smem, batch, head, rows, plan)
    q_ids = per_token(g, smem, "q_ids", (batch, rows), row_vector, plan)
    stats = [row_vector(smem[n], plan.interpret) for n in stats_names(plan)]
    delta = row_vector(smem["delta"], plan.interpret)
    first, _, end = causal_block_bounds(keyed, place.start)
    first, end = narrowed((first, end), g, smem, "ranges", place.start)
    at = (place, q_ids, stats, delta)

    def loop(buffers):
      if plan.bias_grad:
        zeroed = functools.partial(
          _zero_bias_gradient,
          g,
          smem | buffers,
          place,
          (first, end),
          layout.block_k,
          keyed,
        )
        _in_first_part(place, layout, zeroed)

      step = functools.partial(
        _dq_step, g, smem | buffers, at, plan=plan, layout=layout
      )
      row_zeros = plgpu.layout_cast(
        jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)
      )
      sums = (row_zeros, row_zeros) if plan.sink_sums else ()
      init = (zeros((ROWS, layout.key.width)), sums)
      return lax.fori_loop(first, end, step, init)

    dq, sums = scoped(loop, streamed)
    destination = g["dq"].at[
      batch, rows, head, column_part(place.part, layout.key)
    ]

    def store_all(buffers):
      stored(buffers, {"dq": dq}, {"dq": destination})
      if sums:
        found = dict(zip(SINK_SUMS, sums))
        at_rows = {n: g[n].at[batch, head, rows] for n in SINK_SUMS}
        _in_first_part(place, layout, lambda: stored(buffers, found, at_rows))

    scoped(store_all, store)

  scoped(program, whole | {"bar": plgpu.Barrier(num_barriers=1)})


def dq_outputs(plan: MosaicPlan) -> tuple[str, ...]:
  """What the dQ kernel writes: dQ, d(bias) with a bias, and the sums
  for d(sink) under sink_delta=probs."""
  return (
    "dq",
    *(("dbias",) if plan.bias_grad else ()),
    *(SINK_SUMS if plan.sink_sums else ()),
  )


def _widened(x, columns: Columns):
  """x with its head dim zero-padded to every part's columns (exact: a
  zero column adds 0 to every product, and its gradient is dropped)."""
  pad = columns.padded - x.shape[-1]
  return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def kernel_features(features: dict) -> tuple[dict, dict]:
  """(dK dV's feature operands, dQ's) from the forward's: dK dV reads its
  query blocks' ranges ("query_ranges") and the additive tile transposed
  (it works on S^T), dQ its key blocks' ("ranges"); neither reads the
  sink."""
  transposed = {
    n: x for n, x in features.items() if n not in ("sink", "ranges")
  }
  keyed = {
    n: x for n, x in features.items() if n not in ("sink", "query_ranges")
  }
  if "additive" in keyed:
    transposed["additive"] = jnp.swapaxes(keyed["additive"], 2, 3)
  return transposed, keyed


def mosaic_backward(q, k, v, d_out, stats, delta, features, plan: MosaicPlan):
  """(dq [B, T, H, D], dk and dv [B, S, H, D] per query head in FP32,
  d(bias) [B, H, T, S] FP32 or None, d(sink)'s (rowsum(P dP),
  rowsum(P)) [B, H, T] FP32 each under sink_delta=probs or None) of
  padded q, k, v, d_out, the forward's softmax residuals `stats` ((lse,)
  or (m, l), `stats_names`) and delta, each [B, H, T], and the feature
  operands {name: array}
  (`mosaic_forward.input_names`, with dQ's "ranges" at the layout's key
  block; the sink is not read)."""
  layout = backward_layout(plan)
  q, k = (_widened(x, layout.key) for x in (q, k))
  v, d_out = (_widened(x, layout.value) for x in (v, d_out))
  batch, q_len, heads, _ = q.shape
  kv_len = k.shape[1]
  qt, dot = (jnp.transpose(x, (0, 2, 3, 1)) for x in (q, d_out))
  kt, vt = (jnp.transpose(x, (0, 2, 3, 1)) for x in (k, v))
  f32 = jnp.float32
  transposed, keyed = kernel_features(features)
  grads = {}
  for outputs in layout.dkdv_kernels:
    call = plgpu.kernel(
      functools.partial(
        _dkdv_kernel,
        plan=plan,
        layout=layout,
        outputs=outputs,
        features=tuple(transposed),
      ),
      out_type=tuple(
        jax.ShapeDtypeStruct(
          (batch, kv_len, heads, layout.columns(n).padded), f32
        )
        for n in outputs
      ),
      grid=(batch, heads, kv_len // ROWS * layout.parts(outputs)),
      grid_names=("batch", "heads", "k"),
      interpret=plan.interpret_params,
      kernel_name=f"stableattn_mosaic_backward_{''.join(outputs)}",
    )
    found = call(q, qt, k, v, d_out, dot, *stats, delta, *transposed.values())
    grads.update(zip(outputs, found))
  shapes = {
    "dq": (batch, q_len, heads, layout.key.padded),
    "dbias": (batch, heads, q_len, kv_len),
  } | {n: (batch, heads, q_len) for n in SINK_SUMS}
  dq_types = [jax.ShapeDtypeStruct(shapes[n], f32) for n in dq_outputs(plan)]
  dq_call = plgpu.kernel(
    functools.partial(
      _dq_kernel, plan=plan, layout=layout, features=tuple(keyed)
    ),
    out_type=tuple(dq_types),
    grid=(batch, heads, q_len // ROWS * layout.key.parts),
    grid_names=("batch", "heads", "q"),
    interpret=plan.interpret_params,
    kernel_name="stableattn_mosaic_backward_dq",
  )
  found = dq_call(q, k, kt, vt, d_out, *stats, delta, *keyed.values())
  found = dict(zip(dq_outputs(plan), found))
  sink_terms = tuple(found[n] for n in SINK_SUMS) if plan.sink_sums else None
  return found["dq"], grads["dk"], grads["dv"], found.get("dbias"), sink_terms
