"""Every implementation against the golden FP64 value: outputs and grads."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
  golden_value_and_grads,
  random_qkv,
  sampled,
  value_and_grads,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import stableattn as sa

TILES = [(16, 32), (64, 64), (32, 128)]
SHAPES = [(97, 72), (256, 64), (97, 64), (256, 72)]  # (length, head_dim)
# A covering design over tiles x schemes x causal; the four shapes rotate
# through it so each tile and scheme meets ragged and even lengths, and both
# head dims.
GRID = [
  (tiles, scheme, causal, SHAPES[i % len(SHAPES)])
  for i, (tiles, scheme, causal) in enumerate(
    itertools.product(TILES, ("fa2", "fa1"), (False, True))
  )
]


def _case_id(case):
  (bq, bk), scheme, causal, (length, head_dim) = case
  return (
    f"{bq}x{bk}-{scheme}-{'causal' if causal else 'full'}-T{length}-D{head_dim}"
  )


@pytest.mark.parametrize("case", sampled(GRID, 4, ids=_case_id))
def test_pallas_fp64_matches_golden(case):
  (block_q, block_k), scheme, causal, (length, head_dim) = case
  q, k, v = random_qkv(length, q_len=length, head_dim=head_dim)
  d_out = np.random.default_rng(1).standard_normal(q.shape)
  out, grads = value_and_grads(
    q,
    k,
    v,
    d_out,
    precision="fp64",
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
  )
  gold, gold_grads = golden_value_and_grads(q, k, v, d_out, causal)
  assert sa.compare(gold, out).max_abs <= 1e-12
  for name, g, gg in zip("qkv", grads, gold_grads):
    assert sa.compare(gg, g).max_abs <= 1e-10, f"d{name}"


@pytest.mark.parametrize("case", sampled(GRID[::3], 1, ids=_case_id))
def test_pallas_fp32_matches_golden(case):
  (block_q, block_k), scheme, causal, (length, head_dim) = case
  q, k, v = random_qkv(length + 1, q_len=length, head_dim=head_dim)
  out = sa.attention(
    q,
    k,
    v,
    precision="fp32",
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
  )
  assert out.dtype == jnp.float32
  gold = sa.golden_attention(q, k, v, causal)
  assert sa.compare(gold, out).max_abs <= 1e-5


# jax.nn.dot_product_attention computes its softmax in FP32 whatever the
# input format, so its FP64 result is only FP32-accurate.
@pytest.mark.parametrize(
  "implementation, value_tol, grad_tol",
  [("reference", 1e-12, 1e-10), ("xla", 1e-6, 1e-5)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_baselines_fp64_match_golden(
  implementation, value_tol, grad_tol, causal
):
  q, k, v = random_qkv(3, q_len=97, kv_len=50, head_dim=72)
  d_out = np.random.default_rng(4).standard_normal(q.shape)
  out, grads = value_and_grads(
    q,
    k,
    v,
    d_out,
    implementation=implementation,
    precision="fp64",
    causal=causal,
  )
  gold, gold_grads = golden_value_and_grads(q, k, v, d_out, causal)
  assert sa.compare(gold, out).max_abs <= value_tol
  for g, gg in zip(grads, gold_grads):
    assert sa.compare(gg, g).max_abs <= grad_tol


def test_cross_attention_lengths_and_mqa():
  # q_len != kv_len, one kv head (MQA), ragged both ways, causal.
  q, k, v = random_qkv(5, q_len=70, kv_len=45, heads=3, kv_heads=1, head_dim=24)
  d_out = np.random.default_rng(6).standard_normal(q.shape)
  out, grads = value_and_grads(
    q, k, v, d_out, precision="fp64", block_q=32, block_k=16, causal=True
  )
  gold, gold_grads = golden_value_and_grads(q, k, v, d_out, True)
  assert np.isfinite(out).all()
  assert sa.compare(gold, out).max_abs <= 1e-12
  for g, gg in zip(grads, gold_grads):
    assert sa.compare(gg, g).max_abs <= 1e-10


def test_lse_is_saved_in_statistics_format():
  q, k, v = random_qkv(7, q_len=40, head_dim=16)
  out, lse = sa.attention(
    q, k, v, precision="bf16-fa2", block_q=16, block_k=16, return_lse=True
  )
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  assert lse.shape == (2, 4, 40)
  # lse = log sum_j exp(s_ij) for head 0 of batch 0, from the golden scores.
  q0 = q[0, :, 0].astype(np.float64)
  k0 = np.asarray(jnp.asarray(k[0, :, 0]).astype(jnp.bfloat16), np.float64)
  q0 = np.asarray(jnp.asarray(q0).astype(jnp.bfloat16), np.float64)
  s = q0 @ k0.T / 4.0
  expected = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
  np.testing.assert_allclose(np.asarray(lse[0, 0]), expected, rtol=1e-5)


_FORMAT_OF = {"bf16-fa2": "bf16", "fp16-fa2": "fp16"}


@pytest.mark.parametrize("precision", sampled(["bf16-fa2", "fp16-fa2"], 1))
# Three random shapes a run: each compiles its own forward and backward.
@settings(max_examples=3)
@given(
  seed=st.integers(0, 10_000),
  q_len=st.integers(1, 80),
  kv_len=st.integers(1, 80),
  head_dim=st.sampled_from([8, 16, 40]),
  kv_heads=st.sampled_from([1, 2]),
  block_q=st.sampled_from([8, 16, 24, 64]),
  block_k=st.sampled_from([8, 16, 40, 64]),
  causal=st.booleans(),
  scheme=st.sampled_from(["fa2", "fa1"]),
)
def test_fa_rule_values_and_gradients(
  precision,
  seed,
  q_len,
  kv_len,
  head_dim,
  kv_heads,
  block_q,
  block_k,
  causal,
  scheme,
):
  """FlashAttention's rule: kernel error <= 2x (grads 3x) the same-policy
  baseline's error against golden, plus a few ULPs of the format."""
  q, k, v = random_qkv(
    seed,
    batch=1,
    q_len=q_len,
    kv_len=kv_len,
    heads=2,
    kv_heads=kv_heads,
    head_dim=head_dim,
  )
  d_out = np.random.default_rng(seed + 1).standard_normal(q.shape)
  fmt = _FORMAT_OF[precision]
  kwargs = dict(precision=precision, causal=causal)
  out, grads = value_and_grads(
    q, k, v, d_out, block_q=block_q, block_k=block_k, scheme=scheme, **kwargs
  )
  base, base_grads = value_and_grads(
    q, k, v, d_out, implementation="reference", **kwargs
  )
  gold, gold_grads = golden_value_and_grads(q, k, v, d_out, causal)
  assert np.isfinite(out).all()
  assert sa.passes_fa_rule(
    gold, out, base, factor=2.0, floor=sa.rounding_floor(gold, fmt)
  )
  for name, g, b, gg in zip("qkv", grads, base_grads, gold_grads):
    assert sa.passes_fa_rule(
      gg, g, b, factor=3.0, floor=sa.rounding_floor(gg, fmt)
    ), f"d{name}"


def test_fa_rule_catches_a_broken_kernel():
  """The rule used above fails for a kernel that drops one key block."""
  q, k, v = random_qkv(11, batch=1, q_len=64, head_dim=16)
  gold = sa.golden_attention(q, k, v)
  base = sa.attention(q, k, v, precision="bf16-fa2", implementation="reference")
  broken = sa.attention(
    q[:, :, :, :],
    k[:, :48],
    v[:, :48],
    precision="bf16-fa2",
    block_q=16,
    block_k=16,
  )
  assert not sa.passes_fa_rule(
    gold, broken, base, factor=2.0, floor=sa.rounding_floor(gold, "bf16")
  )


@pytest.mark.parametrize(
  "policy, features",
  [
    ("bf16", {"causal": True}),
    pytest.param(
      "fp16-fa2",
      {"local_window_size": (20, 5), "key_value_seq_lengths": [50, 72]},
      marks=pytest.mark.slow,
    ),
  ],
)
def test_fused_backward_is_the_two_kernel_backward_bit_for_bit(
  monkeypatch, policy, features
):
  """Interpret mode's one dK/dV/dQ kernel sums dQ over key blocks in the dQ
  kernel's order and rounding: the same bits, and each path really runs."""
  import jax

  from stableattn.kernels import pallas_backward

  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 80, 4, 32)), jnp.float32)
  k, v = (
    jnp.asarray(rng.standard_normal((2, 72, 2, 32)), jnp.float32)
    for _ in range(2)
  )
  features = {
    name: jnp.asarray(value) if isinstance(value, list) else value
    for name, value in features.items()
  }

  def loss(q, k, v):
    out = sa.attention(
      q, k, v, precision=policy, block_q=32, block_k=16, **features
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  grads = {}
  for fused, limit in (
    (True, pallas_backward.FUSED_PARTIALS_MAX_BYTES),
    (False, 0),
  ):
    monkeypatch.setattr(pallas_backward, "FUSED_PARTIALS_MAX_BYTES", limit)
    jax.clear_caches()
    program = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v))
    assert ("stableattn_flash_backward_dkdvdq" in program) == fused
    assert ("stableattn_flash_backward_dq" in program) != fused
    grads[fused] = jax.grad(loss, (0, 1, 2))(q, k, v)
  for fused_grad, split_grad in zip(grads[True], grads[False]):
    np.testing.assert_array_equal(
      np.asarray(fused_grad), np.asarray(split_grad)
    )
