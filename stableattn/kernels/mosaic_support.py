"""What the Mosaic GPU kernels share: the plan of one call, shared-memory
tiles, masks built in registers, and the interpret-mode hooks."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import mlir
from jax._src.pallas.mosaic_gpu.core import layout_cast_p
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental.pallas import mosaic_gpu as plgpu

from stableattn.numerics.precision import Precision
from stableattn.numerics.rounding import PolicyArithmetic

# One warpgroup's wgmma tile: 64 rows (of queries, or of keys in dK dV).
ROWS = 64
# Head dims are padded to a multiple of this: a 128-byte swizzle of
# 16-bit elements, the widest TMA and wgmma take.
HEAD_DIM_MULTIPLE = 64
SWIZZLE_BYTES = 128


def interpretable_layout_hints() -> None:
  """Makes `plgpu.layout_cast` the identity outside Mosaic GPU lowering.

  A layout is how a compiled kernel spreads an array over a warpgroup's
  registers; the values are the array's either way. jax 0.10's GPU
  interpreter evaluates each equation with XLA:CPU, which has no rule for
  the hint; the kernels need it compiled (a loop's carry must start in
  the layout wgmma gives it).
  """
  if _has_cpu_rule():  # a jax that interprets the hint itself
    return
  layout_cast_p.def_impl(lambda x, **_: x)
  mlir.register_lowering(layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")


def _has_cpu_rule() -> bool:
  rules = getattr(mlir, "_platform_specific_lowerings", {})
  return layout_cast_p in rules.get("cpu", {})


interpretable_layout_hints()


@dataclasses.dataclass(frozen=True)
class MosaicPlan:
  """Everything static about one Mosaic GPU call (padded sizes)."""

  kv_len: int  # the true length
  q_len_padded: int
  kv_len_padded: int
  head_dim: int  # padded to HEAD_DIM_MULTIPLE
  value_dim: int
  group: int  # query heads per key/value head
  block_k: int
  scale: float  # the score scale, natural base
  exp2: bool  # the forward's softmax in base 2 (log2(e) in the scale)
  o_lo: bool  # the forward also writes O - round(O) (delta_source=hi_lo)
  max_sum: bool  # m and l kept apart (softmax_residuals=max_sum)
  ds_hi_lo: bool  # dQ takes dS as dS_hi + dS_lo (ds_for_dq=hi_lo)
  operand_dtype: object
  output_dtype: object
  causal: bool
  key_offset: int  # key j's position is j - key_offset
  token_ids: bool
  interpret: bool
  # The precision policy whose stages the kernels round to
  # (`mosaic_block_math`).
  policy: Precision
  # The forward's value head dim in this many column parts of
  # `value_dim` each, one thread block per part (wgmma's N is at most
  # 256, and one warpgroup's registers hold a 64 x 256 FP32 accumulator):
  # each part recomputes S, as FlashMLA's two warpgroups share it.
  value_parts: int = 1
  # Slots of the forward's K/V ring: 2 (the next block's copy overlaps
  # this block's arithmetic), or 1 where two do not fit in shared memory.
  ring_slots: int = 2
  # (left, right) of a local window (a side None is unbounded), or None.
  window: tuple[int | None, int | None] | None = None
  softcap: float | None = None  # S = softcap * tanh(Q K^T scale / softcap)
  sink: bool = False  # a per-head logit with value 0 (rows [H, T] in)
  # kv_pos [B, S] in: each key's position (bottom-right with lengths);
  # the offset differs per example, so no block is skipped by position.
  key_positions: bool = False
  # An FP32 tile added to the natural-log scores (a bias, and -inf where
  # a dense mask blocks), [B|1, H|1, T, S]: (per example, per head).
  additive: tuple[bool, bool] | None = None
  bias_grad: bool = False  # the dQ kernel also writes d(bias) = dS
  # The dQ kernel also sums rowsum(P dP) and rowsum(P) of the unrounded P
  # for d(sink) (sink_delta=probs: the softmax's own, not O's).
  sink_sums: bool = False
  # Qiu & Yao's beta: a tile's maximum moved off its ties (None: not).
  tie_beta: float | None = None
  # Split-KV: key blocks per split (None: one pass over every key), and
  # the format each split's output is stored in before the merge.
  blocks_per_split: int | None = None
  partials_dtype: object = None
  # Block ranges in (`masking.block_ranges`, RANGE_WIDTH int32 per row):
  # which key blocks a query block visits (forward, dQ) and which query
  # blocks a key block's (dK dV), from lengths, segments and per-example
  # positions, which the static bounds cannot see.
  block_ranges: bool = False
  # FlashAttention-3's form of the forward, switch by switch
  # (`options.HOPPER_SWITCHES`); () is the interpreter's.
  switches: tuple[str, ...] = ()
  # FP8 operands with row scales (`quantization.py`): Q, K and V enter
  # in e4m3 with their scales beside them (q_scale [B, H, T], k_scale
  # [B, Hkv, S], v_scale per key or, with `v_per_channel`, per value
  # column [B, Hkv, Dv]); P enters P V as e4m3 of P * p_scale.
  scaled: bool = False
  v_per_channel: bool = False
  p_scale: float = 1.0

  @property
  def consumers(self) -> int:
    """Compute warpgroups per thread block, each on its own 64 query rows
    over the same K/V ring: 2 with the `two_consumers` switch
    (FlashAttention-3's ping-pong), else 1."""
    return 2 if "two_consumers" in self.switches else 1

  @property
  def warp_specialized(self) -> bool:
    """A copy warpgroup fills the K/V ring while the compute warpgroups
    compute (FlashAttention-3's producer and consumers)."""
    return "warp_specialized" in self.switches or self.consumers > 1

  @property
  def block_rows(self) -> int:
    """Query rows per thread block."""
    return ROWS * self.consumers

  @property
  def k_as_stored(self) -> bool:
    """K enters as stored, [B, S, Hkv, D], and wgmma reads it through a
    transposed shared-memory view (else K^T comes from global memory).
    Compiled FP8 operands always do: wgmma reads 8-bit B K-major only."""
    compiled_fp8 = self.scaled and not self.interpret
    return "k_as_stored" in self.switches or compiled_fp8

  @property
  def v_transposed(self) -> bool:
    """V enters as V^T [B, Hkv, Dv, S], read through a transposed view:
    8-bit V K-major for P V, wherever K is read that way."""
    return self.scaled and self.k_as_stored

  @property
  def padded_value_dim(self) -> int:
    """V's head dim as padded: every part's columns."""
    return self.value_dim * self.value_parts

  @property
  def splits(self) -> int:
    if self.blocks_per_split is None:
      return 1
    return -(-(self.kv_len_padded // self.block_k) // self.blocks_per_split)

  @property
  def o_dtype(self):
    """The format the forward's kernel stores O in."""
    if self.blocks_per_split is None:
      return self.output_dtype
    return self.partials_dtype

  def additive_index(self, batch, head):
    """The (example, head) of the additive operand for a thread block."""
    per_example, per_head = self.additive
    zero = jnp.int32(0)
    return (batch if per_example else zero, head if per_head else zero)

  @property
  def limits_positions_per_example(self) -> bool:
    """Causal or a window over per-example positions: every key block is
    visited, masked."""
    return self.key_positions and (self.causal or self.window is not None)

  @property
  def arithmetic(self) -> PolicyArithmetic:
    """The policy's roundings: a cast round trip in a compiled kernel,
    XLA's rounding in interpret mode (`rounding.round_to`)."""
    return PolicyArithmetic(self.policy, casts_round=not self.interpret)

  @property
  def interpret_params(self):
    if not self.interpret:
      return False
    # Every interpreted run is raced, and reads uninitialized shared
    # memory as NaN.
    return InterpretGPUParams(detect_races=True, uninitialized_memory="nan")


# The most shared memory one thread block may take on an H100 or H200
# (227 KB, opted in; CUDA C Programming Guide, compute capability 9.0):
# what Mosaic GPU's lowering checks a kernel against without a GPU.
SHARED_MEMORY_BYTES = 232_448
# Mosaic GPU aligns every shared-memory buffer to this many bytes, and
# reserves a scratch for cross-warp reductions (jax 0.10-0.11:
# `SMEM_ALIGNMENT`, `CompilerParams.reduction_scratch_bytes`); a barrier
# takes 8 bytes.
BUFFER_ALIGNMENT = 1024
REDUCTION_SCRATCH_BYTES = 2048
BARRIER_BYTES = 8


def buffer_bytes(shape, dtype) -> int:
  """A shared-memory buffer's bytes as Mosaic GPU allocates them."""
  size = math.prod(shape) * np.dtype(dtype).itemsize
  return -(-size // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT


def swizzle_bytes(dtype) -> int:
  """A tile row's swizzle: 64 elements of 8 or 16 bits (a head dim's
  multiple, so an FP8 tile 64 wide and the tiles it meets in one wgmma
  share a swizzle), 128 bytes at most."""
  return min(SWIZZLE_BYTES, HEAD_DIM_MULTIPLE * np.dtype(dtype).itemsize)


def smem_tile(shape, dtype):
  """A shared-memory buffer laid out for TMA and wgmma: 8-row tiles of
  one swizzle row (`swizzle_bytes`), swizzled."""
  swizzle = swizzle_bytes(dtype)
  transforms = (
    plgpu.TilingTransform((8, swizzle // np.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def allocated(entry):
  """The buffer of a scratch entry (kind, shape, dtype): "tile" (swizzled
  for TMA and wgmma, `smem_tile`) or "vector"."""
  kind, shape, dtype = entry
  if kind == "tile":
    return smem_tile(shape, dtype)
  return plgpu.SMEM(shape, dtype)


def as_rows(vector, shape):
  """A per-row vector broadcast across columns (in the wgmma layout)."""
  return lax.broadcast_in_dim(vector, shape, [0])


def as_columns(vector, shape):
  """A per-column vector broadcast across rows."""
  return lax.broadcast_in_dim(vector, shape, [1])


def _vector(smem, layout, interpret: bool):
  if interpret:
    return smem[...]
  return plgpu.load(smem, (), layout=layout)


def tile_values(smem, interpret: bool):
  """A (rows x columns) FP32 tile from shared memory in the wgmma layout."""
  if interpret:
    return smem[...]
  return plgpu.load(smem, (), layout=plgpu.Layout.WGMMA)


def row_vector(smem, interpret: bool):
  """A vector of one entry per row of a wgmma tile, from shared memory."""
  return _vector(smem, plgpu.Layout.WGMMA.reduce(1), interpret)


def column_vector(smem, interpret: bool):
  """A vector of one entry per column of a wgmma tile."""
  return _vector(smem, plgpu.Layout.WGMMA.reduce(0), interpret)


def block_mask(
  plan: MosaicPlan,
  q_start,
  k_start,
  q_ids,
  kv_ids,
  rows=ROWS,
  cols=None,
  transposed=False,
  kv_pos=None,
):
  """Which pairs of a (query rows x key columns) tile attend, as a
  boolean array in registers (never in shared memory): keys past the
  true length, causal and token ids (lengths and segments). With
  `transposed` the tile is keys x queries (dK dV). `kv_pos`: the keys'
  positions (a vector), where `plan.key_positions`."""
  cols = plan.block_k if cols is None else cols
  shape = (rows, cols)
  q_axis, k_axis = (1, 0) if transposed else (0, 1)

  def iota(axis):
    return plgpu.broadcasted_iota(
      jnp.int32, shape, axis, layout=plgpu.Layout.WGMMA
    )

  q_index = iota(q_axis) + q_start
  k_index = iota(k_axis) + k_start
  allowed = k_index < plan.kv_len
  place_q, place_k = (
    (as_columns, as_rows) if transposed else (as_rows, as_columns)
  )
  if kv_pos is None:
    k_pos = k_index - plan.key_offset
  else:
    k_pos = place_k(kv_pos, shape)
  if plan.causal:
    allowed = allowed & (k_pos <= q_index)
  left, right = plan.window or (None, None)
  if left is not None:
    allowed = allowed & (k_pos >= q_index - left)
  if right is not None:
    allowed = allowed & (k_pos <= q_index + right)
  if q_ids is not None:
    allowed = allowed & (place_q(q_ids, shape) == place_k(kv_ids, shape))
  return allowed


# A block range's row: (first, end) padded to the 128 bytes one
# warpgroup's TMA copy moves at least.
RANGE_WIDTH = 32


def range_scratch():
  return plgpu.SMEM((RANGE_WIDTH,), jnp.int32)


def within_range(bounds, ranges_ref, index, smem, barrier):
  """`bounds` ((first, end) or (first, full, end)) narrowed to the block
  range at `index` of `ranges_ref` (global memory), read by TMA into
  `smem`; every block outside it has no attending pair."""
  plgpu.copy_gmem_to_smem(ranges_ref.at[index], smem, barrier)
  plgpu.barrier_wait(barrier)
  lo, hi = smem[0], smem[1]
  first = jnp.maximum(bounds[0], lo)
  end = jnp.maximum(jnp.minimum(bounds[-1], hi), first)
  if len(bounds) == 2:
    return first, end
  return first, jnp.clip(bounds[1], first, end), end


def stats_names(plan: MosaicPlan) -> tuple[str, ...]:
  """The row vectors the backward recomputes P from."""
  return ("m", "l") if plan.max_sum else ("lse",)


def _nonnegative_div(x, d: int):
  return lax.div(jnp.maximum(x, 0), jnp.int32(d))


def _right_reach(plan: MosaicPlan):
  """How far past its query's position a key may sit (0 when causal, the
  window's right side, the smaller of the two), or None if unbounded."""
  right = (plan.window or (None, None))[1]
  reach = [r for r in (0 if plan.causal else None, right) if r is not None]
  return min(reach) if reach else None


def _last_key(plan: MosaicPlan, q_start):
  """The last key index the block's queries may reach, or None."""
  reach = _right_reach(plan)
  if reach is None:
    return None
  return q_start + (ROWS - 1) + plan.key_offset + reach


def causal_block_bounds(plan: MosaicPlan, q_start):
  """(first, full, end): a query block visits key blocks [first, end);
  blocks in [first, full) need no mask (every pair attends). A window
  masks every block it visits."""
  blocks = plan.kv_len_padded // plan.block_k
  end = jnp.int32(blocks)
  full = jnp.int32(0 if plan.token_ids else plan.kv_len // plan.block_k)
  if plan.limits_positions_per_example:
    return jnp.int32(0), jnp.int32(0), end
  last = _last_key(plan, q_start)
  if last is not None:
    end = jnp.where(
      last < 0, 0, jnp.minimum(end, _nonnegative_div(last, plan.block_k) + 1)
    )
  if plan.causal:
    diagonal = _nonnegative_div(q_start + plan.key_offset + 1, plan.block_k)
    full = jnp.minimum(full, diagonal)
  first = jnp.int32(0)
  left = (plan.window or (None, None))[0]
  if left is not None:
    first = jnp.minimum(
      _nonnegative_div(q_start - left + plan.key_offset, plan.block_k), end
    )
  if plan.window is not None:
    full = first
  full = jnp.clip(full, first, end)
  return first, full, end


def query_block_bounds(plan: MosaicPlan, k_start, block_k: int, q_blocks: int):
  """(first, end): the query blocks of `ROWS` rows a key block of
  `block_k` keys can be attended from (causality and the window)."""
  first, end = jnp.int32(0), jnp.int32(q_blocks)
  if plan.limits_positions_per_example:
    return first, end
  left = (plan.window or (None, None))[0]
  reach = _right_reach(plan)
  if reach is not None:  # query i >= k_pos - reach
    first = _nonnegative_div(k_start - plan.key_offset - reach, ROWS)
  if left is not None:  # query i <= k_pos + left, k_pos of the block's last
    last = k_start + (block_k - 1) - plan.key_offset + left
    end = jnp.where(
      last < 0, 0, jnp.minimum(end, _nonnegative_div(last, ROWS) + 1)
    )
  return jnp.minimum(first, end), end
