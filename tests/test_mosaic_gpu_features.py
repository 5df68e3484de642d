"""The Hopper path's features beyond the first build: a bias (with its
gradient), a dense mask, bottom-right causal over each example's
lengths, split-KV decoding. Their values against the Triton path are
`hopper_check`'s cases (tests/test_mosaic_gpu.py); here: they lower for
sm_90, d(bias), and NaN in keys the mask hides; the backward's split
over head dims is tests/test_mosaic_gpu_backward.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
  mosaic_lowered_text,
  random_features,
  random_qkv,
  value_and_grads,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import stableattn as sa
from stableattn.experiments import hopper_check

CASES = hopper_check.CASES
_inputs = hopper_check.inputs


def test_bias_mask_key_positions_and_split_kv_lower_to_mosaic_gpu_for_cuda():
  """A bias (with its gradient), a dense mask and bottom-right causal over
  each example's lengths build the three kernels; split-KV's forward
  builds one."""
  text = mosaic_lowered_text(
    bias=np.zeros((1, 4, 200, 200), np.float32),
    mask=np.ones((2, 1, 200, 200), bool),
    causal=True,
    causal_alignment="bottom_right",
    query_seq_lengths=np.array([120, 200]),
    key_value_seq_lengths=np.array([150, 200]),
  )
  assert text.count("custom_call @mosaic_gpu") == 3
  text = mosaic_lowered_text(
    num_splits=3, key_value_seq_lengths=np.array([150, 200])
  )
  assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize(
  "dims",
  [(64, 64), pytest.param((320, 64), marks=pytest.mark.slow)],
  ids=["d64", "d320-in-two-parts"],
)
def test_the_bias_gradient_is_the_triton_paths(dims):
  """d(bias) is the dQ kernel's dS tile (zero on the blocks it skips),
  summed over the batch the bias broadcasts across: the Triton path's
  to a rounding, under causal masking and a dense mask. At head dim 320
  dQ runs in two column parts, and the first part's thread block alone
  stores d(bias) (the others would store the same tile: the
  interpreter cannot tell the two apart)."""
  rng = np.random.default_rng(5)
  d, dv = dims
  q, k, v, d_out = (
    jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    for s in ((2, 70, 2, d), (2, 100, 1, d), (2, 100, 1, dv), (2, 70, 2, dv))
  )
  bias = jnp.asarray(rng.standard_normal((1, 2, 70, 100)), jnp.float32)
  mask = rng.random((2, 1, 70, 100)) < 0.7

  def d_bias(implementation):
    def loss(bias):
      out = sa.attention(
        q, k, v, implementation=implementation, precision="bf16-fa2",
        bias=bias, mask=mask, causal=True,
      )  # fmt: skip
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    return np.asarray(jax.grad(loss)(bias), np.float64)

  ours, triton = d_bias("mosaic_gpu"), d_bias("pallas")
  assert np.all(np.isfinite(ours))
  # Zero exactly where no pair of either example attends (above the
  # diagonal, or masked in both), nonzero elsewhere.
  attends = np.tril(np.ones((70, 100), bool)) & mask.any(axis=0)[0]
  assert np.all(ours[0][:, ~attends] == 0)
  assert np.mean(ours[0][:, attends] != 0) > 0.99
  np.testing.assert_allclose(ours, triton, atol=2e-3 * np.abs(triton).max())


def test_a_dense_mask_alone_runs_in_64_bit_mode():
  """The additive tile is FP32 whatever builds it: a dense mask alone
  made it FP64 under jax's 64-bit mode (the Python float 0 where no bias
  is), and the kernels' TMA copy into an FP32 tile failed (found by the
  regimes audit). The tests run in 64-bit mode (conftest)."""
  assert jax.config.jax_enable_x64
  rng = np.random.default_rng(9)
  q, k, v = (
    jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    for s in ((1, 70, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64))
  )
  mask = rng.random((1, 1, 70, 64)) < 0.7

  def run(implementation):
    def loss(q, k, v):
      out = sa.attention(
        q, k, v, implementation=implementation, precision="bf16-fa2",
        mask=mask,
      )  # fmt: skip
      return jnp.sum(out.astype(jnp.float32) ** 2)

    return [
      np.asarray(g, np.float64) for g in jax.grad(loss, (0, 1, 2))(q, k, v)
    ]

  for ours, triton in zip(run("mosaic_gpu"), run("pallas")):
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(ours, triton, atol=2e-3 * np.abs(triton).max())


@pytest.mark.slow
def test_nan_in_keys_the_dense_mask_hides_never_reaches_a_result():
  """Keys no query may attend (the mask hides the last ten) hold NaN: P
  is 0 there, and the kernel never multiplies 0 by them."""
  case = CASES["bias-mask"]
  (q, k, v, _), features = _inputs(case)
  mask = np.array(features["mask"])
  mask[..., 100:] = False
  features = {**features, "mask": mask}

  def out(k, v):
    return np.asarray(
      sa.attention(
        q, k, v, implementation="mosaic_gpu", precision=case[0], **features
      ),
      np.float64,
    )

  clean = out(k, v)
  poisoned = out(k.at[:, 100:].set(jnp.nan), v.at[:, 100:].set(jnp.nan))
  assert np.all(np.isfinite(clean))
  np.testing.assert_array_equal(poisoned, clean)


@pytest.mark.slow
def test_split_size_decoding_is_batch_and_padding_invariant():
  """Split-KV with a fixed split_size on the Hopper path: a decoded row
  alone, in a batch of 5 at another position, and over a cache padded to
  a longer length gives bitwise the same output and lse (the splits sit
  at fixed key positions; padding adds only empty splits)."""
  rng = np.random.default_rng(5)
  q, k, v = (
    jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    for s in ((5, 1, 2, 64), (5, 256, 1, 64), (5, 256, 1, 64))
  )
  lengths = np.array([200, 70, 256, 131, 9], np.int32)
  kwargs = dict(
    implementation="mosaic_gpu", precision="bf16-fa2", split_size=128,
    causal=True, causal_alignment="bottom_right", return_lse=True,
  )  # fmt: skip

  def row(order, k=k, v=v):
    order = np.asarray(order)
    out, lse = sa.attention(
      q[order], k[order], v[order],
      key_value_seq_lengths=lengths[order], **kwargs,
    )  # fmt: skip
    at = list(order).index(0)
    return np.asarray(out[at], np.float32), np.asarray(lse[at])

  alone = row([0])
  pad = ((0, 0), (0, 448 - 256), (0, 0), (0, 0))
  for got in (
    row([3, 1, 0, 4, 2]),
    row([0], jnp.pad(k, pad), jnp.pad(v, pad)),
  ):
    np.testing.assert_array_equal(got[0], alone[0])
    np.testing.assert_array_equal(got[1], alone[1])


def test_lengths_and_segments_skip_key_blocks_by_range():
  """Packed sequences of 64 tokens each: query block i visits key block i
  alone (dK dV: query block i for key block i), in the warp-specialized
  form too (each warpgroup reads the ranges through its own buffer and
  barrier), whose result is the interpreter form's bit for bit."""
  from stableattn.kernels import mosaic_plan as mp
  from stableattn.kernels.flash_attention import pad_operands
  from stableattn.ops import dispatch

  rng = np.random.default_rng(8)
  q, k, v = (
    jnp.asarray(rng.standard_normal((1, 192, 1, 64)), jnp.bfloat16)
    for _ in range(3)
  )
  segments = np.repeat(np.arange(3, dtype=np.int32), 64)[None]
  kwargs = dict(precision="bf16-fa2", segment_ids=segments)
  options, features = dispatch.split_keywords(None, None, kwargs)
  spec, ops = features.split(q.shape, k.shape)
  cfg = dispatch.kernel_config(options, q.shape, k.shape, spec)
  plan = mp.plan_of(cfg, 1)
  assert plan.block_ranges
  ops_p = pad_operands(ops, mp.tiled_config(cfg, plan))
  key_blocks, query_blocks = mp.range_rows(ops_p, cfg, plan, 1)
  diagonal = [[[0, 1], [1, 2], [2, 3]]]
  np.testing.assert_array_equal(key_blocks[..., :2], diagonal)
  np.testing.assert_array_equal(query_blocks[..., :2], diagonal)

  def out(form):
    return np.asarray(
      sa.attention(
        q, k, v, implementation="mosaic_gpu", hopper_form=form, **kwargs
      ),
      np.float32,
    )

  specialized = dataclasses.replace(
    cfg, options=dataclasses.replace(options, hopper_form="warp_specialized")
  )
  assert mp.plan_of(specialized, 1).block_ranges
  np.testing.assert_array_equal(out("interpreter"), out("warp_specialized"))


# Presets of every kind the Hopper path runs: FlashAttention-2's, 16-bit
# stages throughout, the framework's, the stable one.
RANDOM_PRESETS = (
  "bf16-fa2",
  "fp16-fa2",
  "bf16",
  "fp16-framework",
  "bf16-fa2-stable",
)


@pytest.mark.slow
@settings(max_examples=5, deadline=None)
@given(
  seed=st.integers(0, 10_000),
  q_len=st.integers(1, 150),
  kv_len=st.integers(1, 150),
  head_dim=st.sampled_from([16, 40, 64, 128]),
  kv_heads=st.sampled_from([1, 2]),
  precision=st.sampled_from(RANDOM_PRESETS),
)
def test_random_features_and_shapes_match_the_triton_path(
  seed, q_len, kv_len, head_dim, kv_heads, precision
):
  """The Triton path's random-feature draws (causal, windows, both
  alignments, lengths, unsorted segments) at random ragged shapes: the
  Hopper path's output and gradients are the Triton path's up to a
  summation order. Compared where the FP64 golden has signal (above
  2^-8 of its largest entry): at most 2% of those entries round the
  other way, each by at most 2^-8 of the tensor's largest entry (one
  rounding left out moves 11-64%)."""
  rng = np.random.default_rng(seed)
  features = random_features(rng, 2, q_len, kv_len)
  dtype = jnp.float16 if precision.startswith("fp16") else jnp.bfloat16
  q, k, v = (
    jnp.asarray(x, dtype)
    for x in random_qkv(
      seed, q_len=q_len, kv_len=kv_len, heads=2, kv_heads=kv_heads,
      head_dim=head_dim,
    )
  )  # fmt: skip
  d_out = rng.standard_normal(q.shape)
  wide = [np.asarray(x, np.float64) for x in (q, k, v)]
  golden = [
    sa.golden_attention(*wide, **features),
    *sa.golden_attention_vjp(*wide, d_out, **features),
  ]
  hopper, triton = (
    value_and_grads(
      q, k, v, d_out, implementation=path, precision=precision, **features
    )
    for path in ("mosaic_gpu", "pallas")
  )
  tensors = zip(
    ("out", "dq", "dk", "dv"), (hopper[0], *hopper[1]),
    (triton[0], *triton[1]), golden,
  )  # fmt: skip
  natural = max(np.abs(g).max(initial=0.0) for g in golden)
  for name, a, b, g in tensors:
    assert np.isfinite(a).all(), name
    scale = np.abs(g).max(initial=0.0)
    if scale <= 2.0**-20 * natural:
      # dS is 0 in exact arithmetic (one key per row): dQ and dK are
      # rounding noise on both paths, with no entry to compare.
      noise = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0))
      assert noise <= 2.0**-16 * natural, (name, noise, features)
      continue
    signal = np.abs(g) > 2.0**-8 * scale
    differ = int(np.sum((a != b) & signal))
    assert differ <= max(1, int(signal.sum()) // 50), (name, differ, features)
    largest = float(np.abs(a - b)[signal].max(initial=0.0))
    assert largest <= 2.0**-8 * scale, (name, largest, features)


def _mla_decode_shapes(batch=2, keys=300):
  """Absorbed MLA decoding: one query of 16 heads over one latent head."""
  q = jax.ShapeDtypeStruct((batch, 1, 16, 576), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((batch, keys, 1, 576), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((batch, keys, 1, 512), jnp.bfloat16)
  return q, k, v


def _lowered_forward(**features):
  from stableattn.harness.cuda_lowering import lowered_for_cuda

  def forward(q, k, v):
    return sa.attention(
      q, k, v, implementation="mosaic_gpu", interpret=False, **features
    )

  return lowered_for_cuda(jax.jit(forward), *_mla_decode_shapes())


def test_a_forward_over_shared_memory_is_refused_with_its_bytes():
  bias = np.zeros((1, 16, 1, 300), np.float32)
  with pytest.raises(
    ValueError, match=r"needs 240,688 bytes of shared memory.*232,448"
  ):
    _lowered_forward(bias=bias)


@pytest.mark.parametrize(
  "dims, keywords",
  [
    ((576, 512), {"key_value_seq_lengths": np.array([230, 300], np.int32)}),
    # Two compute warpgroups: each its own Q, P, O; one ring.
    ((256, 256), {"hopper_form": "two_consumers", "block_k": 128}),
  ],
  ids=["mla-lengths", "two-consumers-d256"],
)
def test_the_shared_memory_count_is_mosaic_gpus_own(
  monkeypatch, request, dims, keywords
):
  """With the budget lifted a plan that does not fit is kept, which
  Mosaic GPU's lowering refuses, naming its count: the plan's, byte for
  byte."""
  import re

  from stableattn.harness.cuda_lowering import lowered_for_cuda
  from stableattn.kernels import mosaic_attention, mosaic_plan
  from stableattn.kernels.mosaic_forward_block import shared_bytes
  from stableattn.ops import dispatch

  for module in (mosaic_attention, mosaic_plan):
    monkeypatch.setattr(module, "SHARED_MEMORY_BYTES", 10**9)
  # Traces at either budget must not outlive their budget.
  jax.clear_caches()
  request.addfinalizer(jax.clear_caches)
  d, dv = dims
  q = jax.ShapeDtypeStruct((2, 128, 16, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 300, 1, d), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((2, 300, 1, dv), jnp.bfloat16)
  kwargs = dict(interpret=False, **keywords)
  options, features = dispatch.split_keywords(None, None, kwargs)
  spec, _ = features.split(q.shape, k.shape)
  cfg = dispatch.kernel_config(options, q.shape, k.shape, spec, dv, False)
  plan = mosaic_plan.plan_of(cfg, 16)
  assert plan.ring_slots == 2 and shared_bytes(plan) > 232_448

  def forward(q, k, v):
    return sa.attention(q, k, v, implementation="mosaic_gpu", **kwargs)

  with pytest.raises(ValueError, match="exceeds available shared memory"):
    try:
      lowered_for_cuda(jax.jit(forward), q, k, v)
    except ValueError as error:
      counted = re.search(r"smem_bytes=(\d+)", str(error))
      assert counted and int(counted.group(1)) == shared_bytes(plan)
      raise
