"""Per-block arithmetic shared by the forward and backward Pallas kernels.

Every function takes 2-D tiles already loaded from refs and applies the
precision policy at each rounding stage. Names carry shapes: `BqxD` is a
tile of `block_q` rows and `D` columns, `BqxBk` a tile of scores.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from stableattn.precision import Precision

# Contract the last dimension of both operands: A @ B^T.
NT_DIMS = (((1,), (1,)), ((), ()))
# Plain A @ B.
NN_DIMS = (((1,), (0,)), ((), ()))
# Contract the first dimension of both operands: A^T @ B.
TN_DIMS = (((0,), (0,)), ((), ()))


def policy_dot(a, b, dims, policy: Precision):
  """A block matmul: operands in `matmul_operands`, sums in `matmul_accum`.

  The result is returned in `matmul_accum`. FP32 operands are multiplied at
  `Precision.HIGHEST`, because the GPU lowering would otherwise use TF32.
  """
  operand_dtype = policy.dtype("matmul_operands")
  accum_dtype = policy.dtype("matmul_accum")
  a = a.astype(operand_dtype)
  b = b.astype(operand_dtype)
  # A dot cannot return a narrower type than its operands on every backend:
  # compute in the wider of the two, then round to the accumulator format.
  wide = jnp.promote_types(operand_dtype, accum_dtype)
  precision = (
    lax.Precision.HIGHEST
    if operand_dtype.itemsize >= 4
    else lax.Precision.DEFAULT
  )
  out = lax.dot_general(
    a, b, dims, precision=precision, preferred_element_type=wide
  )
  return out.astype(accum_dtype)


def key_mask(
  q_start, k_start, block_q: int, block_k: int, *, kv_len: int, causal: bool
):
  """Boolean [block_q, block_k] mask of (query, key) pairs that attend."""
  q_idx = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  k_idx = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  mask = k_idx < kv_len
  if causal:
    mask = jnp.logical_and(mask, k_idx <= q_idx)
  return mask


def block_scores(q_BqxD, k_BkxD, *, policy: Precision, scale: float, mask):
  """S = Q K^T * scale rounded to `scores`; masked pairs are -inf.

  Args:
    mask: boolean [block_q, block_k] or None when every pair attends.
  """
  s = policy_dot(q_BqxD, k_BkxD, NT_DIMS, policy)
  s = (s * jnp.asarray(scale, s.dtype)).astype(policy.dtype("scores"))
  if mask is not None:
    s = jnp.where(mask, s, jnp.asarray(-jnp.inf, s.dtype))
  return s


def row_sum(x_BqxBk, policy: Precision):
  """Row sum within one block, accumulated like a dot product."""
  accum_dtype = policy.dtype("matmul_accum")
  total = jnp.sum(x_BqxBk.astype(accum_dtype), axis=-1)
  return total.astype(policy.dtype("softmax_stats"))
