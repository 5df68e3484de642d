"""Below 16 bits, the policy is what runs: every FP8/FP4/INT8 format and
scaling against the emulator, forward (both schemes), Baseline and
backward, and the formats' casts against ml_dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import (
  SHAPES,
  check_against_emulator,
  emulator_inputs,
  identical_share,
  on_grid,
  ulps_at_largest,
)
from helpers import sampled

import stableattn as sa
from stableattn.harness.compile_flags import default_emitters
from stableattn.numerics.rounding import round_to

# Below 16 bits: every format and scaling, forward (both schemes) and
# Baseline, against the emulator; one outlier feature in Q.
QUANT_POLICIES = [
  "fp8-baseline",
  "fp8-fa3",
  "fp8-fa3+block_quant=off+hadamard=off",
  "fp8-fa3+p_scale=448+key_order=reversed",
  "bf16-fa2+matmul_operands=fp8_e5m2+probs=fp8_e5m2",
  "bf16-fa2+matmul_operands=int8+scaling=block",
  "bf16-fa2+matmul_operands=fp4_e2m1+probs=fp4_e2m1+scaling=block+p_scale=6",
  "fp8-sage+probs=fp8_e5m2",  # token scales, smoothing, e5m2 P, e4m3 V
  "bf16-fa2+matmul_operands=fp4_e2m1+probs=fp4_e2m1+scaling=mx",
  "fp4-nvfp4",
  "bf16-fa2+matmul_accum=fp22",
  "bf16-fa2+matmul_operands=int8+scaling=token+probs=fp16",
]


@pytest.mark.parametrize("name", sampled(QUANT_POLICIES, 4))
def test_quantized_policies_match_emulator(name):
  policy = sa.Precision.from_name(name)
  q, k, v = emulator_inputs(QUANT_POLICIES.index(name), SHAPES[0])
  q[0, 3, 0, 2] = 30.0  # an outlier feature
  tiles = dict(block_q=16, block_k=32)
  options = policy.options()
  # fa1 rescales differently but quantizes P V alike: its run covers one
  # policy per kind of V scale (tile, channel, microscaled).
  both = name in ("fp8-fa3", "fp8-sage+probs=fp8_e5m2", "fp4-nvfp4")
  for scheme in ("fa2", "fa1") if both else ("fa2",):
    out = sa.attention(q, k, v, precision=policy, scheme=scheme, **tiles)
    want, _ = emu.forward(
      q,
      k,
      v,
      policy.stages(),
      scheme=scheme,
      causal=False,
      options=options,
      **tiles,
    )
    got = np.asarray(out.astype(jnp.float64))
    check_against_emulator(want, got, "fp16", f"{name} {scheme}")
  base = sa.attention(q, k, v, implementation="reference", precision=policy)
  want = emu.reference(q, k, v, policy.stages(), causal=False, options=options)
  got = np.asarray(base.astype(jnp.float64))
  if policy.scaling != "block":
    check_against_emulator(want, got, "fp16", f"{name} base")
  else:
    # The Baseline multiplies per-block V scales back before one P V
    # matmul over every key: a sum of values off any grid, whose FP32
    # order (XLA's vs the emulator's) moves about 1% of outputs by an ulp.
    assert identical_share(want, got) >= 0.98
    assert ulps_at_largest(want, got, "fp16") <= 2.0


@pytest.mark.parametrize(
  "name", ["fp8-fa3+scaling=mx", "fp4-nvfp4+probs=fp16+inputs=bf16"]
)
def test_microscaling_matches_emulator_across_groups(name):
  # Head dim 64 and 100 keys in tiles of 32: several groups per row of Q
  # and K, groups of P and V along keys within and across tiles, and a
  # last group that is partly padding.
  policy = sa.Precision.from_name(name)
  q, k, v = emulator_inputs(60, (40, 100, 2, 1, 64))
  k[0, 7, 0, :32] *= 4.0  # one group with a larger scale
  for implementation in ("pallas", "reference"):
    out = sa.attention(
      q,
      k,
      v,
      precision=policy,
      implementation=implementation,
      block_q=16,
      block_k=32,
    )
    emulate = emu.forward if implementation == "pallas" else emu.reference
    tiles = dict(block_q=16, block_k=32, scheme="fa2")
    want = emulate(
      q,
      k,
      v,
      policy.stages(),
      causal=False,
      options=policy.options(),
      **(tiles if implementation == "pallas" else {}),
    )
    want = want[0] if implementation == "pallas" else want
    check_against_emulator(
      want, np.asarray(out.astype(jnp.float64)), "fp16", name
    )


# The straight-through backward of quantizing policies (head dim 16: the
# rotation's 1/sqrt(d) is exact).
QUANT_BACKWARD = [
  "fp8-fa3",
  "bf16-fa2+matmul_operands=fp4_e2m1+probs=fp4_e2m1+scaling=block+p_scale=6",
  "fp8-sage",
  "fp4-nvfp4",
]


@pytest.mark.parametrize("name", sampled(QUANT_BACKWARD, 2))
def test_quantized_backward_matches_emulator(name):
  policy = sa.Precision.from_name(name)
  shape = SHAPES[2]
  *_, block_q, block_k, causal = shape
  q, k, v = emulator_inputs(40 + QUANT_BACKWARD.index(name), shape)
  q[0, 3, 0, 2] = 30.0
  d_out = on_grid(np.random.default_rng(41).standard_normal(q.shape))
  tiles = dict(block_q=block_q, block_k=block_k, causal=causal)

  def fn(q, k, v):
    return sa.attention(q, k, v, precision=policy, **tiles)

  _, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)))
  grads = vjp(jnp.asarray(d_out).astype(policy.dtype("output")))
  want = emu.backward(
    q,
    k,
    v,
    d_out,
    policy.stages(),
    scheme="fa2",
    options=policy.options(),
    **tiles,
  )
  for what, g, w in zip(("dq", "dk", "dv"), grads, want):
    # The dequantized operands round(x / s) * s are FP32 values off any
    # short grid, so their products round in FP32 and a sum's order
    # (XLA's vs the emulator's exact one) moves 0.5-1.1% of gradients by
    # an ulp over seeds, as in the Baseline with block scales above.
    got = np.asarray(g, np.float64)
    assert identical_share(w, got) >= 0.98, what
    assert ulps_at_largest(w, got, "fp16") <= 2.0, what


@pytest.mark.parametrize(
  "fmt", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int8", "fp22"]
)
@pytest.mark.parametrize("casts_round", [False, True])
def test_low_formats_round_like_ml_dtypes(fmt, casts_round):
  """To nearest even, subnormals exact, e4m3/e2m1/int8 saturating."""
  rng = np.random.default_rng(2)
  x = (rng.standard_normal(50000) * 10.0 ** rng.integers(-6, 4, 50000)).astype(
    np.float32
  )
  x[:5] = [0.0, 448.0, 464.0, -1e9, 2.0**-10]
  # XLA's default (fusion) emitters: the tests' legacy ones convert FP32
  # to FP4 through a wider format, rounding twice (`compile_flags`).
  got = np.asarray(
    jax.jit(
      lambda x: round_to(x, fmt, casts_round=casts_round),
      compiler_options=default_emitters(),
    )(x)
  )
  np.testing.assert_array_equal(got, emu.cast(x, fmt))
