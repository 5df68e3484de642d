"""`make_attention_fn`: our attention as Flax's `attention_fn` (nnx and
linen `MultiHeadAttention`)."""

from __future__ import annotations

import jax.numpy as jnp

from stableattn.dispatch import attention, check_tie_beta
from stableattn.precision import Precision


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
  *,
  implementation: str = "pallas",
  precision: str | Precision = "bf16-fa2",
  block_q: int = 64,
  block_k: int = 64,
  scheme: str = "fa2",
  causal: bool = False,
  interpret: bool | None = None,
  tie_beta: float | None = None,
):
  """An `attention_fn` for `flax.nnx.MultiHeadAttention` (and linen's).

  Every mask Flax builds reaches the kernel, under `jax.jit` too:
  `make_attention_mask` padding (per example), `make_causal_mask`,
  their `combine_masks`, any boolean or 0/1 mask broadcastable to [batch,
  heads, q_len, kv_len]; Flax's additive `bias` too. One difference from
  Flax's own attention: a query row whose keys are all masked gives 0
  here (Flax averages every value there).

  Args:
    implementation, precision, block_q, block_k, scheme, interpret,
      tie_beta: as for `stableattn.attention`.
    causal: always apply the causal mask (also applied when Flax passes
      `is_causal=True`); a `mask` is combined with it.

  Returns:
    A function with Flax's `dot_product_attention` signature. Its output is
    cast back to the query's dtype, as Flax's own attention returns it.

  Raises (when called):
    ValueError: for features the flash kernel does not have (dropout,
      sown attention weights) and for malformed masks.
  """

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
    mask = _as_4d(mask, "mask", query)
    if mask is not None and mask.dtype != bool:
      mask = mask != 0  # make_attention_mask builds 0/1 floats
    out = attention(
      query,
      key,
      value,
      implementation=implementation,
      precision=policy,
      block_q=block_q,
      block_k=block_k,
      scheme=scheme,
      causal=causal or bool(is_causal),
      mask=mask,
      bias=_as_4d(bias, "bias", query),
      interpret=interpret,
      tie_beta=tie_beta,
    )
    return out.astype(query.dtype)

  policy = Precision.from_name(precision)
  tie_beta = check_tie_beta(tie_beta)
  return attention_fn
