"""The Hopper path's plan of one call (`MosaicPlan` from a kernel
configuration) and its operands at the plan's padded sizes: q, k, v,
the feature operands the kernels read, the additive tile of a bias and a
dense mask, and the block ranges of lengths, segments and per-example
positions."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from stableattn.contract.masking import MaskOperands
from stableattn.contract.options import hopper_switches
from stableattn.contract.tiling import round_up
from stableattn.kernels.flash_attention import (
  pad_operands,
  pad_scales,
  pad_to,
  tile_ranges,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.mosaic_forward_block import input_names, shared_bytes
from stableattn.kernels.mosaic_support import (
  HEAD_DIM_MULTIPLE,
  RANGE_WIDTH,
  ROWS,
  SHARED_MEMORY_BYTES,
  MosaicPlan,
)
from stableattn.kernels.quantization import v_per_channel
from stableattn.numerics.rounding import PolicyArithmetic


def _blocks_per_split(cfg: KernelConfig, block_k: int) -> int | None:
  """Split-KV's key blocks per split at this path's key block (as
  `KernelConfig.blocks_per_split` at the Triton path's)."""
  options = cfg.options
  if options.split_size is not None:
    return max(options.split_size // block_k, 1)
  if options.num_splits is not None:
    blocks = round_up(cfg.kv_len, block_k) // block_k
    return -(-blocks // options.num_splits)
  return None


# A thread block's value columns at most: wgmma's widest N, and the 128
# registers per thread of a 64 x 256 FP32 accumulator in one warpgroup.
VALUE_PART_MAX = 256


def value_parts(value_dim: int) -> tuple[int, int]:
  """(parts, columns per part) of a value head dim: one part up to 256
  columns, else equal parts, each a multiple of 64 (MLA's 512: 2 x 256)."""
  padded = round_up(value_dim, HEAD_DIM_MULTIPLE)
  parts = -(-padded // VALUE_PART_MAX)
  return parts, round_up(-(-padded // parts), HEAD_DIM_MULTIPLE)


def plan_of(cfg: KernelConfig, group: int) -> MosaicPlan:
  """The call's plan, at the widest key block and deepest K/V ring whose
  forward fits in an H100's shared memory (the options' key block, then
  64 keys; two ring slots, then one); where none fits, the smallest, which
  `mosaic_attention.refusals` refuses with its bytes."""
  requested = 128 if cfg.options.block_k >= 128 else 64
  for block_k in dict.fromkeys((requested, 64)):
    for slots in (2, 1):
      plan = _plan_at(cfg, group, block_k, slots)
      if shared_bytes(plan) <= SHARED_MEMORY_BYTES:
        return plan
  return plan


def _plan_at(cfg: KernelConfig, group: int, block_k: int, slots: int):
  policy = cfg.policy
  split = _blocks_per_split(cfg, block_k) is not None
  parts, part_width = value_parts(cfg.value_dim)
  return MosaicPlan(
    kv_len=cfg.kv_len,
    q_len_padded=round_up(cfg.q_len, ROWS * _consumers(cfg)),
    kv_len_padded=round_up(cfg.kv_len, block_k),
    head_dim=round_up(cfg.head_dim, HEAD_DIM_MULTIPLE),
    value_dim=part_width,
    value_parts=parts,
    ring_slots=slots,
    group=group,
    block_k=block_k,
    scale=cfg.mask.scale,
    exp2=policy.exp2,
    # Split-KV's merge keeps neither residual (the backward refuses it).
    o_lo=policy.delta_source == "hi_lo" and not split,
    max_sum=policy.softmax_residuals == "max_sum" and not split,
    ds_hi_lo=policy.ds_for_dq == "hi_lo",
    operand_dtype=np.dtype(policy.dtype("matmul_operands")),
    output_dtype=np.dtype(policy.dtype("output")),
    causal=cfg.mask.causal,
    key_offset=cfg.mask.key_offset,
    token_ids=cfg.mask.token_ids,
    interpret=bool(cfg.interpret),
    policy=policy,
    window=cfg.mask.window,
    softcap=cfg.mask.softcap,
    sink=cfg.mask.sink,
    key_positions=cfg.mask.key_positions,
    additive=_additive_broadcast(cfg.mask),
    bias_grad=cfg.mask.bias is not None,
    sink_sums=cfg.mask.sink and policy.sink_delta == "probs",
    tie_beta=cfg.options.tie_beta,
    blocks_per_split=_blocks_per_split(cfg, block_k),
    partials_dtype=np.dtype(policy.dtype("partials")),
    switches=hopper_switches(cfg.options.hopper_form),
    scaled=policy.quantizes,
    v_per_channel=v_per_channel(policy),
    p_scale=policy.p_scale,
    # Lengths, segments and per-example positions skip blocks by range.
    block_ranges=bool(cfg.mask.token_ids or cfg.mask.key_positions),
  )


def _consumers(cfg: KernelConfig) -> int:
  return 2 if "two_consumers" in hopper_switches(cfg.options.hopper_form) else 1


def _additive_broadcast(spec) -> tuple[bool, bool] | None:
  """(per example, per head) of the bias and dense mask together."""
  shapes = [s for s in (spec.bias, spec.dense_mask) if s is not None]
  if not shapes:
    return None
  return tuple(any(s[axis] for s in shapes) for axis in (0, 1))


def tiled_config(cfg: KernelConfig, plan: MosaicPlan) -> KernelConfig:
  """`cfg` at this path's tiles: its padded lengths are the plan's, so
  the Triton path's padding of the feature operands and its delta kernel
  serve this path too."""
  options = dataclasses.replace(
    cfg.options,
    block_q=plan.block_rows,
    block_k=plan.block_k,
    bwd_block_q=plan.block_rows,
    bwd_block_k=plan.block_k,
  )
  return dataclasses.replace(cfg, options=options)


def additive_tile(ops: MaskOperands, cfg: KernelConfig, plan: MosaicPlan):
  """The bias plus -inf where the dense mask blocks, FP32, at the padded
  lengths (padded pairs are masked by index), or None without either."""
  if plan.additive is None:
    return None
  blocks = None if ops.mask is None else ops.mask == 0
  added = 0.0 if ops.bias is None else ops.bias
  if blocks is not None:
    added = jnp.where(blocks, -jnp.inf, added)
  # FP32 whatever the operands' types: a Python float alone would be
  # FP64 under jax's 64-bit mode, which the kernels' FP32 tile cannot
  # take (a TMA copy moves bytes of one type).
  added = jnp.asarray(added, jnp.float32)
  pad = [(0, 0), (0, 0), (0, plan.q_len_padded - cfg.q_len)]
  return jnp.pad(added, [*pad, (0, plan.kv_len_padded - cfg.kv_len)])


def range_rows(
  ops_p: MaskOperands, cfg: KernelConfig, plan: MosaicPlan, batch, block_k=None
):
  """(key blocks of each 64-row query block, for the forward and dQ;
  query blocks of each 64-key block, for dK dV), the Triton path's
  `tile_ranges` at this path's tiles (key blocks of `block_k` keys, the
  plan's by default), each [batch, blocks, RANGE_WIDTH] int32 (first,
  end, then zeros)."""
  tiled = tiled_config(cfg, plan)
  block_k = block_k or plan.block_k
  key_blocks, query_blocks = tile_ranges(ops_p, tiled, ROWS, block_k)
  if block_k != ROWS:  # dK dV's key blocks are ROWS keys
    query_blocks = tile_ranges(ops_p, tiled, ROWS, ROWS)[1]

  def rows(r):
    r = jnp.broadcast_to(r, (batch, *r.shape[1:]))
    return jnp.pad(r, ((0, 0), (0, 0), (0, RANGE_WIDTH - 2)))

  return rows(key_blocks), rows(query_blocks)


def quantized(q_p, k_p, v_p, scales, cfg: KernelConfig, plan: MosaicPlan):
  """(q, k, v in FP8, {q_scale, k_scale, v_scale}) from padded q, k, v
  and their scales (`quantization.prepare`): x as its matmul reads it,
  round(x * (1 / s)), computed as the Triton path's kernel computes it
  (`block_math.block_scores`, `probs_times_values`). Per-channel V
  scales are laid out as V's value parts ([B, Hkv * parts, Dv / parts]).

  With `scaling="block"` V's scale is one per `cfg.block_k` keys, and so
  one per key block here: that block is the options' (a multiple of this
  path's, 64 or 128, `tile_refusals`), or clamped to a power of two
  covering every key (`tiling`)."""
  ar = PolicyArithmetic(cfg.policy)
  s = pad_scales(scales, tiled_config(cfg, plan), plan.padded_value_dim)

  def rows(x):  # [B, heads, T] -> [B, T, heads, 1]
    return x.transpose(0, 2, 1)[..., None]

  v_scale = s.v[:, None] if plan.v_per_channel else rows(s.v)
  operands = [
    ar.round(x * (1.0 / scale), "matmul_operands").astype(plan.operand_dtype)
    for x, scale in ((q_p, rows(s.q)), (k_p, rows(s.k)), (v_p, v_scale))
  ]
  v_scales = s.v
  if plan.v_per_channel:
    batch, heads = s.v.shape[:2]
    v_scales = s.v.reshape(batch, heads * plan.value_parts, plan.value_dim)
  return (*operands, dict(q_scale=s.q, k_scale=s.k, v_scale=v_scales))


def padded(
  q, k, v, ops: MaskOperands, cfg: KernelConfig, plan: MosaicPlan, scales=None
):
  """Padded q, k, v and {name: operand}: the forward's `input_names`,
  and with block ranges also dK dV's "query_ranges"; with FP8 operands
  (`plan.scaled`) q, k and v quantized by their `scales`."""
  tq, tk = plan.q_len_padded, plan.kv_len_padded
  q_p = pad_to(q, tq, plan.head_dim)
  k_p = pad_to(k, tk, plan.head_dim)
  v_p = pad_to(v, tk, plan.padded_value_dim)
  ops_p = pad_operands(ops, tiled_config(cfg, plan))
  scale_operands = {}
  if plan.scaled:
    q_p, k_p, v_p, scale_operands = quantized(q_p, k_p, v_p, scales, cfg, plan)
  features = dict(
    **scale_operands,
    q_ids=ops_p.q_ids,
    kv_ids=ops_p.kv_ids,
    kv_pos=ops_p.kv_pos,
    additive=additive_tile(ops, cfg, plan),
    sink=None if ops_p.sink is None else ops_p.sink.astype(jnp.float32),
  )
  names = input_names(plan)
  if plan.block_ranges:
    features["ranges"], features["query_ranges"] = range_rows(
      ops_p, cfg, plan, q.shape[0]
    )
    names += ("query_ranges",)
  return q_p, k_p, v_p, {n: features[n] for n in names}
