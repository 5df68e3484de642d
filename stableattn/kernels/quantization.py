"""Operands below 16 bits: scales, the Hadamard rotation, P's scale.

For a policy whose matmul operands are FP8, FP4 or INT8 (`Precision.
quantizes`), Q, K and V are prepared once before any implementation runs:

0. `smooth_k`: K minus its mean over tokens, per (batch, head, channel)
   (SageAttention): a constant per score row, which softmax removes.
1. `hadamard`: Q and K are multiplied by one random orthogonal matrix
   R = diag(random signs) H / sqrt(d) (H the Sylvester Hadamard matrix)
   along the head dimension, in FP32. QK^T is unchanged in exact
   arithmetic; an outlier feature is spread over every dimension
   (FlashAttention-3's incoherent processing).
2. Scales s = amax * (1 / largest finite value of the format) over each
   scaling group ("none": 1; "tensor": the whole array; "block": the
   rows of one kernel tile of one (batch, head); "token": each row of Q
   and K, each channel (column) of V in one (batch, head)); an all-zero
   group gets 1.

Inside the kernels (and the reference) an operand x enters its matmul as
round(x * (1 / s)) and the product is multiplied by the scales afterwards,
in FP32: S = (Q/s_q)(K/s_k)^T * s_q s_k. P enters P V as
round(P * p_scale) and the product is multiplied by s_v * (1 / p_scale)
(per output column when V's scales are per channel).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from stableattn.numerics.precision import Precision
from stableattn.numerics.quant_options import (
  DEFAULT_OPTIONS,
  MICRO_GROUPS,
  WIDE_FORMATS,
)
from stableattn.numerics.rounding import (
  LOW_FORMATS,
  PolicyArithmetic,
  micro_round,
  round_to,
)

# The rotation's random signs come from this seed (one matrix per head dim).
HADAMARD_SEED = 0


class QuantScales(NamedTuple):
  """Scales (FP32): q [B, H, T] and k [B, Hkv, S] per row; v [B, Hkv, S]
  per row, or [B, Hkv, D] per channel (`v_per_channel`)."""

  q: object
  k: object
  v: object


def hadamard_matrix(head_dim: int) -> tuple[np.ndarray, np.float32]:
  """(diag(signs) H, 1 / sqrt(d)): R is their product, orthogonal; float32.

  Raises ValueError unless head_dim is a power of two.
  """
  if head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError(
      f"hadamard=on needs a head dim that is a power of two (Sylvester's "
      f"construction), got {head_dim}; use hadamard=off."
    )
  h = np.ones((1, 1))
  while h.shape[0] < head_dim:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(HADAMARD_SEED).choice([-1.0, 1.0], head_dim)
  return (signs[:, None] * h).astype(np.float32), np.float32(head_dim**-0.5)


def rotate(x, head_dim: int):
  """x [..., d] times R (sums of +-x in FP32, then one scaling)."""
  signed_h, norm = hadamard_matrix(head_dim)
  y = jnp.einsum(
    "...d,de->...e",
    x.astype(jnp.float32),
    jnp.asarray(signed_h),
    precision=lax.Precision.HIGHEST,
  )
  return y * norm


def smoothing_mean(k):
  """K's mean over tokens [B, 1, H, D], rounded to BF16: any constant per
  channel leaves softmax unchanged, and a coarse one does not depend on
  the order of the FP32 sum (nor on XLA turning / n into * (1 / n))."""
  total = jnp.sum(k, axis=1, keepdims=True)
  mean = total * jnp.asarray(1.0 / k.shape[1], jnp.float32)
  return mean.astype(jnp.bfloat16).astype(jnp.float32)


def v_per_channel(policy: Precision) -> bool:
  """Whether V's scales are per channel ([B, Hkv, D]) rather than rows."""
  return policy.scaling == "token"


def channel_scales(v, policy: Precision):
  """Scales [B, heads, D] of v [B, S, heads, D]: amax over tokens."""
  largest = LOW_FORMATS[policy.matmul_operands].max_finite
  amax = jnp.max(jnp.abs(v.astype(jnp.float32)), axis=1)  # [B, H, D]
  return _scale(amax, largest)


def microscaled(x, policy: Precision, axis: int):
  """x [B, T, heads, D] quantized by groups along `axis` (1: tokens, 3:
  the head dim) with the policy's microscaling, dequantized in FP32."""
  fmt = policy.matmul_operands
  tensor_scale = None
  if policy.scaling == "nvfp4":
    largest = LOW_FORMATS["fp8_e4m3"].max_finite * LOW_FORMATS[fmt].max_finite
    tensor_scale = _scale(jnp.max(jnp.abs(x.astype(jnp.float32))), largest)
  moved = jnp.moveaxis(x, axis, -1)
  out = micro_round(moved, fmt, policy.scaling, tensor_scale=tensor_scale)
  return jnp.moveaxis(out, -1, axis)


def row_scales(x, policy: Precision, block: int):
  """Scales [B, heads, T] of x [B, T, heads, D] for the policy's scaling
  (1 for microscaling, which `microscaled` applies)."""
  batch, length, heads, _ = x.shape
  if policy.scaling in ("none", *MICRO_GROUPS):
    return jnp.ones((batch, heads, length), jnp.float32)
  largest = LOW_FORMATS[policy.matmul_operands].max_finite
  magnitude = jnp.abs(x.astype(jnp.float32))
  if policy.scaling == "tensor":
    amax = jnp.max(magnitude)
    scale = _scale(amax, largest)
    return jnp.broadcast_to(scale, (batch, heads, length))
  per_row = jnp.max(magnitude, axis=-1).transpose(0, 2, 1)  # [B, H, T]
  if policy.scaling == "token":
    return _scale(per_row, largest)
  padded = -(-length // block) * block
  per_row = jnp.pad(per_row, ((0, 0), (0, 0), (0, padded - length)))
  amax = per_row.reshape(batch, heads, padded // block, block).max(-1)
  scale = jnp.repeat(_scale(amax, largest), block, axis=-1)
  return scale[..., :length]


def _scale(amax, largest: float):
  scale = amax * jnp.asarray(1.0 / largest, jnp.float32)
  return jnp.where(scale > 0, scale, jnp.ones_like(scale))


def stored_inputs(q, k, v, policy: Precision):
  """(q, k, v) as attention reads them: rounded to `inputs`, and K and V
  through the policy's KV cache (`read_from_cache`)."""
  ar = PolicyArithmetic(policy)
  q, k, v = (ar.round_inputs(x) for x in (q, k, v))
  return (q, *read_from_cache(k, v, policy))


def read_from_cache(k, v, policy: Precision):
  """(k, v) as attention reads them from the policy's KV cache: unchanged,
  or (kv_cache=fp8_e4m3) stored as round(x / s) in e4m3 with s = amax /
  448 over the tensor and dequantized to the `inputs` format. Gradients
  pass straight through (the cache is not trained through)."""
  if policy.kv_cache == "none":
    return k, v

  def round_trip(x):
    wide = x.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(wide)), LOW_FORMATS["fp8_e4m3"].max_finite)
    stored = round_to(wide * (1.0 / scale), "fp8_e4m3")
    read = round_to(stored * scale, policy.inputs).astype(x.dtype)
    return x + lax.stop_gradient(read - x)

  return round_trip(k), round_trip(v)


def prepare(q, k, v, policy: Precision, block_q: int, block_k: int):
  """(q, k, v, QuantScales) for a quantizing policy; q and k rotated if
  `hadamard` (k smoothed first if `smooth_k`). The inputs are already
  rounded to the `inputs` format."""
  if policy.smooth_k:
    k = k.astype(jnp.float32)
    # A constant to autodiff: attention's dK sums to zero over tokens, so
    # the mean's own gradient term is zero in exact arithmetic.
    k = k - lax.stop_gradient(smoothing_mean(k))
  if policy.hadamard:
    q, k = rotate(q, q.shape[-1]), rotate(k, k.shape[-1])
  if policy.scaling in MICRO_GROUPS:
    # Groups run along each matmul's contraction: Q and K along the head
    # dim; V along keys (P is grouped inside the kernel, by `round_probs`).
    # The estimator is straight-through: the gradient passes unchanged.
    q, k, v = (
      # Exactly the quantized values (x - x is 0); the gradient is x's.
      lax.stop_gradient(microscaled(x, policy, axis))
      + (x - lax.stop_gradient(x)).astype(jnp.float32)
      for x, axis in ((q, 3), (k, 3), (v, 1))
    )
  # Scales are constants to autodiff (straight-through, see below).
  scales = QuantScales(
    q=lax.stop_gradient(row_scales(q, policy, block_q)),
    k=lax.stop_gradient(row_scales(k, policy, block_k)),
    v=lax.stop_gradient(
      channel_scales(v, policy)
      if v_per_channel(policy)
      else row_scales(v, policy, block_k)
    ),
  )
  return q, k, v, scales


def straight_through(policy: Precision, padded_qkv, padded_scales):
  """(policy, (q, k, v)) for the kernel backward of a quantizing policy.

  The backward treats each quantization as the identity with constant
  scales (the straight-through estimator, as the reference's autodiff
  does): the gradients are those of attention on the operands the
  forward's matmuls saw, round(x * (1 / s)) * s in FP32, with every stage
  below 16 bits other than `inputs` computed in FP32. FlashAttention-3's
  FP8 kernel has no backward; this models an FP8 forward trained with a
  wide backward, not an FP8 backward (dS and dO are never quantized).

  Args:
    padded_qkv: the kernel's padded q [B, T, H, D], k and v [B, S, Hkv, D]
      (q and k rotated if `hadamard`).
    padded_scales: their row scales (`QuantScales`) at the padded lengths.
  """
  ar = PolicyArithmetic(policy)

  def dequantize(x, s):
    return ar.round(x * (1.0 / s), "matmul_operands") * s

  def rows(scales):
    return scales.transpose(0, 2, 1)[..., None]  # [B, T, heads, 1]

  q, k, v = padded_qkv
  v_scales = padded_scales.v
  # Microscaled operands were prepared as the matmuls see them.
  dequantized = (
    padded_qkv
    if policy.scaling in MICRO_GROUPS
    else (
      dequantize(q, rows(padded_scales.q)),
      dequantize(k, rows(padded_scales.k)),
      dequantize(
        v, v_scales[:, None] if v_per_channel(policy) else rows(v_scales)
      ),
    )
  )
  wide = {
    stage: "fp32"
    for stage, fmt in policy.stages().items()
    if fmt not in WIDE_FORMATS and stage != "inputs"
  }
  backward_policy = dataclasses.replace(
    policy,
    name=f"{policy.name} (straight-through backward)",
    **wide,
    **DEFAULT_OPTIONS,
  )
  return backward_policy, dequantized
