"""`make_attention_fn`: our attention as `flax.nnx.MultiHeadAttention`'s."""

from __future__ import annotations

import numpy as np

from stableattn.dispatch import attention, check_tie_beta
from stableattn.precision import Precision


def _mask_as_causal_flag(mask, q_len: int, kv_len: int) -> bool:
  """True for a causal mask, False for an all-True mask; raises otherwise."""
  try:
    mask = np.asarray(mask).astype(bool)
  except Exception as e:  # a tracer: the values are unknown at trace time
    raise ValueError(
      "make_attention_fn cannot use an attention mask computed under jit: "
      "the flash kernel supports only 'no mask' and the causal mask. Pass "
      "is_causal=True to the module call (or make_attention_fn(causal=True)) "
      "instead of a mask."
    ) from e
  mask = np.broadcast_to(mask, mask.shape[:-2] + (q_len, kv_len))
  if mask.all():
    return False
  causal = np.tril(np.ones((q_len, kv_len), dtype=bool))
  if (mask == causal).all():
    return True
  raise ValueError(
    "make_attention_fn supports only an all-True mask or the causal "
    "(lower-triangular) mask; this mask is neither. Padding and segment "
    "masks are not supported by the flash kernel."
  )


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
  """An `attention_fn` for `flax.nnx.MultiHeadAttention`.

  Args:
    implementation, precision, block_q, block_k, scheme, interpret,
      tie_beta: as for `stableattn.attention`.
    causal: always apply the causal mask (also applied when Flax passes
      `is_causal=True` or a concrete lower-triangular `mask`).

  Returns:
    A function with Flax's `dot_product_attention` signature. Its output is
    cast back to the query's dtype, as Flax's own attention returns it.

  Raises (when called):
    ValueError: for features the flash kernel does not have: attention bias,
      dropout, sown attention weights, masks other than causal.
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
    if bias is not None:
      raise ValueError(
        "make_attention_fn does not support an attention bias; the flash "
        "kernel computes softmax(QK^T/sqrt(d))V with an optional causal mask."
      )
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
    apply_causal = causal or bool(is_causal)
    if mask is not None:
      apply_causal = apply_causal or _mask_as_causal_flag(
        mask, query.shape[-3], key.shape[-3]
      )
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
      precision=policy,
      block_q=block_q,
      block_k=block_k,
      scheme=scheme,
      causal=apply_causal,
      interpret=interpret,
      tie_beta=tie_beta,
    )
    return out.astype(query.dtype)

  policy = Precision.from_name(precision)
  tie_beta = check_tie_beta(tie_beta)
  return attention_fn
