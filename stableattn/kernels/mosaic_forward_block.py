"""One thread block of the Hopper path's forward (`mosaic_forward`): its
place and buffers, the key blocks it visits, the TMA copies that fill
its K/V ring (from the compute warpgroup, or from FlashAttention-3's
copy warpgroup with the `warp_specialized` switch), and the feature
operands each key block reads (token ids, key positions, the additive
tile, the sink)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.mosaic_block_math import plus_additive, sink_in_base
from stableattn.kernels.mosaic_support import (
  BARRIER_BYTES,
  RANGE_WIDTH,
  REDUCTION_SCRATCH_BYTES,
  ROWS,
  MosaicPlan,
  as_columns,
  as_rows,
  block_mask,
  buffer_bytes,
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
  part: object  # the value columns' part (`plan.value_parts`; else 0)
  consumer: int = 0  # the compute warpgroup (`plan.consumers`)

  @property
  def out_head(self):
    """The head the outputs are stored at: the query head's part."""
    return self.head * self.plan.value_parts + self.part


def fetch(block: ForwardBlock, step):
  """Issues the TMA copies of key block `step` into its ring slot."""
  plan = block.plan
  slot = lax.rem(step, jnp.int32(plan.ring_slots))
  keys = pl.ds(step * plan.block_k, plan.block_k)
  kt_bars, v_bars = block.bars[1:3]
  refs, smem, b, h = block.refs, block.smem, block.batch, block.kv_head
  # V's heads hold each key/value head's value parts in turn.
  v_head = h * plan.value_parts + block.part
  k_tile = (
    refs["kt"].at[b, keys, h]
    if plan.k_as_stored
    else refs["kt"].at[b, h, :, keys]
  )
  v_tile = (
    refs["v"].at[b, v_head, :, keys]
    if plan.v_transposed
    else refs["v"].at[b, keys, v_head]
  )
  plgpu.copy_gmem_to_smem(k_tile, smem["kt"].at[slot], kt_bars.at[slot])
  plgpu.copy_gmem_to_smem(v_tile, smem["v"].at[slot], v_bars.at[slot])


def fed(block: ForwardBlock, name: str, index):
  """Shared-memory buffer `name` once `refs[name].at[index]` has arrived
  in it by TMA: a feature operand, waited for through the compute
  warpgroup's feature barrier (one copy at a time)."""
  bar = block.bars[0].at[1]
  plgpu.copy_gmem_to_smem(block.refs[name].at[index], block.smem[name], bar)
  plgpu.barrier_wait(bar)
  return block.smem[name]


def key_vector(block: ForwardBlock, name: str, k_start, per_head=False):
  """The key block's entries of a per-key operand ([B, S] in global
  memory: token ids or positions; [B, Hkv, S] `per_head`: K's and V's
  scales), by TMA, one per tile column."""
  keys = pl.ds(k_start, block.plan.block_k)
  heads = (block.kv_head,) if per_head else ()
  buffer = fed(block, name, (block.batch, *heads, keys))
  return column_vector(buffer, block.plan.interpret)


def query_scales(block: ForwardBlock, rows):
  """Q's scale on each row of the block (FP8 operands), or None."""
  if not block.plan.scaled:
    return None
  buffer = fed(block, "q_scale", (block.batch, block.head, rows))
  return row_vector(buffer, block.plan.interpret)


def channel_descale(block: ForwardBlock):
  """P V's descale s_v * (1 / p_scale) on each value column of the thread
  block's part, where V's scales are per channel (`block_math.
  probs_times_values`): one copy per thread block; else None."""
  plan = block.plan
  if not (plan.scaled and plan.v_per_channel):
    return None
  v_head = block.kv_head * plan.value_parts + block.part
  buffer = fed(block, "v_scale", (block.batch, v_head))
  return column_vector(buffer, plan.interpret) * jnp.float32(1.0 / plan.p_scale)


def value_descale(block: ForwardBlock, k_start, channels, shape):
  """P V's descale over a (rows x value columns) tile: `channels` (from
  `channel_descale`) on each column, or V's one scale over the key block
  (the largest of its keys', all equal by construction) times
  1 / p_scale on each row."""
  plan = block.plan
  if channels is not None:
    return as_columns(channels, shape)
  per_key = key_vector(block, "v_scale", k_start, per_head=True)
  largest = as_columns(per_key, (ROWS, plan.block_k)).max(axis=1)
  return as_rows(largest * jnp.float32(1.0 / plan.p_scale), shape)


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
  example, head = plan.additive_index(block.batch, block.head)
  rows = pl.ds(block.q_start, ROWS)
  keys = pl.ds(k_start, plan.block_k)
  buffer = fed(block, "additive", (example, head, rows, keys))
  tile = tile_values(buffer, plan.interpret)
  return plus_additive(s, tile, plan, base2=plan.exp2)


def sink_logits(block: ForwardBlock, rows):
  """The head's sink logit on each row, in the forward's base; None
  without a sink."""
  if not block.plan.sink:
    return None
  buffer = fed(block, "sink", (block.head, rows))
  sink = row_vector(buffer, block.plan.interpret)
  return sink_in_base(sink, block.plan)


def own_range_reader(block: ForwardBlock):
  """(buffer, barrier) a compute warpgroup reads block ranges through:
  its own, as every warpgroup reading a range must have (one barrier
  two warpgroups wait on is a protocol error the interpreter reports);
  None where the plan reads no ranges."""
  if not block.plan.block_ranges:
    return None
  return block.smem["ranges"], block.bars[0].at[1]


def copy_range_reader(block: ForwardBlock):
  """The copy warpgroup's own (buffer, barrier) for block ranges, or
  None where it reads none."""
  if not copy_reads_ranges(block.plan):
    return None
  return block.smem["copy_ranges"], block.bars[4].at[0]


def key_blocks(block: ForwardBlock, reader=None):
  """(first, full, end): the key blocks this thread block's compute
  warpgroup visits, those in [first, full) without a mask
  (`causal_block_bounds`, narrowed to its block range where the plan
  reads ranges, through `reader`: `own_range_reader` by default); with
  split-KV those of its split."""
  plan = block.plan
  first, full, end = causal_block_bounds(plan, block.q_start)
  if plan.block_ranges:
    first, full, end = within_range(
      (first, full, end),
      block.refs["ranges"],
      (block.batch, lax.div(block.q_start, jnp.int32(ROWS))),
      *(reader or own_range_reader(block)),
    )
  if plan.blocks_per_split is not None:
    first = jnp.maximum(first, block.split * plan.blocks_per_split)
    end = jnp.maximum(
      jnp.minimum(end, (block.split + 1) * plan.blocks_per_split), first
    )
    full = jnp.clip(full, first, end)
  return first, full, end


def visited(blocks, reader) -> tuple:
  """(first, end): the key blocks any of the thread block's compute
  warpgroups visits, which the copy warpgroup fills the ring with; the
  ranges read through the calling warpgroup's `reader`."""
  bounds = [key_blocks(block, reader) for block in blocks]
  first = functools.reduce(jnp.minimum, [b[0] for b in bounds])
  end = functools.reduce(jnp.maximum, [b[2] for b in bounds])
  return first, jnp.maximum(end, first)


def copy_warpgroup(blocks):
  """The producer: each key block's K and V into the ring as soon as
  every compute warpgroup has released the slot's previous block (each
  arrives at the slot's `consumed` barrier after its P V), then waits for
  the last releases, so that no copy outlives the kernel."""
  block = blocks[0]  # the ring and its barriers are every consumer's
  first, end = visited(blocks, copy_range_reader(block))
  consumed = block.bars[3]
  slots = jnp.int32(block.plan.ring_slots)

  def issue(step, carry):
    @pl.when(step >= first + slots)
    def _():
      plgpu.barrier_wait(consumed.at[lax.rem(step, slots)])

    fetch(block, step)
    return carry

  lax.fori_loop(first, end, issue, jnp.int32(0))

  def drain(step, carry):
    plgpu.barrier_wait(consumed.at[lax.rem(step, slots)])
    return carry

  lax.fori_loop(jnp.maximum(first, end - slots), end, drain, jnp.int32(0))


def output_names(plan: MosaicPlan) -> tuple[str, ...]:
  """What the forward writes: O, the lse, and the residuals the policy's
  stability options keep (`residuals.residual_names`)."""
  names = ("o", "lse")
  if plan.o_lo:
    names += ("o_lo",)
  if plan.max_sum:
    names += ("m", "l")
  return names


def input_names(plan: MosaicPlan) -> tuple[str, ...]:
  """The feature operands the forward reads after q, K^T and v."""
  names = ("q_ids", "kv_ids") if plan.token_ids else ()
  if plan.key_positions:
    names += ("kv_pos",)
  if plan.additive is not None:
    names += ("additive",)
  if plan.sink:
    names += ("sink",)
  if plan.block_ranges:
    names += ("ranges",)
  if plan.scaled:
    names += ("q_scale", "k_scale", "v_scale")
  return names


# The forward's buffers allocated once: the K/V ring every compute
# warpgroup shares, and the copy warpgroup's block range.
SHARED_BUFFERS = ("kt", "v", "copy_ranges")


def scratch_layout(plan: MosaicPlan) -> dict[str, tuple[str, tuple, object]]:
  """The forward's shared-memory buffers by name, in allocation order,
  each (kind, shape, dtype): "tile" (swizzled for TMA and wgmma) or
  "vector". Q, the K/V ring, P, O, the lse, the feature operands
  (`input_names`), the residuals (`output_names`); each but the ring is
  one compute warpgroup's (`SHARED_BUFFERS`)."""
  dtype, block_k, slots = plan.operand_dtype, plan.block_k, plan.ring_slots
  f32, i32 = jnp.float32, jnp.int32
  k_slots = (
    (slots, block_k, plan.head_dim)
    if plan.k_as_stored
    else (slots, plan.head_dim, block_k)
  )
  v_slots = (
    (slots, plan.value_dim, block_k)
    if plan.v_transposed
    else (slots, block_k, plan.value_dim)
  )
  extra = {
    "q_ids": ("vector", (ROWS,), i32),
    "kv_ids": ("vector", (block_k,), i32),
    "kv_pos": ("vector", (block_k,), i32),
    "additive": ("tile", (ROWS, block_k), f32),
    "sink": ("vector", (ROWS,), f32),
    "ranges": ("vector", (RANGE_WIDTH,), i32),
    "copy_ranges": ("vector", (RANGE_WIDTH,), i32),
    "o_lo": ("tile", (ROWS, plan.value_dim), plan.output_dtype),
    "m": ("vector", (ROWS,), f32),
    "l": ("vector", (ROWS,), f32),
    "q_scale": ("vector", (ROWS,), f32),
    "k_scale": ("vector", (block_k,), f32),
    "v_scale": (
      "vector",
      (plan.value_dim if plan.v_per_channel else block_k,),
      f32,
    ),
  }
  names = (*input_names(plan), *output_names(plan)[2:])
  if copy_reads_ranges(plan):
    names += ("copy_ranges",)
  return {
    "q": ("tile", (ROWS, plan.head_dim), dtype),
    "kt": ("tile", k_slots, dtype),
    "v": ("tile", v_slots, dtype),
    "p": ("tile", (ROWS, block_k), dtype),
    "o": ("tile", (ROWS, plan.value_dim), plan.o_dtype),
    "lse": ("vector", (ROWS,), f32),
    **{name: extra[name] for name in names},
  }


def copy_reads_ranges(plan: MosaicPlan) -> bool:
  """Whether a copy warpgroup reads block ranges (its own buffer and
  barrier, `copy_range_reader`)."""
  return plan.block_ranges and plan.warp_specialized


def barrier_count(plan: MosaicPlan) -> int:
  """The forward's barriers: each compute warpgroup's Q and feature
  copies (two), K's and V's per ring slot (two each, as allocated), the
  ring's releases with a copy warpgroup, the range's read, and the
  compute warpgroups' rendezvous."""
  return (
    2 * plan.consumers
    + 4
    + 2 * plan.warp_specialized
    + copy_reads_ranges(plan)
    + (plan.consumers > 1)
  )


def shared_bytes(plan: MosaicPlan) -> int:
  """The forward's shared memory per thread block, in bytes, as Mosaic
  GPU's lowering counts it (checked against it in a test)."""
  buffers = sum(
    buffer_bytes(shape, dtype)
    * (1 if name in SHARED_BUFFERS else plan.consumers)
    for name, (_, shape, dtype) in scratch_layout(plan).items()
  )
  return buffers + REDUCTION_SCRATCH_BYTES + BARRIER_BYTES * barrier_count(plan)
