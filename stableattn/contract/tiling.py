"""Tile sizes: the paper's SRAM formula, GPU constraints, padding."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

# Triton's tl.dot needs every matmul dimension to be at least 16.
MIN_GPU_BLOCK = 16


def check_flag(name: str, value) -> bool:
  """A boolean argument: True/False (NumPy's too), never a string or int."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise ValueError(
    f"{name} must be True or False, got {type(value).__name__} {value!r}."
  )


def resolve_interpret(interpret: bool | None) -> bool:
  """`interpret=None` means: interpret mode iff the default backend is CPU."""
  if interpret is None:
    return jax.default_backend() == "cpu"
  return check_flag("interpret", interpret)


def is_power_of_two(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def check_block_size(
  name: str, value, *, for_gpu: bool, length: int | None = None
) -> int:
  """Validates one tile size; GPU (Triton) tiles must be powers of two >= 16.

  A tile larger than the sequence (`length`) is clamped to the smallest
  power of two (at least 16) that covers it, as jax's Pallas `mha` clamps:
  the result is the same, and no oversized block is allocated.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (int, np.integer)
  ):
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  value = int(value)
  if value <= 0:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  if length is not None:
    value = min(value, max(MIN_GPU_BLOCK, next_power_of_two(length)))
  if for_gpu and (not is_power_of_two(value) or value < MIN_GPU_BLOCK):
    raise ValueError(
      f"{name}={value} cannot be compiled for a GPU: the Triton lowering "
      f"needs tile sizes that are powers of two and at least {MIN_GPU_BLOCK} "
      "(e.g. 16, 32, 64, 128). Any positive size works in interpret mode "
      "(interpret=True)."
    )
  return value


@dataclasses.dataclass(frozen=True)
class SramTiles:
  """Tile sizes derived from an on-chip memory budget (FlashAttention-1)."""

  block_q: int  # B_r
  block_k: int  # B_c
  sram_elements: int
  head_dim: int


def tiles_from_sram(sram_elements: int, head_dim: int) -> SramTiles:
  """FlashAttention-1's tile sizes for an SRAM of `sram_elements` values.

  Follows Dao et al. (2022), Algorithm 1, as used by Golden et al. (2024):
  `B_c = ceil(M / 4d)` and `B_r = min(ceil(M / 4d), d)`.

  Args:
    sram_elements: on-chip memory budget M, counted in elements.
    head_dim: head dimension d.

  Returns:
    The tile sizes as `SramTiles(block_q=B_r, block_k=B_c, ...)`.

  Raises:
    ValueError: if either argument is not a positive integer.
  """
  for name, value in (("sram_elements", sram_elements), ("head_dim", head_dim)):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  block_k = math.ceil(sram_elements / (4 * head_dim))
  block_q = min(block_k, head_dim)
  return SramTiles(block_q, block_k, sram_elements, head_dim)


# FP32 values one thread of a 4-warp Triton program holds in registers for
# the forward's tiles (Q and O: block_q x d, K and V: block_k x d, S:
# block_q x block_k) without spilling, with the rest of its registers (255
# at most) left for addresses and the softmax. 64x64 tiles at head dim 128
# (288 per thread) spilled on an H100: 2.95 s at 8K keys against 8.6 ms in
# BF16, 2.58 G local loads at 2K (results/gpu/h100-2026-11-26).
FP32_REGISTER_BUDGET = 160
FP32_WARPS = 4
_FP32_CANDIDATES = ((64, 64), (64, 32), (32, 64), (32, 32), (16, 32), (16, 16))


def fp32_gpu_tiles(head_dim: int) -> dict:
  """Tiles and warps for IEEE FP32 operands on a GPU: Triton multiplies
  them on its FMA path (no tensor core; triton-lang/triton #5572), with
  every operand tile in registers. The largest of 64x64 down to 16x16
  whose FP32 values fit `FP32_REGISTER_BUDGET` per thread at 4 warps
  (tokamax keeps its FP32-capable blocks at 16-64 with 4 warps):
  64x64 up to head dim 64, 32x32 at 128, 16x16 at 256.

  Returns {"block_q", "block_k", "num_warps"} for `stableattn.Options`.
  """
  threads = 32 * FP32_WARPS
  padded = next_power_of_two(head_dim)
  for block_q, block_k in _FP32_CANDIDATES:
    values = 2 * block_q * padded + 2 * block_k * padded + block_q * block_k
    if values / threads <= FP32_REGISTER_BUDGET:
      break
  return {"block_q": block_q, "block_k": block_k, "num_warps": FP32_WARPS}
