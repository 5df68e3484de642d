"""The kernel as a drop-in `attention_fn` of flax.nnx.MultiHeadAttention."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import stableattn as sa
from stableattn.training.model import AttentionSpec

VOCAB, WIDTH, HEADS, LENGTH = 32, 32, 2, 24


class TwoLayerModel(nnx.Module):
  def __init__(self, attention_fn, *, rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

    def layer():
      return nnx.MultiHeadAttention(
        num_heads=HEADS,
        in_features=WIDTH,
        decode=False,
        attention_fn=attention_fn,
        rngs=rngs,
      )

    self.attention_0 = layer()
    self.attention_1 = layer()
    self.unembed = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.attention_0(x, is_causal=True)
    x = x + self.attention_1(x, is_causal=True)
    return self.unembed(x)


def _tokens():
  # A repeated random phrase: attention to the previous copy predicts it.
  phrase = np.random.default_rng(0).integers(0, VOCAB, size=(4, 8))
  return jnp.asarray(np.tile(phrase, (1, LENGTH // 8)))


def _loss(model, tokens):
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def _model(**kwargs):
  return TwoLayerModel(sa.make_attention_fn(**kwargs), rngs=nnx.Rngs(0))


def test_model_trains_with_pallas_attention():
  model = _model(
    implementation="pallas", precision="bf16-fa2", block_q=16, block_k=8
  )
  optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
  tokens = _tokens()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(_loss)(model, tokens)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(6)]
  assert all(np.isfinite(losses))
  assert losses[-1] < 0.8 * losses[0], losses


def _grads(**kwargs):
  model = _model(**kwargs)
  grads = nnx.jit(nnx.grad(_loss))(model, _tokens())
  return {
    "/".join(map(str, path)): np.asarray(leaf, np.float64)
    for path, leaf in jax.tree_util.tree_leaves_with_path(
      nnx.state(grads), is_leaf=lambda x: isinstance(x, jax.Array)
    )
  }


@pytest.mark.slow
def test_model_gradients_pass_fa_rule_against_reference_attention():
  flash = _grads(
    implementation="pallas", precision="bf16-fa2", block_q=16, block_k=8
  )
  baseline = _grads(implementation="reference", precision="bf16-fa2")
  # FP64 attention inside an FP32 model: accurate to FP32, far below the
  # BF16 errors under test.
  golden = _grads(implementation="reference", precision="fp64")
  assert flash.keys() == golden.keys() and len(golden) >= 10
  for name in golden:
    floor = sa.rounding_floor(golden[name], "bf16")
    assert sa.passes_fa_rule(
      golden[name], flash[name], baseline[name], factor=3.0, floor=floor
    ), name


def test_unsupported_flax_features_raise():
  attention_fn = sa.make_attention_fn(precision="fp32")
  x = jnp.ones((1, 8, 2, 16))
  with pytest.raises(ValueError, match="dropout"):
    attention_fn(x, x, x, dropout_rate=0.1, deterministic=False)
  with pytest.raises(ValueError, match="sow"):
    attention_fn(x, x, x, module=object())
  with pytest.raises(ValueError, match="broadcastable"):
    attention_fn(x, x, x, mask=jnp.ones((3, 1, 8, 8), bool))


def test_concrete_causal_mask_equals_is_causal():
  attention_fn = sa.make_attention_fn(precision="fp32", block_q=4, block_k=4)
  x = jnp.asarray(
    np.random.default_rng(0).standard_normal((1, 8, 2, 16)), jnp.float32
  )
  mask = nnx.make_causal_mask(jnp.ones((1, 8)))
  np.testing.assert_array_equal(
    attention_fn(x, x, x, mask=mask), attention_fn(x, x, x, is_causal=True)
  )


def test_tie_fix_passes_through_and_is_validated_up_front():
  x = jnp.asarray(
    np.random.default_rng(1).standard_normal((1, 16, 2, 16)), jnp.float32
  )
  fixed = sa.make_attention_fn(precision="fp32", tie_beta=2.0, block_k=8)
  plain = sa.make_attention_fn(precision="fp32", block_k=8)
  # Without ties the fix changes nothing; with them only roundings.
  np.testing.assert_allclose(
    fixed(x, x, x, is_causal=True), plain(x, x, x, is_causal=True), atol=1e-6
  )
  with pytest.raises(ValueError, match="finite number > 1"):
    sa.make_attention_fn(tie_beta=1.0)
  with pytest.raises(ValueError, match="finite number > 1"):
    AttentionSpec(kind="pallas", options=sa.Options(tie_beta=0.5))


def _flax_reference(x, mask):
  """Flax's own attention on the same inputs, FP32."""
  return nnx.dot_product_attention(x, x, x, mask=mask)


def test_padding_mask_with_causal_is_applied_not_dropped():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((2, 8, 2, 16)), jnp.float32)
  padding = jnp.asarray(np.arange(8) < 5)[None, None, None, :]  # 5 keys
  causal = nnx.make_causal_mask(jnp.ones((2, 8)))
  want = _flax_reference(x, jnp.logical_and(padding, causal))
  fn = sa.make_attention_fn(precision="fp32", block_q=4, block_k=4)
  for got in (
    fn(x, x, x, mask=padding, is_causal=True),
    sa.make_attention_fn(precision="fp32", causal=True, block_k=4)(
      x, x, x, mask=padding
    ),
    fn(x, x, x, mask=jnp.logical_and(padding, causal)),
  ):
    np.testing.assert_allclose(got, want, atol=1e-5)
  # Without causal the padding mask alone is applied too.
  np.testing.assert_allclose(
    fn(x, x, x, mask=padding), _flax_reference(x, padding), atol=1e-5
  )


def _padded_tokens(rng):
  """Token ids of two examples padded (id 0) to 8: 5 and 7 tokens."""
  tokens = rng.integers(1, 9, (2, 8))
  tokens[0, 5:] = 0
  tokens[1, 7:] = 0
  return jnp.asarray(tokens)


def test_every_flax_mask_reaches_the_kernel_under_jit():
  """Per-example padding from make_attention_mask, causal, their
  combination, a bias: as Flax's own attention on rows with a key."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 8, 2, 16)), jnp.float32)
  tokens = _padded_tokens(rng)
  padding = nnx.make_attention_mask(tokens > 0, tokens > 0)  # 0/1 floats
  causal = nnx.make_causal_mask(tokens)
  both = nnx.combine_masks(padding, causal)
  bias = jnp.asarray(rng.standard_normal((1, 2, 8, 8)), jnp.float32)
  fn = jax.jit(
    sa.make_attention_fn(precision="fp32", block_q=4, block_k=4),
    static_argnames="is_causal",
  )
  valid = np.asarray(tokens > 0)  # query rows with at least one key
  for mask, kwargs in (
    (padding, {}),
    (causal, {}),
    (both, {}),
    (padding, dict(is_causal=True)),
    (both, dict(bias=bias)),
  ):
    flax_mask = both if kwargs.get("is_causal") else mask
    want = nnx.dot_product_attention(
      x, x, x, mask=flax_mask, bias=kwargs.get("bias")
    )
    got = fn(x, x, x, mask=mask, **kwargs)
    np.testing.assert_allclose(
      np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5
    )
  # Padded query rows see no key: 0 here (Flax averages every value).
  got = fn(x, x, x, mask=padding)
  np.testing.assert_array_equal(np.asarray(got)[~valid], 0)


def test_linen_module_runs_our_attention_with_its_masks():
  from flax import linen

  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32)
  tokens = _padded_tokens(rng)
  mask = linen.combine_masks(
    linen.make_attention_mask(tokens > 0, tokens > 0),
    linen.make_causal_mask(tokens),
  )

  def module(attention_fn):
    return linen.MultiHeadDotProductAttention(
      num_heads=2, qkv_features=32, attention_fn=attention_fn
    )

  params = module(linen.dot_product_attention).init(
    jax.random.key(0), x, mask=mask
  )
  ours = sa.make_attention_fn(precision="fp32", block_q=4, block_k=4)
  got = jax.jit(module(ours).apply)(params, x, mask=mask)
  want = module(linen.dot_product_attention).apply(params, x, mask=mask)
  valid = np.asarray(tokens > 0)
  np.testing.assert_allclose(
    np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5
  )
