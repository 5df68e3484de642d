"""One thread block of the Hopper path's forward (`mosaic_forward`): its
place and buffers, the key blocks it visits, the TMA copies that fill
its K/V ring (from the compute warpgroup, or from FlashAttention-3's
copy warpgroup with the `warp_specialized` switch), and the feature
operands each key block reads (token ids, key positions, the additive
tile, the sink)."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.mosaic_block_math import plus_additive, sink_in_base
from stableattn.kernels.mosaic_support import (
  ROWS,
  MosaicPlan,
  block_mask,
  causal_block_bounds,
  column_vector,
  row_vector,
  tile_values,
  within_range,
)


class ForwardBlock(NamedTuple):
  """One thread block's operands, scratch buffers and place."""

  plan: MosaicPlan
  refs: dict  # global memory: q, kt, v, `input_names`, `output_names`
  smem: dict  # shared memory: q, kt, v (two slots), p, o, lse, features
  # (q and ids, K^T slots, V slots[, slots released][, block ranges])
  bars: tuple
  batch: object
  head: object
  kv_head: object
  q_start: object
  split: object  # split-KV's split (0 without split-KV)


def fetch(block: ForwardBlock, step):
  """Issues the TMA copies of key block `step` into its ring slot."""
  slot = lax.rem(step, jnp.int32(2))
  keys = pl.ds(step * block.plan.block_k, block.plan.block_k)
  kt_bars, v_bars = block.bars[1:3]
  refs, smem, b, h = block.refs, block.smem, block.batch, block.kv_head
  k_tile = (
    refs["kt"].at[b, keys, h]
    if block.plan.k_as_stored
    else refs["kt"].at[b, h, :, keys]
  )
  plgpu.copy_gmem_to_smem(k_tile, smem["kt"].at[slot], kt_bars.at[slot])
  plgpu.copy_gmem_to_smem(
    refs["v"].at[b, keys, h], smem["v"].at[slot], v_bars.at[slot]
  )


def key_vector(block: ForwardBlock, name: str, k_start):
  """The key block's entries of a per-key operand ([B, S] in global
  memory: token ids or positions), by TMA, one per tile column."""
  bar = block.bars[0].at[1]
  keys = pl.ds(k_start, block.plan.block_k)
  plgpu.copy_gmem_to_smem(
    block.refs[name].at[block.batch, keys], block.smem[name], bar
  )
  plgpu.barrier_wait(bar)
  return column_vector(block.smem[name], block.plan.interpret)


def allowed(block: ForwardBlock, k_start, q_ids):
  """The tile's mask; the key block's token ids and positions come by
  TMA where in use."""
  kv_ids = kv_pos = None
  if q_ids is not None:
    kv_ids = key_vector(block, "kv_ids", k_start)
  if block.plan.key_positions:
    kv_pos = key_vector(block, "kv_pos", k_start)
  return block_mask(
    block.plan, block.q_start, k_start, q_ids, kv_ids, kv_pos=kv_pos
  )


def added(block: ForwardBlock, s, k_start):
  """S plus the additive tile (bias, -inf where a dense mask blocks) in
  the forward's base, by TMA; S itself without one."""
  plan = block.plan
  if plan.additive is None:
    return s
  bar = block.bars[0].at[1]
  example, head = plan.additive_index(block.batch, block.head)
  rows = pl.ds(block.q_start, ROWS)
  keys = pl.ds(k_start, plan.block_k)
  plgpu.copy_gmem_to_smem(
    block.refs["additive"].at[example, head, rows, keys],
    block.smem["additive"],
    bar,
  )
  plgpu.barrier_wait(bar)
  tile = tile_values(block.smem["additive"], plan.interpret)
  return plus_additive(s, tile, plan, base2=plan.exp2)


def sink_logits(block: ForwardBlock, rows):
  """The head's sink logit on each row, in the forward's base; None
  without a sink."""
  if not block.plan.sink:
    return None
  bar = block.bars[0].at[1]
  plgpu.copy_gmem_to_smem(
    block.refs["sink"].at[block.head, rows], block.smem["sink"], bar
  )
  plgpu.barrier_wait(bar)
  sink = row_vector(block.smem["sink"], block.plan.interpret)
  return sink_in_base(sink, block.plan)


def key_blocks(block: ForwardBlock):
  """(first, full, end): the key blocks this thread block visits, those
  in [first, full) without a mask (`causal_block_bounds`, narrowed to
  its block range where the plan reads ranges: never with the copy
  warpgroup); with split-KV those of its split."""
  plan = block.plan
  first, full, end = causal_block_bounds(plan, block.q_start)
  if plan.block_ranges:
    first, full, end = within_range(
      (first, full, end),
      block.refs["ranges"],
      (block.batch, lax.div(block.q_start, jnp.int32(ROWS))),
      block.smem["ranges"],
      block.bars[-1].at[0],
    )
  if plan.blocks_per_split is not None:
    first = jnp.maximum(first, block.split * plan.blocks_per_split)
    end = jnp.maximum(
      jnp.minimum(end, (block.split + 1) * plan.blocks_per_split), first
    )
    full = jnp.clip(full, first, end)
  return first, full, end


def copy_warpgroup(block: ForwardBlock):
  """The producer: each key block's K and V into the two-slot ring as
  soon as the compute warpgroup has released the slot's previous block
  (it arrives at the slot's `consumed` barrier after its P V), then waits
  for the last releases, so that no copy outlives the kernel."""
  first, _, end = key_blocks(block)
  consumed = block.bars[3]

  def issue(step, carry):
    slot = lax.rem(step, jnp.int32(2))

    @pl.when(step >= first + 2)
    def _():
      plgpu.barrier_wait(consumed.at[slot])

    fetch(block, step)
    return carry

  lax.fori_loop(first, end, issue, jnp.int32(0))

  def drain(step, carry):
    plgpu.barrier_wait(consumed.at[lax.rem(step, jnp.int32(2))])
    return carry

  lax.fori_loop(jnp.maximum(first, end - 2), end, drain, jnp.int32(0))
