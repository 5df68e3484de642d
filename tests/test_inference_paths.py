"""Inference's ways of computing the same attention: split-KV, decoding
over a KV cache (padded or paged), and the invariances they keep or lose."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import sampled

import stableattn as sa
from stableattn.auditing.feature_recipes import FeatureRecipe
from stableattn.auditing.inputs import Shape

# A decode step: a few new queries over a longer, padded cache.
BATCH, Q_LEN, KV_LEN, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 150, 4, 2, 32
CACHE_LENGTHS = np.array([150, 97], np.int32)
DECODE = dict(
  causal=True,
  causal_alignment="bottom_right",
  key_value_seq_lengths=CACHE_LENGTHS,
)
TILES = dict(block_q=16, block_k=32)
# Every preset a Baseline can run too (the MMA accumulator's are the flash
# kernel's alone), FP64 aside.
NON_FP64 = [
  p
  for p in sa.preset_names()
  if p != "fp64" and not sa.Precision.from_name(p).mma_chunk
]


def _decode_inputs(seed=0, batch=BATCH, q_len=Q_LEN, kv_len=KV_LEN):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, q_len, HEADS, HEAD_DIM))
  k = rng.standard_normal((batch, kv_len, KV_HEADS, HEAD_DIM))
  v = rng.standard_normal((batch, kv_len, KV_HEADS, HEAD_DIM))
  return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def _f64(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float64))


# The presets the Hopper path runs: every one with 16-bit operands.
HOPPER_PRESETS = [
  p
  for p in NON_FP64
  if sa.Precision.from_name(p).matmul_operands in ("bf16", "fp16")
]


def _split_error_and_limit(preset, index, implementation, tiles):
  """FlashAttention-3's KV-cache test on one preset: (error of split-KV
  decoding against FP64, 2x the same-policy baseline's + 1e-5); the two
  split schedules alternate with `index`."""
  q, k, v = _decode_inputs(index)
  schedule = {"num_splits": 3} if index % 2 else {"split_size": 64}
  policy = sa.Precision.from_name(preset)
  if policy.softmax_stats != "fp32":
    policy = policy.with_stage(softmax_stats="fp32")
  golden = sa.golden_attention(q, k, v, **DECODE)
  split = sa.attention(
    q, k, v, implementation=implementation, precision=policy, **tiles,
    **schedule, **DECODE,
  )  # fmt: skip
  baseline = sa.attention(
    q, k, v, implementation="reference", precision=policy, **DECODE
  )
  error = float(np.max(np.abs(_f64(split) - golden)))
  limit = 2 * float(np.max(np.abs(_f64(baseline) - golden))) + 1e-5
  return error, limit


@pytest.mark.parametrize("preset", sampled(NON_FP64, 3))
def test_split_kv_passes_flashattention_kv_cache_rule(preset):
  """FlashAttention-3's KV-cache test: error against FP64 at most twice the
  same-policy baseline's, plus 1e-5; both split schedules alternate.

  The merge weighs each split by exp(lse_s - lse), so an lse held in half
  precision (the uniform presets' statistics) moves every weight by its
  rounding: there the rule holds once the statistics are FP32, as in
  every real split-KV kernel.
  """
  index = NON_FP64.index(preset)
  error, limit = _split_error_and_limit(preset, index, "pallas", TILES)
  assert np.isfinite(error) and error <= limit, (preset, error, limit)


@pytest.mark.parametrize("preset", sampled(HOPPER_PRESETS, 1))
def test_hopper_split_kv_passes_flashattention_kv_cache_rule(preset):
  """The same rule on the Hopper path, for every preset it runs (its
  own tiles; split_size a multiple of its 64-key block)."""
  index = HOPPER_PRESETS.index(preset)
  error, limit = _split_error_and_limit(preset, index, "mosaic_gpu", {})
  assert np.isfinite(error) and error <= limit, (preset, error, limit)


@pytest.mark.parametrize(
  "recipe",
  sampled(["lengths", "window", "segments", "softcap", "sink", "alibi"], 2),
)
def test_every_feature_works_with_splits(recipe):
  """In FP32 the split result is the unsplit one up to a few ulps of the
  output, and its merged lse matches FP64's; the sink counts once."""
  shape = Shape(batch=2, q_len=64, kv_len=96, heads=2, kv_heads=2, head_dim=16)
  features = FeatureRecipe.from_names(f"causal,{recipe}").build(shape)
  rng = np.random.default_rng(3)
  q, k, v = (
    rng.standard_normal(s).astype(np.float32)
    for s in ((2, 64, 2, 16), (2, 96, 2, 16), (2, 96, 2, 16))
  )
  kwargs = dict(precision="fp32", features=features, return_lse=True, **TILES)
  whole, whole_lse = sa.attention(q, k, v, **kwargs)
  split, split_lse = sa.attention(q, k, v, num_splits=3, **kwargs)
  golden = sa.golden_attention(q, k, v, **features.kwargs())
  largest = float(np.max(np.abs(golden)))
  assert float(np.max(np.abs(_f64(split) - _f64(whole)))) <= 8 * (
    largest * 2.0**-23
  )
  assert float(np.max(np.abs(_f64(split) - golden))) <= 1e-5
  finite = np.isfinite(_f64(whole_lse))
  np.testing.assert_array_equal(finite, np.isfinite(_f64(split_lse)))
  np.testing.assert_allclose(
    _f64(split_lse)[finite], _f64(whole_lse)[finite], rtol=1e-6
  )


def test_split_options_are_validated():
  with pytest.raises(ValueError, match="give one of them"):
    sa.Options(num_splits=2, split_size=64)
  with pytest.raises(ValueError, match="num_splits must be a positive"):
    sa.Options(num_splits=0)
  q, k, v = _decode_inputs()
  with pytest.raises(ValueError, match="multiple of block_k=32"):
    sa.attention(q, k, v, split_size=48, **TILES)


def test_fixed_split_size_is_batch_and_padding_invariant():
  """A row alone, in batches of 7 and 24 at a random position, and over a
  cache padded to a longer length: bitwise the same output and lse."""
  rng = np.random.default_rng(5)
  q, k, v = _decode_inputs(6, batch=64, q_len=1, kv_len=128)
  lengths = rng.integers(20, 129, size=64).astype(np.int32)
  kwargs = dict(
    precision="bf16-fa2",
    split_size=64,
    causal=True,
    causal_alignment="bottom_right",
    return_lse=True,
    **TILES,
  )

  def row(batch_q, batch_k, batch_v, batch_lengths, at):
    out, lse = sa.attention(
      batch_q, batch_k, batch_v, key_value_seq_lengths=batch_lengths, **kwargs
    )
    return np.asarray(out[at]), np.asarray(lse[at])

  alone = row(q[:1], k[:1], v[:1], lengths[:1], 0)
  for size in (7, 24):
    others = rng.choice(np.arange(1, 64), size=size - 1, replace=False)
    at = int(rng.integers(size))
    order = np.insert(others, at, 0)
    got = row(q[order], k[order], v[order], lengths[order], at)
    np.testing.assert_array_equal(got[0], alone[0])
    np.testing.assert_array_equal(got[1], alone[1])
  # The same keys in a longer cache: the extra splits hold only padding.
  pad = ((0, 0), (0, 320 - 128), (0, 0), (0, 0))
  padded = row(q[:1], np.pad(k[:1], pad), np.pad(v[:1], pad), lengths[:1], 0)
  np.testing.assert_array_equal(padded[0], alone[0])
  np.testing.assert_array_equal(padded[1], alone[1])


def test_split_count_changes_bits_but_not_accuracy():
  """num_splits moves the merge order: some bits change, the error
  against FP64 stays at the unsplit kernel's size."""
  q, k, v = _decode_inputs(8)
  golden = sa.golden_attention(q, k, v, **DECODE)
  outs = {
    n: _f64(
      sa.attention(
        q, k, v, precision="bf16-fa2", num_splits=n, **TILES, **DECODE
      )
    )
    for n in (1, 2, 5)
  }
  whole = _f64(sa.attention(q, k, v, precision="bf16-fa2", **TILES, **DECODE))
  np.testing.assert_array_equal(outs[1], whole)
  assert not np.array_equal(outs[2], outs[5])
  errors = [float(np.max(np.abs(o - golden))) for o in outs.values()]
  assert max(errors) <= 2 * min(errors)


# The Hopper path's decode over a padded cache is in the fast tier through
# its split-KV case (test_hopper_split_kv_passes_...); this one is slow.
@pytest.mark.parametrize(
  "implementation",
  [
    pytest.param(i, marks=pytest.mark.slow) if i == "mosaic_gpu" else i
    for i in sa.IMPLEMENTATIONS
    if i != "flash"
  ],
)
def test_decode_over_a_padded_cache_for_every_implementation(implementation):
  """Queries 1..n at the end of a padded cache (bottom-right alignment,
  per-example lengths): each implementation against FP64 (the Hopper
  path, which takes 16-bit operands only, under bf16-fa2 and
  FlashAttention's rule against that policy's Baseline)."""
  hopper = implementation == "mosaic_gpu"
  precision = "bf16-fa2" if hopper else "fp32"
  for q_len in (1, 3):
    q, k, v = _decode_inputs(9, q_len=q_len)
    golden = sa.golden_attention(q, k, v, **DECODE)
    out = sa.attention(
      q, k, v, implementation=implementation, precision=precision, **DECODE
    )
    error = float(np.max(np.abs(_f64(out) - golden)))
    limit = 1e-5
    if hopper:
      base = sa.attention(
        q, k, v, implementation="reference", precision=precision, **DECODE
      )
      limit += 2 * float(np.max(np.abs(_f64(base) - golden)))
    assert error <= limit, (error, limit)
    # Keys past a sequence's length change nothing.
    k2, v2 = k.copy(), v.copy()
    k2[1, 97:], v2[1, 97:] = 1e3, -1e3
    out2 = sa.attention(
      q, k2, v2, implementation=implementation, precision=precision, **DECODE
    )
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))


def _paged(k, v, page_size, rng, spare=3):
  """A shuffled page pool holding k and v, and its page table."""
  batch, kv_len = k.shape[:2]
  per_sequence = -(-kv_len // page_size)
  pad = ((0, 0), (0, per_sequence * page_size - kv_len), (0, 0), (0, 0))
  k, v = np.pad(k, pad), np.pad(v, pad)
  pages = batch * per_sequence
  slots = rng.permutation(pages + spare)[:pages].reshape(batch, per_sequence)
  pool_shape = (pages + spare, page_size, *k.shape[2:])
  k_pool = rng.standard_normal(pool_shape).astype(k.dtype)  # spare: noise
  v_pool = rng.standard_normal(pool_shape).astype(v.dtype)
  k_pool[slots] = k.reshape(batch, per_sequence, page_size, *k.shape[2:])
  v_pool[slots] = v.reshape(batch, per_sequence, page_size, *v.shape[2:])
  return k_pool, v_pool, slots.astype(np.int32)


@pytest.mark.parametrize("schedule", [{}, {"split_size": 64}])
def test_paged_cache_equals_the_contiguous_cache(schedule):
  """Pages scattered in a pool and read through the table: bitwise the
  contiguous kernel's output and lse; the reference likewise."""
  rng = np.random.default_rng(10)
  q, k, v = _decode_inputs(10)
  k_pool, v_pool, table = _paged(k, v, 32, rng)
  cache_len = table.shape[1] * 32
  pad = ((0, 0), (0, cache_len - KV_LEN), (0, 0), (0, 0))
  k_c, v_c = np.pad(k, pad), np.pad(v, pad)
  kwargs = dict(precision="bf16-fa2", **TILES, **schedule, **DECODE)
  paged = sa.paged_attention(
    q, k_pool, v_pool, table, return_lse=True, **kwargs
  )
  whole = sa.attention(q, k_c, v_c, return_lse=True, **kwargs)
  for got, want in zip(paged, whole):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(sa.gather_pages(k_pool, table), k_c)
  reference = dict(implementation="reference", precision="bf16-fa2", **DECODE)
  np.testing.assert_array_equal(
    np.asarray(sa.paged_attention(q, k_pool, v_pool, table, **reference)),
    np.asarray(sa.attention(q, k_c, v_c, **reference)),
  )


@pytest.mark.parametrize(
  "implementation, contiguous",
  [
    ("flash", "pallas"),
    pytest.param("mosaic_gpu", "mosaic_gpu", marks=pytest.mark.slow),
  ],
)
def test_paged_cache_under_flash_is_read_in_place_and_gathered_for_hopper(
  implementation, contiguous
):
  """ "flash" reads the pages in place (the Triton path's kernel, bit for
  bit); the Hopper path, in GPU interpret mode, computes on the pages
  gathered exactly what it computes on the contiguous cache."""
  rng = np.random.default_rng(12)
  q, k, v = _decode_inputs(12, kv_len=128)
  k_pool, v_pool, table = _paged(k, v, 64, rng)
  kwargs = dict(
    precision="bf16-fa2",
    **{**DECODE, "key_value_seq_lengths": np.array([128, 97])},
  )
  paged = sa.paged_attention(
    q, k_pool, v_pool, table, implementation=implementation, **kwargs
  )
  whole = sa.attention(q, k, v, implementation=contiguous, **kwargs)
  np.testing.assert_array_equal(np.asarray(paged), np.asarray(whole))


def test_paged_cache_errors_say_what_is_valid():
  rng = np.random.default_rng(11)
  q, k, v = _decode_inputs(11)
  k_pool, v_pool, table = _paged(k, v, 32, rng)
  with pytest.raises(ValueError, match=r"entries must be pool pages in \[0,"):
    sa.paged_attention(q, k_pool, v_pool, table + 100)
  with pytest.raises(ValueError, match="multiple of block_k=64"):
    sa.paged_attention(q, k_pool, v_pool, table, block_k=64)
  with pytest.raises(ValueError, match="integer dtype"):
    sa.paged_attention(q, k_pool, v_pool, table.astype(np.float32))
  with pytest.raises(ValueError, match="rank-4 page pool"):
    sa.paged_attention(q, k_pool[0], v_pool, table)


@pytest.mark.slow
def test_fixed_tiles_make_decode_and_chunked_prefill_bitwise_in_fp32():
  """With the tiles kept at their size for a short call, a query decoded
  alone and prefill chunks compute exactly as the full causal pass, in
  FP32 where every ulp shows, with and without a fixed split size."""
  rng = np.random.default_rng(12)
  q, k, v = (
    rng.standard_normal((1, 128, 2, 32)).astype(np.float32) for _ in "qkv"
  )
  for split in ({}, {"split_size": 64}):
    options = dict(precision="fp32", fixed_tiles=True, **split)
    full = np.asarray(sa.attention(q, k, v, causal=True, **options))
    decoded = [
      sa.attention(
        q[:, t : t + 1],
        k,
        v,
        key_value_seq_lengths=np.array([t + 1], np.int32),
        **options,
      )
      for t in (0, 5, 77, 127)
    ]
    np.testing.assert_array_equal(
      np.concatenate(decoded, axis=1), full[:, [0, 5, 77, 127]]
    )
    chunks = [
      sa.attention(
        q[:, s : s + 32],
        k[:, : s + 32],
        v[:, : s + 32],
        causal=True,
        causal_alignment="bottom_right",
        **options,
      )
      for s in range(0, 128, 32)
    ]
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), full)
  with pytest.raises(ValueError, match="fixed_tiles must be"):
    sa.Options(fixed_tiles="yes")
