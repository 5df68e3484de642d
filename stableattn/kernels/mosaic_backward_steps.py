"""What the Hopper path's backward kernels share (`mosaic_backward`):
copies by TMA, contractions summed chunk by chunk in one wgmma
accumulator, scoped shared memory, stores of FP32 accumulators, the
feature operands' reads, and where a thread block works."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.mosaic_backward_layout import Columns
from stableattn.kernels.mosaic_block_math import plus_additive
from stableattn.kernels.mosaic_support import (
  ROWS,
  MosaicPlan,
  allocated,
  stats_names,
  tile_values,
  within_range,
)


def copy_in(src, dst, barrier):
  """src (global memory) into dst (shared memory) by TMA, waited for."""
  plgpu.copy_gmem_to_smem(src, dst, barrier)
  plgpu.barrier_wait(barrier)


def contraction(shape, chunks, buffers, barrier):
  """The sum over chunks of A_c B_c in FP32, one wgmma accumulator:
  `chunks` holds each chunk's (A, B) slices of global memory, copied in
  turn into `buffers`; None for an operand already in its buffer."""

  def run(acc_ref):
    for sources in chunks:
      for src, dst in zip(sources, buffers):
        if src is not None:
          copy_in(src, dst, barrier)
      plgpu.wgmma(acc_ref, *buffers)
      if len(chunks) > 1:
        plgpu.wgmma_wait(0)  # the next chunk's copies overwrite them
    return acc_ref[...]

  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def product(shape, a_smem, b_smem):
  """A B in FP32 (one wgmma into a fresh accumulator)."""
  return contraction(shape, [(None, None)], (a_smem, b_smem), None)


def column_part(index, columns: Columns):
  """Column part or chunk `index` of a head dim."""
  return pl.ds(index * columns.width, columns.width)


def chunks_of(columns: Columns, a_of, b_of):
  """A contraction's chunks: (A, B) of each column chunk, A None where
  there is one chunk (A is then in its buffer for the whole kernel)."""
  if not columns.chunked:
    return [(None, b_of(column_part(0, columns)))]
  return [
    (a_of(column_part(c, columns)), b_of(column_part(c, columns)))
    for c in range(columns.parts)
  ]


def staged(x, smem):
  """x rounded to the buffer's format and stored there as a wgmma
  operand."""
  smem[...] = x.astype(smem.dtype)
  plgpu.commit_smem()
  return smem


def zeros(shape):
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def scoped(program, scope):
  """program(buffers by name) with the scratch entries of `scope` ((kind,
  shape, dtype), or a buffer type) allocated; its result."""
  names = list(scope)
  types = [
    entry if not isinstance(entry, tuple) else allocated(entry)
    for entry in scope.values()
  ]
  return pl.run_scoped(lambda *b: program(dict(zip(names, b))), *types)


def stored(smem, accumulators: dict, destinations: dict):
  """Each FP32 accumulator through its shared-memory buffer to global
  memory."""
  for name, value in accumulators.items():
    smem[name][...] = value
  plgpu.commit_smem()
  for name in accumulators:
    plgpu.copy_smem_to_gmem(smem[name], destinations[name])
  plgpu.wait_smem_to_gmem(0)


def per_token(g, smem, name: str, span, vector, plan: MosaicPlan):
  """A per-token operand's entries over `span` ((batch, rows)): token
  ids ("q_ids", "kv_ids") or key positions ("kv_pos"), by TMA, in
  registers as `vector` lays them out; None where not in use."""
  if name not in g:
    return None
  copy_in(g[name].at[span], smem[name], smem["bar"].at[0])
  return vector(smem[name], plan.interpret)


def added(g, smem, s, index, plan: MosaicPlan):
  """S plus the additive tile at `index` (natural log), or S."""
  if plan.additive is None:
    return s
  copy_in(g["additive"].at[index], smem["additive"], smem["bar"].at[0])
  tile = tile_values(smem["additive"], plan.interpret)
  return plus_additive(s, tile, plan, base2=False)


def narrowed(bounds, g, smem, name: str, start):
  """(first, end) narrowed to this block's range in `name` ("ranges":
  key blocks of a query block; "query_ranges": query blocks of a key
  block), where the plan reads ranges; `start` is the block's first
  row."""
  if name not in g:
    return bounds
  index = (lax.axis_index("batch"), lax.div(start, jnp.int32(ROWS)))
  return within_range(bounds, g[name], index, smem[name], smem["bar"].at[0])


def rows_read(g, smem, batch, head, rows, plan: MosaicPlan):
  """The softmax residuals and delta of `rows` into shared memory."""
  for name in (*stats_names(plan), "delta"):
    copy_in(g[name].at[batch, head, rows], smem[name], smem["bar"].at[0])


@dataclasses.dataclass(frozen=True)
class Place:
  """Where a thread block works: its batch, query head, key/value head,
  first row (of keys in dK dV, of queries in dQ) and column part."""

  batch: object
  head: object
  kv_head: object
  start: object
  part: object


def place_of(block_axis: str, parts: int, plan: MosaicPlan) -> Place:
  batch, head, block = (
    lax.axis_index(n) for n in ("batch", "heads", block_axis)
  )
  parts = jnp.int32(parts)
  index, part = lax.div(block, parts), lax.rem(block, parts)
  kv_head = lax.div(head, jnp.int32(plan.group))
  return Place(batch, head, kv_head, index * ROWS, part)
