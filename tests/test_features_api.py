"""Options and Features as values: one object each, through every caller
(sa.attention, the Flax drop-in, the audit)."""

import audit_kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import stableattn as sa


def test_options_are_hashable_values_validated_once():
  a = sa.Options("bf16-fa2", block_q=32, block_k=32, tie_beta=2)
  assert a == sa.Options("bf16-fa2", 32, 32, tie_beta=2.0)
  assert hash(a) == hash(sa.Options("bf16-fa2", 32, 32, tie_beta=2.0))
  assert a.precision is sa.Precision.from_name("bf16-fa2")
  assert a.replace(block_q=64).block_q == 64
  assert sa.Options.from_string("block_q=16,tie_beta=4", a).tie_beta == 4.0
  for bad, message in [
    (dict(scheme="fa3"), "Unknown scheme 'fa3'"),
    (dict(block_q=0), "block_q must be a positive integer"),
    (dict(tie_beta=1.0), "finite number > 1"),
    (dict(precision="bf17"), "bf17"),
  ]:
    with pytest.raises(ValueError, match=message):
      sa.Options(**bad)
  with pytest.raises(ValueError, match="Unknown Options fields \\['warps'\\]"):
    a.replace(warps=4)


def test_keywords_and_values_give_the_same_call():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 48, 2, 16)), jnp.float32)
  opts = sa.Options("bf16-fa2", block_q=16, block_k=16)
  feats = sa.Features(causal=True, local_window_size=(8, 0), softcap=20.0)
  by_value = sa.attention(q, q, q, options=opts, features=feats)
  by_keyword = sa.attention(
    q,
    q,
    q,
    precision="bf16-fa2",
    block_q=16,
    block_k=16,
    causal=True,
    local_window_size=(8, 0),
    softcap=20.0,
  )
  np.testing.assert_array_equal(np.asarray(by_value), np.asarray(by_keyword))
  # A keyword over a value changes that field only.
  wider = sa.attention(q, q, q, options=opts, features=feats, softcap=None)
  assert not np.array_equal(np.asarray(wider), np.asarray(by_value))
  with pytest.raises(ValueError, match="Unknown attention arguments"):
    sa.attention(q, q, q, is_causal=True)


def test_features_pass_only_what_is_set():
  f = sa.Features(causal=True, softcap=30.0)
  assert f.kwargs() == {"causal": True, "softcap": 30.0}
  assert sa.Features().kwargs() == {}
  assert f == sa.Features(causal=True, softcap=30.0)
  assert hash(f) == hash(sa.Features(causal=True, softcap=30.0))
  with pytest.raises(ValueError, match="Unknown causal_alignment"):
    sa.Features(causal_alignment="middle")
  with pytest.raises(ValueError, match="Unknown features \\['window'\\]"):
    sa.Features.of(window=4)


class _Layer(nnx.Module):
  def __init__(self, attention_fn, rngs):
    self.attention = nnx.MultiHeadAttention(
      num_heads=2,
      in_features=32,
      qkv_features=32,
      decode=False,
      attention_fn=attention_fn,
      rngs=rngs,
    )

  def __call__(self, x):
    return self.attention(x, sow_weights=False)


def _softcapped_windowed(query, key, value, **unused):
  """What a Gemma/Mistral-style layer computes, in FP32 with jax's own
  attention: softcap * tanh(s / softcap) on the scaled logits, a causal
  sliding window of 64 keys to the left."""
  del unused
  scale = query.shape[-1] ** -0.5
  s = jnp.einsum("bthd,bshd->bhts", query, key) * scale
  s = 30.0 * jnp.tanh(s / 30.0)
  length = s.shape[-1]
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  allowed = (j <= i) & (j >= i - 64)
  s = jnp.where(allowed, s, -jnp.inf)
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), value)


def test_nnx_model_with_softcap_and_window_matches_jax():
  features = sa.Features(causal=True, local_window_size=(64, 0), softcap=30.0)
  ours = sa.make_attention_fn(
    sa.Options("fp32", block_q=32, block_k=32), features
  )
  x = jnp.asarray(
    np.random.default_rng(3).standard_normal((2, 128, 32)), jnp.float32
  )
  theirs_layer = _Layer(_softcapped_windowed, nnx.Rngs(0))
  ours_layer = _Layer(ours, nnx.Rngs(0))  # the same weights
  want = jax.jit(lambda m, x: m(x))(theirs_layer, x)
  got = jax.jit(lambda m, x: m(x))(ours_layer, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  # The window alone is jax's own local_window_size.
  plain = sa.make_attention_fn(
    sa.Options("fp32", block_q=32, block_k=32),
    sa.Features(causal=True, local_window_size=(64, 0)),
  )
  q = x.reshape(2, 128, 2, 16)
  np.testing.assert_allclose(
    np.asarray(plain(q, q, q)),
    np.asarray(
      jax.nn.dot_product_attention(
        q, q, q, is_causal=True, local_window_size=(64, 0)
      )
    ),
    atol=1e-5,
  )


AUDIT = dict(precision="fp32", shapes=((1, 128, 2, 16),), repeats=2)


def test_audit_of_a_windowed_kernel_passes_jax_and_names_the_window():
  report = sa.audit(
    audit_kernels.jax_windowed, features="causal,window", **AUDIT
  )
  assert report.passed, str(report)
  assert {r["features"] for r in report.rows} == {"causal,window"}
  bad = sa.audit(
    audit_kernels.ignores_window, features="causal,window", **AUDIT
  )
  assert not bad.passed
  assert bad.failures and all(
    "features causal,window" in f for f in bad.failures
  )


def test_audit_of_a_packed_kernel_and_a_kernel_without_the_feature():
  report = sa.audit(audit_kernels.jax_segments, features="segments", **AUDIT)
  assert report.passed, str(report)
  with pytest.raises(
    ValueError, match="does not accept the feature\\(s\\) \\['segment_ids'\\]"
  ):
    sa.audit(audit_kernels.jax_windowed, features="segments", **AUDIT)


@pytest.mark.slow
def test_tokamax_kernels_are_audited_with_features():
  """A peer library's kernels through the registry (the optional
  `[peers]` extra, which CI installs)."""
  pytest.importorskip("tokamax", reason="pip install -e '.[peers]'")
  from stableattn.ops import registry

  for name in ("tokamax_xla", "tokamax_xla_chunked"):
    fn = registry.resolve(name)
    report = sa.audit(fn, features="causal,window,softcap", **AUDIT)
    assert report.passed, (name, str(report))
  q = jnp.zeros((1, 16, 2, 16), jnp.float32)
  sink = jnp.zeros((2,), jnp.float32)
  with pytest.raises(ValueError, match="does not support the features"):
    registry.resolve("tokamax_xla")(q, q, q, sink=sink)
