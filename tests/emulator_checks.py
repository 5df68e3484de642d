"""What the exact-rounding tests share: the policies and shapes they run,
inputs on a grid where FP32 sums are exact, and the check of a kernel's
output against the emulator's (`policy_emulator.py`)."""

import ml_dtypes
import numpy as np
import policy_emulator as emu
from helpers import random_qkv

import stableattn as sa

# Policies of 16 bits or more with no option set; FP8/FP4/INT8 policies
# and the FP8 KV cache (test_kv_cache.py) have their own tests.
PRESETS = [
  p
  for p in sa.preset_names()
  if not sa.Precision.from_name(p).quantizes
  and sa.Precision.from_name(p).kv_cache == "none"
]
HALF_OUTPUT = [p for p in PRESETS if not p.startswith("fp32") and p != "fp64"]
# (q_len, kv_len, heads, kv_heads, head_dim, block_q, block_k, causal):
# ragged last blocks both ways, GQA, cross attention, causal.
SHAPES = [
  (70, 70, 2, 1, 16, 16, 32, False),
  (48, 80, 2, 2, 32, 32, 16, False),
  (64, 64, 4, 2, 16, 16, 16, True),
  (50, 50, 2, 1, 24, 32, 32, True),
]


def emulator_inputs(seed, shape, scale=1.0):
  q_len, kv_len, heads, kv_heads, head_dim = shape[:5]
  q, k, v = random_qkv(
    seed,
    batch=1,
    q_len=q_len,
    kv_len=kv_len,
    heads=heads,
    kv_heads=kv_heads,
    head_dim=head_dim,
  )
  return [on_grid(x * scale) for x in (q, k, v)]


def on_grid(x):
  """FP32 values on a 1/16 grid in [-4, 4]: every sum of their products
  over a head dim <= 64 is exact in FP32, so QK^T and dO V^T do not depend
  on summation order, and a difference from the emulator can come only
  from a rounding the policy names, FP32 exp, or the order of the sums
  over P."""
  return np.clip(np.round(x * 16) / 16, -4, 4).astype(np.float32)


def stages_of(preset):
  return sa.Precision.from_name(preset).stages()


def options_of(preset):
  """The preset's options (its stability options among them)."""
  return sa.Precision.from_name(preset).options()


def identical_share(expected, actual):
  expected, actual = np.asarray(expected), np.asarray(actual)
  same = (expected == actual) | (np.isnan(expected) & np.isnan(actual))
  return float(same.mean())


def output_format(preset):
  return sa.Precision.from_name(preset).output


def ulps_at_largest(expected, actual, fmt):
  """Largest difference in units of `fmt`'s last place at max |expected|."""
  info = ml_dtypes.finfo(emu.FORMATS[fmt])
  largest = max(float(np.max(np.abs(expected))), float(info.tiny))
  ulp = 2.0 ** (np.floor(np.log2(largest)) - info.nmant)
  return float(np.max(np.abs(np.asarray(actual) - expected))) / ulp


def check_against_emulator(expected, actual, preset, what):
  """The share of bit-identical elements, and the size of the rest.

  Half-format outputs: >= 99.5% bit-identical. The rest may differ only
  where FP32 exp (NumPy's vs XLA's) or an FP32 sum over P changes one
  rounding, which moves a row by a few ulps of its largest value. FP32
  and FP64 outputs show every such difference, so they are held to a few
  ulps at the largest value instead.
  """
  share = identical_share(expected, actual)
  ulps = ulps_at_largest(expected, actual, output_format(preset))
  if preset in HALF_OUTPUT:
    assert share >= 0.995, f"{what}: only {share:.4f} bit-identical"
    assert ulps <= 4.0, f"{what}: {ulps} ulps apart"
  else:
    assert ulps <= 64.0, f"{what}: {ulps} ulps apart"
  return share
