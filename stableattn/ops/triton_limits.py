"""What the compiled Triton path cannot take on a GPU: FP64 stages, and
tiles past a Triton program's shared memory (the Hopper path counts its
own, `mosaic_forward_block.shared_bytes`)."""

from __future__ import annotations

from stableattn.kernels.flash_attention import padded_head_dim
from stableattn.numerics.precision import Precision


def gpu_unsupported_reason(policy: Precision) -> str | None:
  """Why the compiled GPU (Triton) kernel cannot run `policy`, or None.

  Half-precision arithmetic compiles: each op runs in FP32 and its result
  is rounded by a cast, which is a real rounding in a Triton kernel.
  """
  if policy.uses_fp64:
    return (
      f"Precision {policy.name!r} has FP64 stages, which the GPU (Triton) "
      "kernel does not support; use interpret=True for FP64."
    )
  return None


# Largest shared memory one Triton program may use on an H100/H200 (227 KiB).
GPU_SHARED_MEMORY_BYTES = 232448


def shared_memory_reason(policy: Precision, head_dim: int, tiles) -> str | None:
  """Why these tiles cannot fit in a GPU's shared memory, or None.

  The backward kernels hold about four tiles of the largest block size
  (rows of Q, dO, K, V at the padded head dim) in matmul-operand format.
  On an H100 this estimate matched Triton's request exactly where it
  failed (FP32 operands, head dim 128, a 128-row tile: 262144 bytes) and
  stayed below the limit for every configuration that compiled.
  """
  operand_bytes = policy.dtype("matmul_operands").itemsize
  head_dim_padded = padded_head_dim(head_dim, interpret=False)
  need = 4 * max(tiles) * head_dim_padded * operand_bytes
  if need <= GPU_SHARED_MEMORY_BYTES:
    return None
  return (
    f"Tiles {tuple(tiles)} at head dim {head_dim} with "
    f"{policy.matmul_operands} matmul operands need about {need} bytes of "
    f"GPU shared memory; a Triton program gets at most "
    f"{GPU_SHARED_MEMORY_BYTES} on an H100/H200. Use tiles of at most "
    f"{_largest_fitting_tile(head_dim_padded, operand_bytes)} (block_q, "
    "block_k, bwd_block_q, bwd_block_k), or interpret=True."
  )


def _largest_fitting_tile(head_dim_padded: int, operand_bytes: int) -> int:
  tile = 16
  while 4 * 2 * tile * head_dim_padded * operand_bytes <= (
    GPU_SHARED_MEMORY_BYTES
  ):
    tile *= 2
  return tile
