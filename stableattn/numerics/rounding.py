"""Explicit rounding: the precision policy as arithmetic no compiler can skip.

This module is the one definition of what a `Precision` policy computes:

* Every value is held in a *carrier* format: FP32, or FP64 when the policy
  has an FP64 stage. Arrays of a half-precision stage hold only values that
  format can represent.
* Each elementwise operation is computed in the carrier and its result is
  rounded to the format of the stage it belongs to (round to nearest, ties
  to even, subnormals kept, overflow to infinity), as eager frameworks do
  for half-precision tensors.
* A dot product multiplies operands already rounded to `matmul_operands`,
  sums them in the carrier (FP32, as tensor cores and CPU matmuls do) and
  rounds the sum once to `matmul_accum`. A row sum (softmax denominator,
  delta, the GQA sum of gradients) likewise sums in the carrier and rounds
  once.
* Normalizing by the softmax sum l multiplies by its reciprocal 1/l,
  rounded like the statistics, as FlashAttention-2 and framework softmax
  kernels do. (XLA rewrites `x / l[:, None]` into `x * (1 / l)` anyway; a
  written-out reciprocal makes that the documented, not an accidental,
  semantics.)
* A maximum, a comparison, a mask or a cast of an already rounded value
  needs no rounding.

Why explicit: with default flags (`xla_allow_excess_precision=true`) XLA
removes a convert pair such as f32 -> bf16 -> f32 inside a fusion, so a
cast to a half type is *not* a rounding one can count on. Inside an XLA
program (the reference, and the Pallas kernels in interpret mode) each
rounding is therefore `lax.reduce_precision`, which XLA keeps, plus an
exact rounding of the subnormal range that `reduce_precision` flushes to
zero. In a compiled Triton kernel body no XLA pass runs and a cast is a
real rounding instruction, so there a cast round trip is used (Triton has
no `reduce_precision`); both give the same bits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stableattn.numerics.formats import format_name, to_dtype
from stableattn.numerics.precision import Precision
from stableattn.numerics.quant_options import MICRO_GROUPS

# (exponent bits, explicit mantissa bits) of each format.
FORMAT_BITS = {
  "bf16": (8, 7),
  "fp16": (5, 10),
  "fp32": (8, 23),
  "fp64": (11, 52),
  "fp22": (8, 13),
}


@dataclasses.dataclass(frozen=True)
class LowFormat:
  """A format below 16 bits, by its numbers (OCP FP8 and MX specs).

  Rounding: to nearest, ties to even, with `mantissa_bits` fraction bits
  above `min_normal` and a fixed `spacing` below it (subnormals; integers
  for int8); beyond `max_finite` a saturating format clamps to it, the
  others overflow to infinity.
  """

  mantissa_bits: int
  min_normal: float
  spacing: float
  max_finite: float
  saturates: bool


LOW_FORMATS = {
  # e4m3fn as kernels use it: no infinity; our casts saturate at +-448
  # (as FlashAttention-3's and Transformer Engine's do).
  "fp8_e4m3": LowFormat(3, 2.0**-6, 2.0**-9, 448.0, True),
  "fp8_e5m2": LowFormat(2, 2.0**-14, 2.0**-16, 57344.0, False),
  # e2m1 (MX / NVFP4 elements): values 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  "fp4_e2m1": LowFormat(1, 1.0, 0.5, 6.0, True),
  # Symmetric-range integers as quantized operands: round to nearest
  # even integer, saturate at +-127.
  "int8": LowFormat(23, float("inf"), 1.0, 127.0, True),
}


def _round_low(x, fmt: str):
  """x rounded to a format below 16 bits, held in x's dtype."""
  f = LOW_FORMATS[fmt]
  dtype = x.dtype
  normal = lax.reduce_precision(
    x,
    exponent_bits=jnp.finfo(dtype).nexp,
    mantissa_bits=f.mantissa_bits,
  )
  spacing = jnp.asarray(f.spacing, dtype)
  fixed = lax.round(x / spacing, lax.RoundingMethod.TO_NEAREST_EVEN) * spacing
  rounded = jnp.where(jnp.abs(x) < f.min_normal, fixed, normal)
  limit = jnp.asarray(f.max_finite, dtype)
  beyond = jnp.abs(rounded) > limit
  if f.saturates:
    return jnp.where(beyond, jnp.sign(x) * limit, rounded)
  return jnp.where(beyond, jnp.sign(x) * jnp.inf, rounded)


def _round_fp32_bits(x, mantissa_bits: int):
  """FP32 x rounded to nearest even at `mantissa_bits` fraction bits, on
  its bit pattern (a carry into the exponent is the next binade, or inf)."""
  drop = 23 - mantissa_bits
  bits = lax.bitcast_convert_type(x, jnp.int32)
  lowest_kept = (bits >> drop) & 1
  bits = (bits + ((1 << (drop - 1)) - 1) + lowest_kept) & ~((1 << drop) - 1)
  return lax.bitcast_convert_type(bits, jnp.float32)


def truncate_fp32_bits(x, mantissa_bits: int):
  """FP32 x rounded toward zero at `mantissa_bits` fraction bits: the low
  bits of its pattern cleared (a tensor core's truncating accumulator)."""
  drop = 23 - mantissa_bits
  if drop == 0:
    return x
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return lax.bitcast_convert_type(bits & ~((1 << drop) - 1), jnp.float32)


def carrier_dtype(policy: Precision) -> np.dtype:
  """The format every value of `policy` is held and computed in."""
  return jnp.dtype(jnp.float64 if policy.uses_fp64 else jnp.float32)


def _format_of(dtype) -> str:
  return format_name(jnp.dtype(dtype))


def _needs_rounding(value_fmt: str, fmt: str) -> bool:
  if fmt in LOW_FORMATS:
    return value_fmt != fmt
  e_value, m_value = FORMAT_BITS[value_fmt]
  e_fmt, m_fmt = FORMAT_BITS[fmt]
  return e_fmt < e_value or m_fmt < m_value


def _round_subnormals_too(x, fmt: str):
  """Nearest-even rounding of x to `fmt`, in x's dtype, subnormals exact."""
  exponent_bits, mantissa_bits = FORMAT_BITS[fmt]
  rounded = lax.reduce_precision(
    x, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits
  )
  info = jnp.finfo(to_dtype(fmt))
  if jnp.finfo(x.dtype).tiny >= info.tiny:
    # The target's subnormals are the carrier's too: reduce_precision
    # rounds them exactly (bf16 from fp32).
    return rounded
  # reduce_precision flushes the target's subnormals to zero. Below the
  # smallest normal they are multiples of the smallest subnormal, so
  # scaling by a power of two and rounding to an integer is exact.
  spacing = float(info.smallest_subnormal)
  scaled = lax.round(
    x * jnp.asarray(1.0 / spacing, x.dtype), lax.RoundingMethod.TO_NEAREST_EVEN
  ) * jnp.asarray(spacing, x.dtype)
  is_subnormal = jnp.abs(x) < jnp.asarray(info.tiny, x.dtype)
  return jnp.where(is_subnormal, scaled, rounded)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _round_in_xla(x, fmt: str):
  if fmt in LOW_FORMATS:
    return _round_low(x, fmt)
  return _round_subnormals_too(x, fmt)


@_round_in_xla.defjvp
def _round_in_xla_jvp(fmt, primals, tangents):
  # Autodiff rounds a cotangent where the forward rounded its value (the
  # transpose of a cast); reduce_precision is linear, so it transposes.
  # Below 16 bits a cotangent passes straight through (quantization-aware
  # training's estimator): unscaled, it would mostly round to zero.
  (x,), (t,) = primals, tangents
  if fmt in LOW_FORMATS:
    return _round_in_xla(x, fmt), t
  exponent_bits, mantissa_bits = FORMAT_BITS[fmt]
  return _round_in_xla(x, fmt), lax.reduce_precision(
    t, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits
  )


def round_to(x, fmt: str, *, casts_round: bool = False):
  """x rounded to format `fmt`, returned in x's dtype (FP32 if x is half).

  Args:
    x: a floating array.
    fmt: a format name ('bf16', 'fp16', 'fp32', 'fp64').
    casts_round: True inside a compiled Triton kernel body, where a cast
      round trip is a real rounding; False inside an XLA program.
  """
  fmt = format_name(fmt)
  if jnp.dtype(x.dtype).itemsize < 4:
    x = x.astype(jnp.float32)
  if not _needs_rounding(_format_of(x.dtype), fmt):
    return x
  if casts_round and fmt == "fp22" and x.dtype == jnp.float32:
    # No dtype to cast to: round the FP32 bits (what reduce_precision does
    # in XLA, which has no Triton lowering).
    return _round_fp32_bits(x, FORMAT_BITS[fmt][1])
  if casts_round and fmt in LOW_FORMATS:
    # Clamp first: the hardware's saturating conversion (an e4m3fn cast
    # of a value beyond 448 would give NaN); int8 rounds, then converts.
    f = LOW_FORMATS[fmt]
    limit = f.max_finite if f.saturates else float("inf")
    x = jnp.clip(x, -limit, limit)
    if fmt == "int8":
      x = lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
    return x.astype(to_dtype(fmt)).astype(x.dtype)
  if casts_round:
    return x.astype(to_dtype(fmt)).astype(x.dtype)
  return _round_in_xla(x, fmt)


@dataclasses.dataclass(frozen=True)
class PolicyArithmetic:
  """The arithmetic of one policy: carrier-format ops, explicit roundings.

  Attributes:
    policy: the precision policy.
    casts_round: True in a compiled Triton kernel body (see `round_to`).
  """

  policy: Precision
  casts_round: bool = False

  @property
  def carrier(self) -> np.dtype:
    return carrier_dtype(self.policy)

  def lift(self, x):
    """x in the carrier format (exact: every stage fits in the carrier)."""
    return x.astype(self.carrier)

  def round(self, x, stage: str):
    """x (any float dtype) rounded to `stage`'s format, in the carrier.

    A value wider than the carrier (FP64 user input) is rounded from its
    own format, not through the carrier: one rounding, not two.
    """
    fmt = getattr(self.policy, stage)
    return round_to(x, fmt, casts_round=self.casts_round).astype(self.carrier)

  def round_inputs(self, x):
    """x rounded to `inputs` and stored in that dtype, for the user's arrays.

    Its gradient passes through unchanged: the gradients that reach it are
    already in the inputs format, and a fp16 gradient must keep its
    subnormals (the JVP of `round` flushes them, as reduce_precision does).
    """
    x = jnp.asarray(x)
    if x.dtype == self.policy.dtype("inputs"):
      # Already in the format: no rounding, and no copy of q, k, v (on a
      # GPU the copies tripled a forward pass's peak memory).
      return x
    wide = x if jnp.dtype(x.dtype).itemsize >= 4 else x.astype(jnp.float32)
    rounded = lax.stop_gradient(
      round_to(wide, self.policy.inputs, casts_round=self.casts_round)
    )
    # wide + (rounded - wide) is exactly `rounded`; +-inf would give NaN.
    through = wide + lax.stop_gradient(rounded - wide)
    out = jnp.where(jnp.isfinite(wide), through, rounded)
    return out.astype(self.policy.dtype("inputs"))

  def stored(self, x, stage: str):
    """x rounded to `stage` and cast to that stage's dtype (for refs)."""
    return self.round(x, stage).astype(self.policy.dtype(stage))

  @property
  def _matmul_precision(self):
    # FP32 operands at HIGHEST: the GPU lowering would otherwise use TF32.
    wide = self.policy.dtype("matmul_operands").itemsize >= 4
    low = self.policy.matmul_operands in LOW_FORMATS  # held in the carrier
    return lax.Precision.HIGHEST if wide or low else lax.Precision.DEFAULT

  @property
  def microscaled(self) -> bool:
    """Whether operands are microscaled: Q, K and V arrive quantized and
    dequantized (`quantization.prepare`), P is quantized by `round_probs`."""
    return self.policy.scaling in MICRO_GROUPS

  def round_probs(self, p):
    """P (already times p_scale) as it enters P V: rounded to `probs`, or
    microscaled along keys. NVFP4's tensor scale of P is static: P * p_scale
    is at most p_scale."""
    fmt = self.policy.probs
    if not self.microscaled or fmt not in LOW_FORMATS:
      return self.round(p, "probs")
    largest = LOW_FORMATS["fp8_e4m3"].max_finite * LOW_FORMATS[fmt].max_finite
    return micro_round(
      p,
      fmt,
      self.policy.scaling,
      tensor_scale=self.policy.p_scale / largest,
      casts_round=self.casts_round,
    ).astype(self.carrier)

  def _operand(self, x):
    if self.microscaled:
      return self.lift(x)
    if self.policy.matmul_operands in LOW_FORMATS:
      # FP8/FP4/INT8 values are exact in the carrier, whose dot every
      # backend has (the sum is FP32 either way).
      return self.round(x, "matmul_operands")
    return self.stored(x, "matmul_operands")

  def _first_operand(self, a, probs: bool):
    # Below 16 bits P enters P V in its own format, `probs` (e5m2 P with
    # e4m3 V, as FP8 tensor cores allow, or FP16 P): never re-rounded.
    if probs and self.policy.quantizes:
      return self.lift(a)
    return self._operand(a)

  def dot(self, a, b, dims, *, probs: bool = False):
    """A block matmul: operands in `matmul_operands` (a is P, already in
    `probs`, if `probs`); the sum rounded once."""
    out = self._sum_of_products(
      self._first_operand(a, probs), self._operand(b), dims
    )
    return self.round(out, "matmul_accum")

  def blocked_dot(self, a, b, dims):
    """`dot` with the contraction summed k products at a time (policy
    option score_chunk = k): each chunk's sum in the carrier, the chunk sums
    added pairwise, the total rounded once. Chunks are static slices
    (`lax.split`, which Triton lowers for equal power-of-two parts, as a
    padded head dim over a power-of-two chunk gives)."""
    (a_axis,), (b_axis,) = dims[0]
    length, chunk = a.shape[a_axis], self.policy.score_chunk
    if length <= chunk:
      return self.dot(a, b, dims)
    sizes = [min(chunk, length - i) for i in range(0, length, chunk)]
    a_parts = lax.split(self._operand(a), sizes, axis=a_axis)
    b_parts = lax.split(self._operand(b), sizes, axis=b_axis)
    sums = [self._sum_of_products(x, y, dims) for x, y in zip(a_parts, b_parts)]
    while len(sums) > 1:
      pairs = zip(sums[::2], sums[1::2])
      sums = [x + y for x, y in pairs] + sums[len(sums) - len(sums) % 2 :]
    return self.round(sums[0], "matmul_accum")

  def _sum_of_products(self, a, b, dims):
    """a . b of operands already in their formats, summed in the carrier."""
    return lax.dot_general(
      a,
      b,
      dims,
      precision=self._matmul_precision,
      preferred_element_type=self.carrier,
    )

  def round_accumulator(self, x):
    """x rounded to `matmul_accum` as the MMA accumulator adds: to nearest,
    or toward zero (`mma_rounding=truncate`)."""
    if self.policy.mma_rounding == "nearest":
      return self.round(x, "matmul_accum")
    bits = FORMAT_BITS[self.policy.matmul_accum][1]
    return truncate_fp32_bits(x.astype(jnp.float32), bits).astype(self.carrier)

  def mma_dot(self, a, b, dims, *, acc=None, probs: bool = False):
    """`dot` as a tensor core accumulates (policy option mma_chunk = k):
    the contraction (a's axis 1) k products at a time, each chunk's sum
    added into the accumulator `acc` (zero if None) and rounded by
    `round_accumulator`. A chunk is formed by zeroing a's other columns,
    which adds exact zeros: no slicing, which Triton has none of."""
    a = self._first_operand(a, probs)
    b = self._operand(b)
    chunk, length = self.policy.mma_chunk, a.shape[1]
    column = lax.broadcasted_iota(jnp.int32, a.shape, 1)
    zero = jnp.zeros((), a.dtype)
    for start in range(0, length, chunk):
      inside = (column >= start) & (column < start + chunk)
      part = self._sum_of_products(jnp.where(inside, a, zero), b, dims)
      acc = self.round_accumulator(part if acc is None else acc + part)
    return acc

  def einsum(self, spec: str, a, b, *, probs: bool = False):
    """`dot` for an einsum spec (the reference implementation's matmuls)."""
    out = jnp.einsum(
      spec,
      self._first_operand(a, probs),
      self._operand(b),
      precision=self._matmul_precision,
      preferred_element_type=self.carrier,
    )
    return self.round(out, "matmul_accum")

  def sum(self, x, stage: str, *, axis=-1, keepdims: bool = False):
    """A sum accumulated in the carrier and rounded once to `stage`."""
    total = jnp.sum(self.lift(x), axis=axis, keepdims=keepdims)
    return self.round(total, stage)


# The largest exponent of each element format's normal numbers (OCP MX).
_ELEMENT_EMAX = {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp4_e2m1": 2}


def _floor_log2(x):
  """floor(log2(x)) of FP32 x > 0 from its exponent bits (-127 for 0)."""
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return ((bits >> 23) & 255) - 127


def _power_of_two(n):
  """2.0 ** n in FP32 for integer n, built from exponent bits (exact)."""
  n = jnp.clip(n, -126, 127)
  return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def micro_round(
  x, fmt: str, scaling: str, *, tensor_scale=None, casts_round=False
):
  """x quantized with one shared scale per group of values along its last
  axis and dequantized, in FP32 (microscaling; the axis length must be a
  multiple of the group).

  "mx" (OCP MX v1.0): groups of 32, scale 2^(floor(log2 amax) - emax of
  the element format), so the largest value may saturate. "nvfp4": groups
  of 16, scale round_e4m3(amax * (1 / (6 * t))) * t with t the FP32
  `tensor_scale`; a group whose e4m3 scale is 0 takes 1. Elements round
  to nearest even and saturate. Each dequantized value is exact in FP32
  for "mx" (a power-of-two scale), so a block-scaled matmul is the dot of
  the results. A last axis that is not a multiple of the group is padded
  with zeros.
  """
  group = MICRO_GROUPS[scaling]
  x = x.astype(jnp.float32)
  *lead, n = x.shape
  padded = -(-n // group) * group
  if padded != n:  # zeros change no group's amax
    x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, padded - n)])
  grouped = x.reshape(*lead, padded // group, group)
  amax = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True)
  if scaling == "mx":
    scale = _power_of_two(_floor_log2(amax) - _ELEMENT_EMAX[fmt])
  else:
    t = jnp.asarray(tensor_scale, jnp.float32)
    largest = jnp.asarray(LOW_FORMATS[fmt].max_finite, jnp.float32)
    block = round_to(
      amax * (1.0 / (largest * t)), "fp8_e4m3", casts_round=casts_round
    )
    scale = jnp.where(block > 0, block, jnp.ones_like(block)) * t
  elements = round_to(grouped * (1.0 / scale), fmt, casts_round=casts_round)
  return (elements * scale).reshape(x.shape)[..., :n]
