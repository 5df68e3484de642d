"""Per-block arithmetic shared by the forward and backward Pallas kernels.

Every function takes 2-D tiles already loaded from refs and a
`PolicyArithmetic`, which rounds each result to its stage (see
`rounding.py`). Values come back in the carrier format. Names carry shapes:
`BqxD` is a tile of `block_q` rows and `D` columns, `BqxBk` a tile of
scores.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from stableattn.rounding import PolicyArithmetic

# Contract the last dimension of both operands: A @ B^T.
NT_DIMS = (((1,), (1,)), ((), ()))
# Plain A @ B.
NN_DIMS = (((1,), (0,)), ((), ()))
# Contract the first dimension of both operands: A^T @ B.
TN_DIMS = (((0,), (0,)), ((), ()))


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


def scaled_dot(a, b, dims, ar: PolicyArithmetic, scale: float, stage: str):
  """(A B) * scale: the product rounded to `matmul_accum`, then to `stage`."""
  product = ar.dot(a, b, dims)
  return ar.round(product * jnp.asarray(scale, product.dtype), stage)


def block_scores(q_BqxD, k_BkxD, *, ar: PolicyArithmetic, scale: float, mask):
  """S = Q K^T * scale in `scores`, then held in `softmax_stats`.

  Masked pairs are -inf.

  Args:
    mask: boolean [block_q, block_k] or None when every pair attends.
  """
  s = scaled_dot(q_BqxD, k_BkxD, NT_DIMS, ar, scale, "scores")
  s = ar.round(s, "softmax_stats")
  if mask is not None:
    s = jnp.where(mask, s, jnp.asarray(-jnp.inf, s.dtype))
  return s


def stats_exp(x, ar: PolicyArithmetic):
  """exp(x) rounded to `softmax_stats` (x already in that format)."""
  return ar.round(jnp.exp(x), "softmax_stats")


def row_sum(x_BqxBk, ar: PolicyArithmetic):
  """Row sum within one block, accumulated like a dot product."""
  return ar.round(ar.sum(x_BqxBk, "matmul_accum"), "softmax_stats")
