"""Number formats by name: 'fp64', 'fp32', 'fp16', 'bf16', the 8- and
4-bit formats, int8 and fp22; their aliases, mantissa widths and dtypes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# Canonical short names and the dtypes they stand for.
_FORMATS = {
  "fp64": jnp.float64,
  "fp32": jnp.float32,
  "fp16": jnp.float16,
  "bf16": jnp.bfloat16,
  # Below 16 bits (see `LOW_FORMATS` in rounding.py for their ranges).
  "fp8_e4m3": jnp.float8_e4m3fn,
  "fp8_e5m2": jnp.float8_e5m2,
  "fp4_e2m1": jnp.float4_e2m1fn,
  "int8": jnp.int8,
  # FP32's range with 13 fraction bits, held in FP32: the width Hopper's
  # FP8 tensor cores accumulate in (SageAttention 2 calls it FP22).
  "fp22": jnp.float32,
}
# The formats every stage can take and each has presets (and a study axis).
_ALIASES = {
  "float64": "fp64",
  "f64": "fp64",
  "double": "fp64",
  "float32": "fp32",
  "f32": "fp32",
  "float": "fp32",
  "float16": "fp16",
  "f16": "fp16",
  "half": "fp16",
  "bfloat16": "bf16",
  "e4m3": "fp8_e4m3",
  "fp8": "fp8_e4m3",
  "float8_e4m3fn": "fp8_e4m3",
  "e5m2": "fp8_e5m2",
  "float8_e5m2": "fp8_e5m2",
  "e2m1": "fp4_e2m1",
  "fp4": "fp4_e2m1",
  "float4_e2m1fn": "fp4_e2m1",
  "e8m13": "fp22",
}
# Mantissa bits (explicit fraction bits) of each format, for reports; int8
# has 7 magnitude bits.
MANTISSA_BITS = {
  "fp64": 52,
  "fp32": 23,
  "fp16": 10,
  "bf16": 7,
  "fp8_e4m3": 3,
  "fp8_e5m2": 2,
  "fp4_e2m1": 1,
  "int8": 7,
  "fp22": 13,
}
DtypeLike = str | np.dtype | type


def format_name(dtype: DtypeLike) -> str:
  """Canonical short name ('fp64', 'fp32', 'fp16', 'bf16') of a dtype."""
  if isinstance(dtype, str):
    key = dtype.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _FORMATS:
      return key
    raise ValueError(
      f"Unknown number format {dtype!r}; valid formats are "
      f"{sorted(_FORMATS)} (or {sorted(_ALIASES)})."
    )
  try:
    np_dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(
      f"Unknown number format {dtype!r}; valid formats are {sorted(_FORMATS)}."
    ) from e
  for name, candidate in _FORMATS.items():
    if np_dtype == jnp.dtype(candidate):
      return name
  raise ValueError(
    f"Unsupported dtype {np_dtype}; valid formats are {sorted(_FORMATS)}."
  )


def to_dtype(name: str) -> np.dtype:
  """The numpy/JAX dtype for a format name."""
  return jnp.dtype(_FORMATS[format_name(name)])
