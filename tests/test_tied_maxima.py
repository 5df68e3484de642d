"""Qiu & Yao's biased BF16 rounding with tied row maxima, and their fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stableattn as sa
from stableattn.auditing.inputs import (
  Shape,
  TiedMaximaSpec,
  make_inputs,
  round_to,
)
from stableattn.numerics.metrics import signed_share

# Qiu & Yao's regime: FP32 softmax statistics, a BF16 output accumulator.
THEIR_REGIME = "bf16-fa2+out_accum=bf16"
SHAPE = Shape(batch=1, q_len=64, kv_len=64, heads=2, kv_heads=2, head_dim=64)
# Our flash kernels: the Triton path, and the Hopper path in GPU interpret
# mode in the slow tier.
SLOW_HOPPER = ["pallas", pytest.param("mosaic_gpu", marks=pytest.mark.slow)]


def _recipe(spec=None, seed=0, shape=SHAPE):
  """Two bit-identical keys win every row in one tile; one-sign V."""
  q, k, v = make_inputs("tied_maxima", seed, shape, tied=spec)
  q, k, v = (round_to(x, "bf16") for x in (q, k, v))
  return q, k, v, sa.golden_attention(q, k, v)


def _share(q, k, v, gold, **kwargs):
  out = sa.attention(q, k, v, **kwargs)
  return signed_share(gold, np.asarray(out.astype(jnp.float64)))


@pytest.mark.parametrize("implementation", SLOW_HOPPER)
@pytest.mark.parametrize("precision", ["bf16", THEIR_REGIME])
def test_ties_in_one_tile_bias_o_away_from_zero(precision, implementation):
  q, k, v, gold = _recipe()
  share = _share(
    q, k, v, gold, precision=precision, implementation=implementation
  )
  assert share >= 0.9


@pytest.mark.parametrize(
  "tie_beta, implementation",
  [
    (2.0, "pallas"),
    (7.0, "pallas"),
    (2.0, "mosaic_gpu"),
    pytest.param(7.0, "mosaic_gpu", marks=pytest.mark.slow),
  ],
)
def test_their_fix_removes_the_bias_in_their_regime(tie_beta, implementation):
  q, k, v, gold = _recipe()
  share = _share(
    q, k, v, gold, precision=THEIR_REGIME, tie_beta=tie_beta,
    implementation=implementation,
  )  # fmt: skip
  assert abs(share) <= 0.1


def test_the_strong_bias_needs_the_ties_in_one_tile():
  shares = {}
  for same_tile in (True, False):
    spec = TiedMaximaSpec(same_tile=same_tile, block_k=32)
    q, k, v, gold = _recipe(spec)
    shares[same_tile] = _share(
      q, k, v, gold, precision=THEIR_REGIME, block_k=32
    )
  assert shares[True] >= 0.9
  assert abs(shares[False]) <= 0.5


@pytest.mark.parametrize("implementation", SLOW_HOPPER)
def test_real_kernel_policy_is_not_biased_by_ties(implementation):
  q, k, v, gold = _recipe()
  share = _share(
    q, k, v, gold, precision="bf16-fa2", implementation=implementation
  )
  assert abs(share) <= 0.3


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
@pytest.mark.parametrize("tie_beta", [2.0, 7.0])
def test_the_fix_is_exact_in_fp64_values_and_gradients(
  implementation, tie_beta
):
  """Shifting the maximum changes roundings only, never the function."""
  q, k, v, _ = _recipe(TiedMaximaSpec(ties=3), shape=SHAPE)
  q, k, v = (x[:, :40] for x in (q, k, v))  # ragged, with ties kept
  d_out = np.random.default_rng(3).standard_normal(q.shape)

  def fn(q, k, v):
    return sa.attention(
      q,
      k,
      v,
      precision="fp64",
      implementation=implementation,
      tie_beta=tie_beta,
      block_q=16,
      block_k=32,
      causal=True,
    )

  out, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(jnp.asarray(d_out))
  assert sa.compare(sa.golden_attention(q, k, v, True), out).max_abs <= 1e-12
  golden_grads = sa.golden_attention_vjp(q, k, v, d_out, True)
  for g, gg in zip(grads, golden_grads):
    assert sa.compare(gg, g).max_abs <= 1e-10


@pytest.mark.parametrize(
  "precisions, implementation",
  # The Hopper path multiplies 16-bit operands only.
  [(("fp32", "bf16-fa2"), "pallas"), (("bf16-fa2",), "mosaic_gpu")],
)
def test_large_beta_times_large_max_does_not_underflow_the_sum(
  precisions, implementation
):
  """beta=7 and a row maximum of ~20: exp(-6 * 20) is 0 in FP32, so the sum
  of Qiu & Yao's shifted probabilities would be 0; the capped shift (its
  fraction wrapped below the cap) keeps the result finite and as accurate
  as without the fix."""
  spec = TiedMaximaSpec(margin=1e-7)
  q, k, v, gold = _recipe(spec)
  scores = np.einsum("bthd,bshd->bhts", q, k) / 8.0
  assert scores.max() > 18.0
  assert np.float32(np.exp(np.float32(-6.0 * scores.max()))) == 0.0

  def run(precision, **kwargs):
    out = sa.attention(
      q, k, v, precision=precision, implementation=implementation, **kwargs
    )
    return np.asarray(out.astype(jnp.float64))

  for precision in precisions:
    fixed, plain = run(precision, tie_beta=7.0), run(precision)
    assert np.isfinite(fixed).all()
    assert sa.compare(gold, fixed).max_abs <= 2 * sa.compare(
      gold, plain
    ).max_abs + sa.rounding_floor(gold, "bf16")


@pytest.mark.parametrize("bad", [1.0, 0.5, -2.0, float("nan"), float("inf")])
def test_tie_beta_must_be_a_finite_number_above_one(bad):
  q = np.ones((1, 8, 1, 16))
  with pytest.raises(ValueError, match="tie_beta must be a finite number > 1"):
    sa.attention(q, q, q, tie_beta=bad)


@pytest.mark.parametrize("bad", ["2", True, [2.0]])
def test_tie_beta_rejects_non_numbers(bad):
  q = np.ones((1, 8, 1, 16))
  with pytest.raises(ValueError, match="tie_beta must be None or a number"):
    sa.attention(q, q, q, tie_beta=bad)


def test_xla_implementation_refuses_the_fix_clearly():
  q = np.ones((1, 8, 1, 16))
  with pytest.raises(ValueError, match="not supported by implementation='xla'"):
    sa.attention(q, q, q, implementation="xla", tie_beta=2.0)


def test_tie_spec_refuses_what_does_not_fit():
  with pytest.raises(ValueError, match="need kv_len >= 256"):
    make_inputs(
      "tied_maxima",
      0,
      SHAPE,
      tied=TiedMaximaSpec(ties=4, same_tile=False, block_k=64),
    )
  with pytest.raises(ValueError, match="positive integer"):
    TiedMaximaSpec(ties=0)


def test_signed_share_reads_the_direction_relative_to_the_true_sign():
  truth = np.array([1.0, -2.0, 3.0, -4.0])
  assert signed_share(truth, truth * 1.01) == pytest.approx(1.0)
  assert signed_share(truth, truth * 0.99) == pytest.approx(-1.0)
  assert signed_share(truth, truth + 0.01) == pytest.approx(0.0)
  assert signed_share(truth, truth) == 0.0
