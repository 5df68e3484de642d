"""`make_attention_fn`: our attention as Flax's `attention_fn` (nnx and
linen `MultiHeadAttention`)."""

from __future__ import annotations

import jax.numpy as jnp

from stableattn.contract.features import Features
from stableattn.contract.options import Options
from stableattn.ops.dispatch import attention, split_keywords


def _refuse_unsupported(dropout_rate, deterministic, module) -> None:
  """Raises for the Flax options the flash kernel does not have."""
  if dropout_rate > 0.0 and not deterministic:
    raise ValueError(
      f"make_attention_fn does not support attention dropout (got "
      f"dropout_rate={dropout_rate}); use dropout_rate=0 or "
      "deterministic=True."
    )
  if module is not None:
    raise ValueError(
      "make_attention_fn never materializes attention weights, so it "
      "cannot sow them; call the module with sow_weights=False."
    )


def _as_4d(x, name: str, query):
  """Flax's [batch..., heads|1, q_len, kv_len] as [batch|1, heads|1, ...]."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.ndim > 4:
    raise ValueError(
      f"make_attention_fn needs a {name} of at most 4 dimensions [batch, "
      f"heads, q_len, kv_len] for inputs [batch, seq, heads, head_dim]; got "
      f"shape {x.shape} for query {query.shape}."
    )
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def make_attention_fn(
  options: Options | None = None,
  features: Features | None = None,
  *,
  implementation: str = "pallas",
  **keywords,
):
  """An `attention_fn` for `flax.nnx.MultiHeadAttention` (and linen's).

  Every mask Flax builds reaches the kernel, under `jax.jit` too:
  `make_attention_mask` padding (per example), `make_causal_mask`,
  their `combine_masks`, any boolean or 0/1 mask broadcastable to [batch,
  heads, q_len, kv_len]; Flax's additive `bias` too. Features Flax has no
  argument for (a softcap, a sliding window, a sink, the scale, ...) come
  from `features` and are combined with Flax's masks. One difference
  from Flax's own attention: a query row whose keys are all masked gives
  0 here (Flax averages every value there).

  Args:
    options: how to compute (`stableattn.Options`); None: Options with
      precision "bf16-fa2", a flash kernel's natural policy.
    features: what to compute on top of Flax's masks
      (`stableattn.Features`): `causal` always applies the causal mask
      (also applied when Flax passes `is_causal=True`); a Flax mask is
      combined with `features.mask`, a Flax bias added to `features.bias`.
    implementation: as for `stableattn.attention`.
    **keywords: fields of `Options` or `Features` by name, over the two.

  Returns:
    A function with Flax's `dot_product_attention` signature. Its output is
    cast back to the query's dtype, as Flax's own attention returns it.

  Raises:
    ValueError: for unknown options or features (at once); when called,
      for features the flash kernel does not have (dropout, sown
      attention weights) and for malformed masks.
  """
  if options is None and "precision" not in keywords:
    keywords["precision"] = "bf16-fa2"
  options, features = split_keywords(options, features, keywords)

  def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal=False,
  ):
    del broadcast_dropout, dropout_rng, dtype, precision, promote_dtype
    _refuse_unsupported(dropout_rate, deterministic, module)
    if query.ndim != 4:
      raise ValueError(
        "make_attention_fn needs inputs [batch, seq, heads, head_dim]; got "
        f"query shape {query.shape}."
      )
    out = attention(
      query,
      key,
      value,
      implementation=implementation,
      options=options,
      features=_with_flax(features, query, bias, mask, is_causal),
    )
    return out.astype(query.dtype)

  return attention_fn


def _with_flax(features: Features, query, bias, mask, is_causal) -> Features:
  """`features` with Flax's per-call mask, bias and `is_causal`."""
  mask = _as_4d(mask, "mask", query)
  if mask is not None and mask.dtype != bool:
    mask = mask != 0  # make_attention_mask builds 0/1 floats
  if mask is not None and features.mask is not None:
    mask = jnp.logical_and(mask, features.mask)
  bias = _as_4d(bias, "bias", query)
  if bias is not None and features.bias is not None:
    bias = bias + features.bias
  return features.replace(
    causal=features.causal or bool(is_causal),
    mask=features.mask if mask is None else mask,
    bias=features.bias if bias is None else bias,
  )
