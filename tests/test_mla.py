"""A value head dim other than the query/key head dim (MLA: DeepSeek-V2/V3's
192/128, 576/512 when absorbed for decoding): the golden value, our
kernel bit for bit against the emulator, and one-line refusals where an
implementation cannot take it."""

import edge_kernels
import jax
import jax.numpy as jnp
import numpy as np
import policy_emulator as emu
import pytest
from emulator_checks import (
  check_against_emulator,
  on_grid,
  options_of,
  stages_of,
)

import stableattn as sa
from stableattn.numerics.rules import flashattention_rule


def _mla_inputs(seed, q_len=40, kv_len=56, heads=4, kv_heads=2, dims=(24, 16)):
  rng = np.random.default_rng(seed)
  dk, dv = dims
  return [
    on_grid(rng.standard_normal(s))
    for s in (
      (1, q_len, heads, dk),
      (1, kv_len, kv_heads, dk),
      (1, kv_len, kv_heads, dv),
      (1, q_len, heads, dv),
    )
  ]


def test_the_golden_value_is_a_narrower_v_of_the_same_attention():
  """V of 16 columns gives the first 16 columns of the output with V
  padded by zeros to 24 (exact in FP64), and the same dQ and dK."""
  q, k, v, d_out = _mla_inputs(0)
  wide_v = np.concatenate([v, np.zeros_like(v[..., :8])], axis=-1)
  wide_do = np.concatenate([d_out, np.zeros_like(d_out[..., :8])], axis=-1)
  out = sa.golden_attention(q, k, v, causal=True)
  wide = sa.golden_attention(q, k, wide_v, causal=True)
  assert out.shape == (1, 40, 4, 16)
  np.testing.assert_allclose(out, wide[..., :16], rtol=0, atol=1e-14)
  grads = sa.golden_attention_vjp(q, k, v, d_out, causal=True)
  wide_grads = sa.golden_attention_vjp(q, k, wide_v, wide_do, causal=True)
  for g, w in zip(grads[:2], wide_grads[:2]):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-13)
  np.testing.assert_allclose(grads[2], wide_grads[2][..., :16], atol=1e-13)
  with pytest.raises(ValueError, match="shaped like the output"):
    sa.golden_attention_vjp(q, k, v, q)


@pytest.mark.parametrize(
  "preset, causal",
  [
    ("bf16-fa2", True),
    pytest.param("fp32-stable", False, marks=pytest.mark.slow),
    pytest.param("bf16-fa2-stable", True, marks=pytest.mark.slow),
    pytest.param("fp16-fa2", False, marks=pytest.mark.slow),
  ],
)
def test_pallas_mla_forward_and_backward_match_the_emulator(preset, causal):
  q, k, v, d_out = _mla_inputs(1)
  policy = sa.Precision.from_name(preset)
  tiles = {"block_q": 16, "block_k": 16}

  def fn(q, k, v):
    return sa.attention(q, k, v, precision=preset, causal=causal, **tiles)

  out, vjp = jax.vjp(fn, *(jnp.asarray(x) for x in (q, k, v)))
  grads = vjp(jnp.asarray(d_out).astype(policy.dtype("output")))
  stages, options = stages_of(preset), options_of(preset)
  common = dict(options=options, scheme="fa2", causal=causal, **tiles)
  want, _ = emu.forward(q, k, v, stages, **common)
  check_against_emulator(want, np.asarray(out, np.float64), preset, "output")
  for name, g, w in zip(
    ("dq", "dk", "dv"), grads, emu.backward(q, k, v, d_out, stages, **common)
  ):
    assert g.shape == w.shape, name
    check_against_emulator(w, np.asarray(g, np.float64), preset, name)


@pytest.mark.parametrize(
  "implementation",
  [
    "pallas",
    # The Hopper path's backward above head dim 128 (dV and dK apart)
    # runs fast at 256 and at MLA's 576/512 (test_mosaic_gpu_backward).
    pytest.param("mosaic_gpu", marks=pytest.mark.slow),
    "reference",
  ],
)
def test_deepseek_head_dims_meet_flashattentions_rule(implementation):
  """192/128 at BF16, forward and backward, against FP64 beside eager
  attention's error under the same inputs."""
  rng = np.random.default_rng(2)
  shapes = ((1, 64, 4, 192), (1, 64, 2, 192), (1, 64, 2, 128))
  q, k, v = (rng.standard_normal(s) for s in shapes)
  d_out = rng.standard_normal((1, 64, 4, 128))
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  rounded = [np.asarray(x, np.float64) for x in args]

  def run(implementation, precision):
    def fn(q, k, v):
      return sa.attention(q, k, v, implementation=implementation,
                          precision=precision, causal=True)  # fmt: skip

    out, vjp = jax.vjp(fn, *args)
    grads = vjp(jnp.asarray(d_out, out.dtype))
    return [np.asarray(x, np.float64) for x in (out, *grads)]

  golden = [
    sa.golden_attention(*rounded, causal=True),
    *sa.golden_attention_vjp(*rounded, d_out, causal=True),
  ]
  eager = run("reference", "bf16-framework")
  ours = run(implementation, "bf16-fa2")
  for i, name in enumerate(("out", "dq", "dk", "dv")):
    verdict = flashattention_rule(
      golden[i], ours[i], eager[i], "bf16", gradient=i > 0
    )
    assert verdict.passed, (name, verdict)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas", "mosaic_gpu"])
def test_absorbed_mla_decoding_meets_flashattentions_rule(implementation):
  """576/512, one query of 16 heads over one latent head and a cache of
  each example's own length, at BF16: the output against FP64 beside
  eager attention's (the Hopper path in two value parts of 256)."""
  rng = np.random.default_rng(4)
  shapes = ((2, 1, 16, 576), (2, 200, 1, 576), (2, 200, 1, 512))
  args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes]
  rounded = [np.asarray(x, np.float64) for x in args]
  lengths = np.array([150, 200], np.int32)
  golden = sa.golden_attention(*rounded, key_value_seq_lengths=lengths)

  def run(implementation, precision):
    out = sa.attention(
      *args, implementation=implementation, precision=precision,
      key_value_seq_lengths=lengths,
    )  # fmt: skip
    return np.asarray(out, np.float64)

  eager = run("reference", "bf16-framework")
  verdict = flashattention_rule(
    golden, run(implementation, "bf16-fa2"), eager, "bf16", gradient=False
  )
  assert verdict.passed, verdict


def test_where_mla_cannot_run_it_is_refused_in_one_line():
  q = jnp.ones((1, 8, 2, 24))
  k = jnp.ones((1, 8, 2, 24))
  v = jnp.ones((1, 8, 2, 16))
  with pytest.raises(ValueError, match="'xla' refuses a value head dim"):
    sa.attention(q, k, v, implementation="xla")
  with pytest.raises(ValueError, match="k and v must agree in"):
    sa.attention(q, k, v[:, :4])


def test_the_audit_catches_scores_scaled_by_vs_head_dim():
  """The head_dims regime fails a kernel that scales MLA's scores by
  1/sqrt of V's head dim (right whenever the two dims agree)."""
  broken = sa.audit(
    edge_kernels.scores_scaled_by_value_dim, precision="fp32",
    shapes=((1, 32, 2, 16),), regimes="head_dims", repeats=1,
  )  # fmt: skip
  assert any("regime head_dims" in f for f in broken.failures)


@pytest.mark.slow
def test_the_audit_judges_our_kernel_at_mla_head_dims():
  ours = sa.audit(
    lambda q, k, v, *, causal=False: sa.attention(
      q, k, v, precision="fp32", causal=causal
    ),
    precision="fp32", shapes=((1, 32, 2, 16),), regimes="head_dims",
    repeats=1,
  )  # fmt: skip
  mla_rows = [r for r in ours.rows if r["regime"] == "head_dims"]
  assert mla_rows and ours.passed, ours.failures
  assert {r["shape"].split()[-1] for r in mla_rows} == {"D192/128", "D576/512"}


def test_the_flax_drop_in_takes_mla_head_dims():
  rng = np.random.default_rng(3)
  q, k = (rng.standard_normal((1, 16, 2, 24)).astype(np.float32)
          for _ in range(2))  # fmt: skip
  v = rng.standard_normal((1, 16, 2, 8)).astype(np.float32)
  out = sa.make_attention_fn(sa.Options(precision="fp32"))(q, k, v)
  assert out.shape == (1, 16, 2, 8)
  np.testing.assert_allclose(out, sa.golden_attention(q, k, v), atol=1e-6)


@pytest.mark.parametrize("split", [{"num_splits": 4}, {"split_size": 64}])
def test_split_kv_decoding_takes_mla_head_dims(split):
  rng = np.random.default_rng(4)
  q = rng.standard_normal((2, 1, 4, 48)).astype(np.float32)
  k = rng.standard_normal((2, 256, 2, 48)).astype(np.float32)
  v = rng.standard_normal((2, 256, 2, 32)).astype(np.float32)
  out = sa.attention(q, k, v, precision="fp32", **split)
  assert out.shape == (2, 1, 4, 32)
  np.testing.assert_allclose(out, sa.golden_attention(q, k, v), atol=1e-6)
