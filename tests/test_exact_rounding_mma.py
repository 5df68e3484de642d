"""The tensor core's accumulator is what runs: chunked, narrow, truncating
accumulation and two-level promotion (policy options mma_chunk,
mma_rounding, promote_every), kernel against the emulator.

CI runs this file twice, as test_exact_rounding.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import check_against_emulator, emulator_inputs
from helpers import sampled

import stableattn as sa

NARROW_BF16 = "bf16-fa2+matmul_accum=bf16+mma_chunk=16+mma_rounding=truncate"
# (policy, output format the check reads it in).
CASES = [
  ("fp8-fa3-hopper", "bf16"),  # one level: O in the MMA accumulator
  ("fp8-fa3-two-level", "bf16"),  # promoted every tile
  ("fp8-fa3-two-level+promote_every=4", "bf16"),
  ("fp8-fa3-hopper+p_scale=448", "bf16"),
  (f"{NARROW_BF16}+promote_every=0", "bf16"),  # a 16-bit policy's MMA
  (f"{NARROW_BF16}+promote_every=3", "bf16"),
  ("fp8-fa3+matmul_accum=fp22+mma_chunk=32", "fp16"),  # per-tile V scales
  ("fp8-sage+mma_chunk=32+matmul_accum=fp22", "fp16"),  # per-channel V
]
# Ten key tiles of 32 (the last ragged): promotion every 3 or 4 tiles
# leaves a remainder to flush; a causal mask changes how many each row
# visits.
SHAPE = (40, 300, 2, 1, 32, 16, 32, False)


def _run(name, causal, seed):
  q, k, v = emulator_inputs(seed, SHAPE)
  q[0, 3, 0, 2] = 30.0  # an outlier feature
  policy = sa.Precision.from_name(name)
  tiles = dict(block_q=16, block_k=32)
  out = sa.attention(q, k, v, precision=policy, causal=causal, **tiles)
  want, _ = emu.forward(
    q,
    k,
    v,
    policy.stages(),
    scheme="fa2",
    causal=causal,
    options=policy.options(),
    **tiles,
  )
  return want, np.asarray(out.astype(jnp.float64))


@pytest.mark.parametrize("case", sampled(CASES, 4), ids=lambda c: c[0])
def test_mma_accumulator_matches_emulator(case):
  name, output = case
  for causal in (False, True):
    want, got = _run(name, causal, CASES.index(case))
    check_against_emulator(want, got, output, f"{name} causal={causal}")


def test_the_narrow_accumulator_changes_the_output_where_promotion_does():
  """The emulator cases can fail: one level, two levels and one rounding
  per tile give different outputs under a 7-bit truncating accumulator,
  and the emulator tells them apart."""
  outs = {n: _run(f"{NARROW_BF16}+promote_every={n}", False, 9) for n in (0, 1)}
  plain = _run("bf16-fa2", False, 9)[1]
  one_level, two_level = outs[0][1], outs[1][1]
  assert np.mean(one_level != two_level) > 0.05
  assert np.mean(two_level != plain) > 0.05
  assert np.mean(outs[0][0] != two_level) > 0.05  # emulator, one level


def test_backward_recomputes_scores_as_the_forward_accumulates_them():
  """QK^T of the backward is the forward's (chunked); the gradient runs and
  stays close to the plain policy's."""
  q, k, v = emulator_inputs(3, SHAPE)

  def loss(q, k, v, precision):
    out = sa.attention(q, k, v, precision=precision, block_q=16, block_k=32)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  narrow = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "fp8-fa3-hopper")
  plain = jax.grad(loss, argnums=(0, 1, 2))(
    q, k, v, "fp8-fa3-hopper+mma_chunk=0+mma_rounding=nearest+promote_every=1"
  )
  for a, b in zip(narrow, plain):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    assert np.abs(a - b).max() <= 0.05 * np.abs(b).max()


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(precision="fp8-fa3-hopper", scheme="fa1"), "scheme='fa2'"),
    (
      dict(precision="fp8-fa3-hopper", implementation="reference"),
      "use 'pallas'",
    ),
    (dict(precision="bf16-fa2+promote_every=0"), "give mma_chunk"),
    (dict(precision="fp8-fa3+mma_chunk=32+promote_every=0"), "scaling"),
  ],
)
def test_meaningless_accumulator_settings_are_refused(kw, match):
  q, k, v = emulator_inputs(0, SHAPE)
  with pytest.raises(ValueError, match=match):
    sa.attention(q, k, v, **kw)
