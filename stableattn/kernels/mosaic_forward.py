"""The flash forward as a Pallas Mosaic GPU kernel (Hopper, sm_90).

One thread block per (batch, query head, 64-row query block, value
part), one warpgroup: Q arrives by TMA once; each key block's K^T and V
arrive by TMA into a two-slot shared-memory ring, the next block's copy
issued before this block's arithmetic, so the copy engine overlaps the
softmax (one slot where two do not fit, as at MLA's 576/512: the next
copy follows P V).
With the `warp_specialized` switch a second warpgroup issues the copies
(FlashAttention-3's producer), refilling a slot once the compute
warpgroup has arrived at the slot's release barrier; with
`two_consumers` a block takes 128 rows, two compute warpgroups 64 each
over the one ring, meeting one step apart (FlashAttention-3's
ping-pong).
S = Q K^T and O += P V are wgmma with FP32 accumulators. The steps are
FlashAttention-2's in the order `pallas_forward` takes them, each rounded
where the policy says (`mosaic_attention` lists what this path honours).

Written by default with the constructs jax's GPU interpret mode runs on
a CPU (`jax._src.pallas.mosaic_gpu.interpret`), so the same program is
tested here and compiled on a GPU:
* K enters transposed (K^T [B, Hkv, D, S] in global memory): the
  interpreter's wgmma has no rule for a transposed shared-memory view.
* P goes through shared memory (the interpreter's wgmma reads both
  operands there), and P V into a fresh accumulator that is added to the
  running one (it has no rule for `pl.run_state` over an accumulator).
* Layout hints (`layout_cast`) are the identity in interpret mode
  (`mosaic_support.interpretable_layout_hints`).
Each of the three has FlashAttention-3's form behind a switch
(`Options.hopper_form`), lowered for sm_90 in a test and timed on a GPU;
jax 0.11's interpreter also runs the transposed view. FP8 operands
(`plan.scaled`) are read K-major wherever K is (wgmma reads 8-bit
operands no other way compiled): K as stored and V^T, each through a
transposed view; the interpreter reads them N-major.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.kernels.mosaic_block_math import (
  block_scores,
  log_sum_exp,
  normalized,
  online_softmax,
  plus_pv,
  rescaled,
)
from stableattn.kernels.mosaic_forward_block import (
  SHARED_BUFFERS,
  ForwardBlock,
  added,
  allowed,
  channel_descale,
  copy_reads_ranges,
  copy_warpgroup,
  fed,
  fetch,
  input_names,
  key_blocks,
  key_vector,
  output_names,
  own_range_reader,
  query_scales,
  scratch_layout,
  sink_logits,
  value_descale,
  visited,
)
from stableattn.kernels.mosaic_support import (
  ROWS,
  MosaicPlan,
  allocated,
  as_columns,
  as_rows,
  row_vector,
)


def _scores(acc_shape, q_smem, k_smem, plan: MosaicPlan, scales=None):
  """S = (Q K^T) * scale (softcapped if set), the product in FP32 (wgmma's
  accumulator), in the forward's base and `softmax_stats`. `k_smem`
  holds K^T, or K itself read through a transposed view
  (`plan.k_as_stored`). FP8 operands' product is multiplied by the
  outer product of their `scales` (Q's per row, K's per column), as
  `block_math.block_scores` does."""
  kt = plgpu.transpose_ref(k_smem, (1, 0)) if plan.k_as_stored else k_smem

  def product(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, kt)
    return acc_ref[...]

  s = pl.run_scoped(product, plgpu.ACC(acc_shape, jnp.float32))
  if scales is not None:
    q_scale, k_scale = scales
    s = s * (as_rows(q_scale, acc_shape) * as_columns(k_scale, acc_shape))
  return block_scores(s, plan, base2=plan.exp2)[0]


def _rescaled_plus_pv(acc, alpha, p, p_smem, v_smem, plan, descale=None):
  """alpha * O + P V in `out_accum` (alpha already rounded to it), P
  rounded to the operands' format (FP8: P * p_scale, and P V times
  `descale`, a tile). The interpreter's
  form: P through shared memory, P V into a fresh accumulator added to
  the rescaled O; FlashAttention-3's switches: P from registers
  (`p_in_registers`), P V accumulated into the rescaled O in place
  (`accumulate_in_place`)."""
  if plan.scaled:
    p = p * jnp.float32(plan.p_scale)
  p16 = p.astype(p_smem.dtype)
  if plan.v_transposed:
    v_smem = plgpu.transpose_ref(v_smem, (1, 0))
  if "p_in_registers" in plan.switches:
    operand = p16
  else:
    p_smem[...] = p16
    plgpu.commit_smem()
    operand = p_smem
  scaled = rescaled(acc, alpha, plan)
  if "accumulate_in_place" in plan.switches:

    def accumulate(acc_ref):
      plgpu.wgmma(acc_ref, operand, v_smem)

    return pl.run_state(accumulate)(plgpu.ACC.init(scaled))

  def product(acc_ref):
    plgpu.wgmma(acc_ref, operand, v_smem)
    return acc_ref[...]

  shape = (ROWS, plan.value_dim)
  pv = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
  return plus_pv(scaled, pv if descale is None else pv * descale, plan)


def _step(block: ForwardBlock, end, rows, j, carry, *, masked: bool):
  """FlashAttention-2's update for key block j (`pallas_forward`'s)."""
  plan, smem = block.plan, block.smem
  q_ids, q_scale, channels = rows
  acc, m, l_sum = carry
  slot = lax.rem(j, jnp.int32(plan.ring_slots))
  # The compute warpgroup fills the ring unless a copy warpgroup does;
  # with two slots the next block's copy overlaps this block's work.
  fills = not plan.warp_specialized
  if fills and plan.ring_slots == 2:

    @pl.when(j + 1 < end)
    def _():
      fetch(block, j + 1)

  if plan.consumers > 1:
    _rendezvous(block)
  k_start = j * plan.block_k
  scales = descale = None
  if plan.scaled:
    scales = (q_scale, key_vector(block, "k_scale", k_start, per_head=True))
    shape = (ROWS, plan.value_dim)
    descale = value_descale(block, k_start, channels, shape)
  plgpu.barrier_wait(block.bars[1].at[slot])
  s = _scores(
    (ROWS, plan.block_k), smem["q"], smem["kt"].at[slot], plan, scales
  )
  s = added(block, s, k_start)
  if masked:
    s = jnp.where(allowed(block, k_start, q_ids), s, -jnp.inf)
  p, alpha, m_new, l_new = online_softmax(s, m, l_sum, plan)
  plgpu.barrier_wait(block.bars[2].at[slot])
  v_slot = smem["v"].at[slot]
  acc = _rescaled_plus_pv(acc, alpha, p, smem["p"], v_slot, plan, descale)
  if plan.warp_specialized:
    plgpu.barrier_arrive(block.bars[3].at[slot])  # the slot is free again
  elif plan.ring_slots == 1:  # the one slot is free once P V has read it

    @pl.when(j + 1 < end)
    def _():
      fetch(block, j + 1)

  return acc, m_new, l_new


def _store(block: ForwardBlock, carry):
  """O normalized once; lse = m + log l in natural log (+inf, and O = 0,
  where no key attends)."""
  plan, smem = block.plan, block.smem
  acc, m, l_sum = carry
  empty = l_sum == 0.0
  l_safe = jnp.where(empty, 1.0, l_sum)
  o = normalized(acc, l_safe, plan)
  smem["o"][...] = o.astype(smem["o"].dtype)
  lse = log_sum_exp(m, l_safe, plan)
  # An empty split's lse is -inf: the merge gives it weight 0.
  no_key = -jnp.inf if plan.blocks_per_split is not None else jnp.inf
  smem["lse"][...] = jnp.where(empty, no_key, lse)
  if plan.o_lo:
    # O - round(O): exact in FP32, round(O) being O's nearest neighbour.
    o_hi = o.astype(smem["o"].dtype).astype(jnp.float32)
    smem["o_lo"][...] = (o - o_hi).astype(smem["o"].dtype)
  if plan.max_sum:
    smem["m"][...] = jnp.where(m == -jnp.inf, 0.0, m)
    smem["l"][...] = l_safe
  plgpu.commit_smem()
  rows = pl.ds(block.q_start, ROWS)
  for name in block.refs["outputs"]:
    tile = name in ("o", "o_lo")
    index = (
      (block.batch, rows, block.out_head)
      if tile
      else (block.batch, block.out_head, rows)
    )
    if plan.blocks_per_split is not None:
      index = (index[0], block.split, *index[1:])
    plgpu.copy_smem_to_gmem(smem[name], block.refs[name].at[index])
  plgpu.wait_smem_to_gmem(0)


def _initial_carry(value_dim: int, sink=None, first_split=None):
  """(O, m, l) before the first key block, in the layouts wgmma gives. A
  sink is a key with logit `sink` (in the scores' base) and value 0: it
  starts the running maximum and contributes exp(sink - m) to the sum
  (`pallas_forward._initial_state`); with split-KV, in the split where
  `first_split` holds only."""
  layout = plgpu.Layout.WGMMA
  rows = layout.reduce(1)
  if sink is None:
    m = jnp.full((ROWS,), -jnp.inf, jnp.float32)
    l_sum = jnp.zeros((ROWS,), jnp.float32)
  else:
    m, l_sum = sink, jnp.ones((ROWS,), jnp.float32)
    if first_split is not None:
      m = m + jnp.where(first_split, 0.0, -jnp.inf)
      l_sum = l_sum * jnp.where(first_split, 1.0, 0.0)
  return (
    plgpu.layout_cast(jnp.zeros((ROWS, value_dim), jnp.float32), layout),
    plgpu.layout_cast(m, rows),
    plgpu.layout_cast(l_sum, rows),
  )


def _rendezvous(block: ForwardBlock):
  """Both compute warpgroups meet here (FlashAttention-3's ping-pong:
  the second starts one rendezvous behind, so one's wgmma runs while the
  other's softmax does)."""
  plgpu.barrier_arrive(block.bars[-1])
  plgpu.barrier_wait(block.bars[-1])


def _passed(block: ForwardBlock, j, carry):
  """Key block j, which another compute warpgroup needs and this one
  does not: waited for, met at, released."""
  slot = lax.rem(j, jnp.int32(block.plan.ring_slots))
  _rendezvous(block)
  plgpu.barrier_wait(block.bars[1].at[slot])
  plgpu.barrier_wait(block.bars[2].at[slot])
  plgpu.barrier_arrive(block.bars[3].at[slot])
  return carry


def _block_program(blocks):
  plan = blocks[0].plan
  if not plan.warp_specialized:
    _compute(blocks[0])
    return
  # FlashAttention-3's producer and consumers: the last warpgroup copies
  # by TMA, the others compute.
  warpgroup = lax.axis_index("wg")
  pl.when(warpgroup == plan.consumers)(lambda: copy_warpgroup(blocks))
  for block in blocks:
    others = blocks if plan.consumers > 1 else None
    compute = functools.partial(_compute, block, others)
    pl.when(warpgroup == block.consumer)(compute)


def _compute(block: ForwardBlock, blocks=None):
  """The FlashAttention-2 pass over the key blocks, and the store; with
  two compute warpgroups (`blocks`, each one's), every block of the
  union of their bounds (the ring's) is waited for and released, and
  those outside this warpgroup's bounds skipped."""
  plan, smem = block.plan, block.smem
  union = None
  if blocks is not None:
    union = visited(blocks, own_range_reader(block))
  q_bar = block.bars[0]
  rows = pl.ds(block.q_start, ROWS)
  q_ref = block.refs["q"]
  plgpu.copy_gmem_to_smem(
    q_ref.at[block.batch, rows, block.head], smem["q"], q_bar.at[0]
  )
  q_ids = None
  if plan.token_ids:
    q_ids = row_vector(fed(block, "q_ids", (block.batch, rows)), plan.interpret)
  sink = sink_logits(block, rows)
  q_scale, channels = query_scales(block, rows), channel_descale(block)
  first, full, end = key_blocks(block)
  if not plan.warp_specialized:

    @pl.when(end > first)
    def _():
      fetch(block, first)

  plgpu.barrier_wait(q_bar.at[0])
  step = functools.partial(_step, block, end, (q_ids, q_scale, channels))
  first_split = None if plan.blocks_per_split is None else block.split == 0
  carry = _initial_carry(plan.value_dim, sink, first_split)
  passed = functools.partial(_passed, block)
  if union is not None:
    if block.consumer == 1:
      _rendezvous(block)
    lax.fori_loop(union[0], first, passed, jnp.int32(0))
  # Blocks every pair of which attends, then those that need the mask.
  carry = lax.fori_loop(
    first, full, functools.partial(step, masked=False), carry
  )
  carry = lax.fori_loop(full, end, functools.partial(step, masked=True), carry)
  if union is not None:
    lax.fori_loop(end, union[1], passed, jnp.int32(0))
    if block.consumer == 0:
      _rendezvous(block)
  _store(block, carry)


def _kernel(q_ref, kt_ref, v_ref, *refs, plan: MosaicPlan):
  outputs = output_names(plan)
  inputs = input_names(plan)
  batch, head, place = (lax.axis_index(n) for n in ("batch", "heads", "q"))
  parts = jnp.int32(plan.value_parts)
  place, part = lax.div(place, parts), lax.rem(place, parts)
  q_block, split = place, jnp.int32(0)
  if plan.blocks_per_split is not None:
    splits = jnp.int32(plan.splits)
    q_block, split = lax.div(place, splits), lax.rem(place, splits)
  global_refs = dict(
    q=q_ref,
    kt=kt_ref,
    v=v_ref,
    outputs=outputs,
    **dict(zip(inputs, refs)),
    **dict(zip(outputs, refs[len(inputs) :])),
  )
  layout = scratch_layout(plan)
  shared = [name for name in layout if name in SHARED_BUFFERS]
  own = [name for name in layout if name not in SHARED_BUFFERS]
  consumers = plan.consumers

  def scoped(*buffers):
    taken = iter(buffers)
    ring = {name: next(taken) for name in shared}
    owns = [{name: next(taken) for name in own} for _ in range(consumers)]
    q_bars = [next(taken) for _ in range(consumers)]
    # K's, V's, [releases, [the copy warpgroup's range]], [rendezvous]
    bars = tuple(taken)
    blocks = [
      ForwardBlock(
        plan,
        global_refs,
        {**ring, **owns[c]},
        (q_bars[c], *bars),
        batch,
        head,
        lax.div(head, jnp.int32(plan.group)),
        q_block * plan.block_rows + c * ROWS,
        split,
        part,
        c,
      )
      for c in range(consumers)
    ]
    _block_program(blocks)

  pl.run_scoped(
    scoped,
    *(allocated(layout[name]) for name in shared),
    *(allocated(layout[name]) for _ in range(consumers) for name in own),
    *(plgpu.Barrier(num_barriers=2) for _ in range(consumers)),
    plgpu.Barrier(num_barriers=2),
    plgpu.Barrier(num_barriers=2),
    # The compute warpgroups' releases of the ring's slots.
    *(
      (plgpu.Barrier(num_arrivals=consumers, num_barriers=2),)
      if plan.warp_specialized
      else ()
    ),
    # The copy warpgroup's read of block ranges.
    *((plgpu.Barrier(num_barriers=1),) if copy_reads_ranges(plan) else ()),
    # The compute warpgroups' rendezvous.
    *((plgpu.Barrier(num_arrivals=2),) if consumers > 1 else ()),
    **({"collective_axes": "wg"} if plan.warp_specialized else {}),
  )


def mosaic_forward(q, kt, v, extra, plan: MosaicPlan):
  """(O [B, T, H, Dv] in the output format, lse [B, H, T] FP32, natural
  log, +inf where no key attends, then `output_names`' residuals: O_lo
  like O, m and l like the lse) of padded q [B, T, H, D], K^T [B, Hkv,
  D, S] (K [B, S, Hkv, D] where `plan.k_as_stored`), v [B, S, Hkv, Dv]
  (read as V^T where `plan.v_transposed`) and `extra`, the operands
  `input_names` lists: token ids (q_ids [B, T], kv_ids [B, S]), key
  positions kv_pos [B, S], the additive tile [B|1, H|1, T, S] FP32, the
  sink's rows [H, T] FP32, and FP8 operands' scales
  (`mosaic_plan.quantized`). Dv is `plan.value_parts` parts of
  `plan.value_dim`."""
  batch, q_len, heads, _ = q.shape
  parts = plan.value_parts
  # Each value part is a head of its own: V [B, S, Hkv * parts, Dv /
  # parts], the outputs [..., H * parts, ...], part p of head h at h *
  # parts + p.
  v = v.reshape(*v.shape[:2], v.shape[2] * parts, plan.value_dim)
  if plan.v_transposed:
    v = jnp.transpose(v, (0, 2, 3, 1))  # V^T [B, Hkv * parts, Dv, S]
  # With split-KV each output has a splits axis after the batch's.
  splits = () if plan.blocks_per_split is None else (plan.splits,)
  tile = jax.ShapeDtypeStruct(
    (batch, *splits, q_len, heads * parts, plan.value_dim), plan.o_dtype
  )
  rows = jax.ShapeDtypeStruct(
    (batch, *splits, heads * parts, q_len), jnp.float32
  )
  types = {"o": tile, "o_lo": tile, "lse": rows, "m": rows, "l": rows}
  kernel = plgpu.kernel(
    functools.partial(_kernel, plan=plan),
    out_type=tuple(types[name] for name in output_names(plan)),
    grid=(batch, heads, q_len // plan.block_rows * plan.splits * parts),
    grid_names=("batch", "heads", "q"),
    **(
      {"num_threads": plan.consumers + 1, "thread_name": "wg"}
      if plan.warp_specialized
      else {}
    ),
    interpret=plan.interpret_params,
    kernel_name="stableattn_mosaic_forward",
  )
  outputs = kernel(q, kt, v, *extra)
  if parts == 1:
    return outputs
  # Every part computes the same row statistics: part 0's are kept.
  return tuple(
    x.reshape(*x.shape[:-2], heads, parts * plan.value_dim)
    if name in ("o", "o_lo")
    else x[..., ::parts, :]
    for name, x in zip(output_names(plan), outputs)
  )
