"""An FP8 KV cache read by 16-bit attention (policy option kv_cache): the
kernel, the Baseline and paged decoding against the emulator."""

import jax
import jax.numpy as jnp
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import check_against_emulator, emulator_inputs

import stableattn as sa

SHAPE = (40, 200, 2, 1, 32, 16, 32, False)


@pytest.mark.parametrize("preset", ["bf16-fa2", "fp16-fa2"])
def test_fp8_cache_with_16_bit_math_matches_emulator(preset):
  name = f"{preset}+kv_cache=fp8_e4m3"
  policy = sa.Precision.from_name(name)
  q, k, v = emulator_inputs(11, SHAPE)
  k[0, 5, 0, 3] = 25.0  # an outlier sets the tensor's scale
  tiles = dict(block_q=16, block_k=32)
  out = sa.attention(q, k, v, precision=name, causal=True, **tiles)
  want, _ = emu.forward(
    q, k, v, policy.stages(), scheme="fa2", causal=True,
    options=policy.options(), **tiles,
  )  # fmt: skip
  output = policy.output
  check_against_emulator(want, np.asarray(out, np.float64), output, name)
  base = sa.attention(q, k, v, precision=name, implementation="reference")
  want = emu.reference(
    q, k, v, policy.stages(), causal=False, options=policy.options()
  )
  check_against_emulator(want, np.asarray(base, np.float64), output, "base")
  # Not a no-op: the cache moves most outputs.
  plain = sa.attention(q, k, v, precision=preset, causal=True, **tiles)
  assert np.mean(np.asarray(plain) != np.asarray(out)) > 0.5


def test_gradients_pass_the_cache_straight_through():
  q, k, v = (jnp.asarray(x) for x in emulator_inputs(12, SHAPE))

  def loss(k, precision):
    out = sa.attention(q, k, v, precision=precision)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  cached = jax.grad(loss)(k, "bf16-fa2+kv_cache=fp8_e4m3")
  plain = jax.grad(loss)(k, "bf16-fa2")
  assert np.all(np.isfinite(np.asarray(cached)))
  assert np.abs(cached - plain).max() <= 0.1 * np.abs(plain).max()


def test_an_fp8_cache_on_fp8_math_is_refused():
  with pytest.raises(ValueError, match="16-bit math"):
    sa.Precision.from_name("fp8-fa3+kv_cache=fp8_e4m3")
