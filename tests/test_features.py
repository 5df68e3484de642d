"""Attention features (masks, segments, windows, softcap, scale, bias,
sink) in every implementation: against `jax.nn.dot_product_attention`,
against the FP64 golden under FlashAttention's rule, and where no key
attends."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_features, random_qkv, sampled

import stableattn as sa
from stableattn.contract import masking

BATCH, Q_LEN, KV_LEN, HEADS, KV_HEADS, HEAD_DIM = 2, 40, 56, 4, 2, 16
TILES = dict(block_q=16, block_k=16, bwd_block_k=32)


def _inputs(seed, q_len=Q_LEN, kv_len=KV_LEN):
  q, k, v = random_qkv(
    seed,
    batch=BATCH,
    q_len=q_len,
    kv_len=kv_len,
    heads=HEADS,
    kv_heads=KV_HEADS,
    head_dim=HEAD_DIM,
  )
  d_out = np.random.default_rng(seed + 100).standard_normal(q.shape)
  return [x.astype(np.float32) for x in (q, k, v, d_out)]


def _outputs_and_grads(fn, q, k, v, d_out, differentiable):
  """fn(q, k, v, *differentiable) and its gradients for d_out."""
  out, vjp = jax.vjp(fn, q, k, v, *differentiable)
  return np.asarray(out), [np.asarray(g) for g in vjp(jnp.asarray(d_out))]


def _dense_mask(seed, shape):
  mask = np.random.default_rng(seed).random(shape) < 0.7
  mask[..., np.arange(Q_LEN), np.arange(Q_LEN)] = True  # every row a key
  return mask


# Each case exercises jax's own arguments; rows that jax leaves without a
# key (it averages every value there) are avoided.
JAX_CASES = {
  "bias_scale_causal_window_lengths": dict(
    bias=np.random.default_rng(1).standard_normal((1, HEADS, Q_LEN, KV_LEN)),
    scale=0.37,
    is_causal=True,
    local_window_size=(5, 3),
    key_value_seq_lengths=np.array([KV_LEN, 38], np.int32),
  ),
  "mask_lengths_per_head_bias": dict(
    mask=_dense_mask(2, (BATCH, 1, Q_LEN, KV_LEN)),
    bias=np.random.default_rng(3).standard_normal(
      (BATCH, HEADS, Q_LEN, KV_LEN)
    ),
    query_seq_lengths=np.array([Q_LEN, 23], np.int32),
    key_value_seq_lengths=np.array([31, KV_LEN], np.int32),
  ),
}


@pytest.mark.parametrize("name", sampled(list(JAX_CASES), 1))
def test_pallas_matches_jax_dot_product_attention_in_fp32(name):
  """Forward and gradients (bias included) agree to 1e-5 in FP32."""
  kw = dict(JAX_CASES[name])
  q, k, v, d_out = _inputs(7)
  bias = kw.pop("bias", None)
  biases = () if bias is None else (jnp.asarray(bias, jnp.float32),)
  ours_kw = dict(kw)
  ours_kw["causal"] = ours_kw.pop("is_causal", False)

  def ours(q, k, v, *bias):
    return sa.attention(
      q,
      k,
      v,
      precision="fp32",
      bias=bias[0] if bias else None,
      **ours_kw,
      **TILES,
    )

  def theirs(q, k, v, *bias):
    return jax.nn.dot_product_attention(
      q, k, v, bias=bias[0] if bias else None, implementation="xla", **kw
    )

  with jax.default_matmul_precision("highest"):
    want, want_grads = _outputs_and_grads(theirs, q, k, v, d_out, biases)
  got, got_grads = _outputs_and_grads(ours, q, k, v, d_out, biases)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  for name_, g, w in zip(("dq", "dk", "dv", "dbias"), got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=name_)


def _segments(seed, length, n_segments=3):
  """Sorted segment ids [BATCH, length]: packed sequences."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, length), n_segments - 1, False))
  ids = np.zeros(length, np.int32)
  for c in cuts:
    ids[c:] += 1
  return np.stack([ids, ids[::-1].max() - ids[::-1]])


# FlashAttention's test grid (tests/test_flash_attn.py): ragged lengths
# such as (113, 203), softcap 50 (and a tighter 15), random windows,
# variable lengths, bottom-right causal; plus packed segments and a sink.
FA_Q_LEN, FA_KV_LEN = 113, 203


def _fa_segments():
  q_ids = np.repeat(np.array([0, 1, 2]), [40, 40, 33])
  kv_ids = np.repeat(np.array([0, 1, 2]), [70, 70, 63])
  return (np.stack([q_ids, q_ids]), np.stack([kv_ids, kv_ids]))


FA_GRID_CASES = {
  "softcap_50_bottom_right_causal": dict(
    softcap=50.0, causal=True, causal_alignment="bottom_right"
  ),
  "window_sink": dict(
    local_window_size=(31, 17),
    causal_alignment="bottom_right",
    sink=np.array([0.5, -1.0], np.float32),
  ),
  "varlen_segments_causal": dict(
    query_seq_lengths=np.array([FA_Q_LEN, 50], np.int32),
    key_value_seq_lengths=np.array([120, FA_KV_LEN], np.int32),
    segment_ids=_fa_segments(),
    causal=True,
    causal_alignment="bottom_right",
  ),
}


@pytest.mark.parametrize("flash_path", ["pallas", "mosaic_gpu"])
@pytest.mark.parametrize("name", sampled(list(FA_GRID_CASES), 1))
def test_features_pass_the_flashattention_rule_against_golden(name, flash_path):
  """Under the FlashAttention-2 policy (BF16 matmul operands and P, FP32
  elsewhere) each of our flash paths' error is <= 2x the Baseline's + 1e-5
  against the FP64 golden (FlashAttention's test rule), output and every
  gradient, the sink's included."""
  kw = dict(FA_GRID_CASES[name])
  q, k, v = (
    x.astype(np.float32)
    for x in random_qkv(
      3,
      batch=2,
      q_len=FA_Q_LEN,
      kv_len=FA_KV_LEN,
      heads=2,
      kv_heads=1,
      head_dim=64,
    )
  )
  d_out = np.random.default_rng(4).standard_normal(q.shape).astype(np.float32)
  sink = kw.pop("sink", None)
  extra = () if sink is None else (jnp.asarray(sink),)

  def run(implementation):
    def fn(q, k, v, *sink):
      return sa.attention(
        q,
        k,
        v,
        implementation=implementation,
        precision="bf16-fa2",
        sink=sink[0] if sink else None,
        **kw,
      ).astype(jnp.float32)

    return _outputs_and_grads(fn, q, k, v, d_out, extra)

  golden_kw = dict(kw, sink=sink) if sink is not None else kw
  want = [sa.golden_attention(q, k, v, **golden_kw)]
  want += list(sa.golden_attention_vjp(q, k, v, d_out, **golden_kw))
  (out, grads), (base, base_grads) = run(flash_path), run("reference")
  names = ["output", "dq", "dk", "dv", "dsink"]
  for what, w, c, b in zip(names, want, [out, *grads], [base, *base_grads]):
    assert sa.passes_fa_rule(w, c, b, floor=1e-5), (
      f"{name} {flash_path} {what}: error {np.max(np.abs(c - w)):.3g} vs "
      f"Baseline {np.max(np.abs(b - w)):.3g}"
    )


EMPTY_ROWS = dict(
  query_seq_lengths=np.array([0, 17], np.int32),
  segment_ids=(
    np.repeat(np.array([[0, 5], [1, 2]], np.int32), Q_LEN // 2, axis=1),
    np.repeat(np.array([[0, 1], [1, 1]], np.int32), KV_LEN // 2, axis=1),
  ),
)


@pytest.mark.parametrize(
  "implementation, precision",
  [
    *(
      (implementation, precision)
      for implementation in ("pallas", "reference")
      for precision in ("bf16", "fp32")
    ),
    # Its own tiles; 16-bit operands only.
    ("mosaic_gpu", "bf16-fa2"),
    pytest.param("mosaic_gpu", "bf16", marks=pytest.mark.slow),
  ],
)
def test_rows_no_key_attends_give_zero_and_zero_gradient(
  implementation, precision
):
  """Padded queries and a query segment with no key: output 0, gradients
  finite and 0 where only such rows contribute; never NaN."""
  q, k, v, d_out = _inputs(5)
  tiles = {} if implementation == "mosaic_gpu" else TILES

  def fn(q, k, v):
    return sa.attention(
      q,
      k,
      v,
      implementation=implementation,
      precision=precision,
      **EMPTY_ROWS,
      **tiles,
    ).astype(jnp.float32)

  out, grads = _outputs_and_grads(fn, q, k, v, d_out, ())
  assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)
  empty = np.zeros((BATCH, Q_LEN), bool)
  empty[0] = True  # query length 0
  empty[1, 17:] = True  # padded queries
  empty[1, :17] = False
  empty[0, Q_LEN // 2 :] = True  # segment 5 has no key in example 0
  assert (out[empty] == 0).all()
  assert (grads[0][empty] == 0).all()  # dq of those rows
  np.testing.assert_array_equal(out[0], 0)
  # Example 0 attends nothing, so its keys get no gradient.
  assert (grads[1][0] == 0).all() and (grads[2][0] == 0).all()
  golden = sa.golden_attention(q, k, v, **EMPTY_ROWS)
  np.testing.assert_array_equal(golden[empty], 0)


@pytest.mark.parametrize(
  "implementation, options",
  [
    ("pallas", {"precision": "fp32", **TILES}),
    # Its own tiles; 16-bit operands only.
    ("mosaic_gpu", {"precision": "bf16-fa2"}),
  ],
)
def test_empty_rows_with_a_sink_attend_only_the_sink(implementation, options):
  q, k, v, _ = _inputs(6)
  sink = np.zeros(HEADS, np.float32)
  lengths = np.array([0, Q_LEN], np.int32)
  kwargs = dict(
    implementation=implementation,
    query_seq_lengths=lengths,
    return_lse=True,
    **options,
  )
  out, lse = sa.attention(q, k, v, sink=sink, **kwargs)
  np.testing.assert_array_equal(np.asarray(out)[0], 0)
  np.testing.assert_array_equal(np.asarray(lse)[0], 0.0)  # log(exp(sink))
  _, lse = sa.attention(q, k, v, **kwargs)
  assert np.isposinf(np.asarray(lse)[0]).all()  # FlashAttention's +inf


@pytest.mark.parametrize("seed", range(12))
def test_skipped_blocks_hold_no_attending_pair(seed):
  """Every block outside a block range is empty in the dense mask, so
  skipping it cannot change a result."""
  rng = np.random.default_rng(seed)
  spec, ops = sa.Features(**random_features(rng, BATCH, Q_LEN, KV_LEN)).split(
    (BATCH, Q_LEN, HEADS, HEAD_DIM), (BATCH, KV_LEN, KV_HEADS, HEAD_DIM)
  )
  if not spec.skips_blocks:
    return
  bq, bk = 8, 16
  padded = dict(q_ids=None, kv_ids=None, kv_pos=None)
  q_pad, kv_pad = 48, 64
  if spec.token_ids:
    padded["q_ids"] = jnp.pad(
      ops.q_ids,
      ((0, 0), (0, q_pad - Q_LEN)),
      constant_values=masking.QUERY_PAD_ID,
    )
    padded["kv_ids"] = jnp.pad(
      ops.kv_ids,
      ((0, 0), (0, kv_pad - KV_LEN)),
      constant_values=masking.KEY_PAD_ID,
    )
  if spec.key_positions:
    padded["kv_pos"] = jnp.pad(
      ops.kv_pos, ((0, 0), (0, kv_pad - KV_LEN)), mode="edge"
    )
  key_ranges, query_ranges = masking.block_ranges(
    spec,
    masking.MaskOperands(**padded),
    q_len_padded=q_pad,
    kv_len_padded=kv_pad,
    kv_len=KV_LEN,
    bq=bq,
    bk=bk,
  )
  allowed = np.broadcast_to(
    np.asarray(masking.allowed_pairs(spec, ops, Q_LEN, KV_LEN))[:, 0],
    (BATCH, Q_LEN, KV_LEN),
  )
  allowed = np.pad(allowed, ((0, 0), (0, q_pad - Q_LEN), (0, kv_pad - KV_LEN)))
  blocks = allowed.reshape(BATCH, q_pad // bq, bq, kv_pad // bk, bk)
  occupied = blocks.any(axis=(2, 4))  # [B, nQ, nK]
  key_ranges = np.broadcast_to(key_ranges, (BATCH,) + key_ranges.shape[1:])
  query_ranges = np.broadcast_to(
    query_ranges, (BATCH,) + query_ranges.shape[1:]
  )
  for b in range(BATCH):
    for i in range(q_pad // bq):
      lo, hi = key_ranges[b, i]
      outside = np.ones(kv_pad // bk, bool)
      outside[lo:hi] = False
      assert not occupied[b, i, outside].any()
    for j in range(kv_pad // bk):
      lo, hi = query_ranges[b, j]
      outside = np.ones(q_pad // bq, bool)
      outside[lo:hi] = False
      assert not occupied[b, outside, j].any()


def test_a_window_skips_most_key_blocks():
  """A (16, 0) window at length 256 with 16-wide tiles: each query block
  visits at most 2 of the 16 key blocks."""
  spec, ops = sa.Features(local_window_size=(16, 0)).split(
    (1, 256, 1, 16), (1, 256, 1, 16)
  )
  key_ranges, _ = masking.block_ranges(
    spec, ops, q_len_padded=256, kv_len_padded=256, kv_len=256, bq=16, bk=16
  )
  visits = np.diff(np.asarray(key_ranges)[0], axis=-1)
  assert visits.max() == 2 and visits.sum() == 31


BAD_FEATURES = [
  (dict(causal_alignment="bottom-right"), "causal_alignment"),
  (dict(local_window_size=(3,)), "local_window_size"),
  (dict(local_window_size=(-2, 3)), "local_window_size"),
  (dict(local_window_size=True), "local_window_size"),
  (dict(query_seq_lengths=np.array([3])), "query_seq_lengths"),
  (dict(query_seq_lengths=np.array([3.0, 4.0])), "integer dtype"),
  (dict(key_value_seq_lengths=np.array([3, KV_LEN + 1])), r"\[0, 56\]"),
  (dict(segment_ids=np.zeros((BATCH, Q_LEN), np.int32)), "segment_ids"),
  (dict(bias=np.zeros((BATCH, 3, Q_LEN, KV_LEN))), "bias must be a 4-D"),
  (dict(mask=np.ones((1, 1, Q_LEN, KV_LEN))), "mask must be boolean"),
  (dict(sink=np.zeros(KV_HEADS)), "sink must be"),
  (dict(softcap=0.0), "softcap"),
  (dict(softcap=float("inf")), "softcap"),
  (dict(scale="0.1"), "scale"),
  (dict(causal="no"), "causal must be True or False"),
]


@pytest.mark.parametrize(
  "kwargs, message", BAD_FEATURES, ids=[str(b[0])[:40] for b in BAD_FEATURES]
)
def test_bad_feature_arguments_raise_clearly(kwargs, message):
  q, k, v, _ = _inputs(0)
  with pytest.raises(ValueError, match=message):
    sa.attention(q, k, v, **kwargs)
  with pytest.raises(ValueError, match=message):
    sa.golden_attention(q, k, v, **kwargs)


def test_xla_refuses_what_jax_does_not_have():
  q, k, v, _ = _inputs(0)
  for kwargs in (dict(softcap=30.0), dict(sink=np.zeros(HEADS, np.float32))):
    with pytest.raises(ValueError, match="not supported by implementation"):
      sa.attention(q, k, v, implementation="xla", precision="fp32", **kwargs)
