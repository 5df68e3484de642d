"""`make_attention_fn`: our attention as `flax.nnx.MultiHeadAttention`'s."""

from __future__ import annotations

import numpy as np

from stableattn.dispatch import attention, check_tie_beta
from stableattn.precision import Precision


def mask_as_kernel_options(
  mask, q_len: int, kv_len: int, causal: bool
) -> tuple[bool, int]:
  """(causal, keys used) that reproduce `mask` (AND causal, if set).

  The flash kernel represents: every key, the top-left causal mask, and a
  key-padding mask whose valid keys are the same prefix [0, n) for every
  example, head and query (it attends to the first n keys only), alone or
  with causal. Anything else raises.
  """
  try:
    mask = np.asarray(mask).astype(bool)
  except Exception as e:  # a tracer: the values are unknown at trace time
    raise ValueError(
      "make_attention_fn cannot use an attention mask computed under jit: "
      "the flash kernel needs to know its form (none, causal, or a key "
      "prefix) when the program is built. Pass is_causal=True to the module "
      "call (or make_attention_fn(causal=True)), or a concrete mask."
    ) from e
  mask = np.broadcast_to(mask, mask.shape[:-2] + (q_len, kv_len))
  causal_TxS = np.tril(np.ones((q_len, kv_len), dtype=bool))
  if causal:
    mask = mask & causal_TxS
  keys = mask.any(axis=tuple(range(mask.ndim - 1)))
  n = int(keys.sum())
  if n == 0 or not keys[:n].all():
    raise ValueError(
      "make_attention_fn supports masks of the forms: all keys, causal, or "
      "a key-padding prefix (the first n keys) shared by every example, "
      "alone or with causal. This mask "
      + ("masks every key." if n == 0 else "is not a key prefix.")
      + " Per-example padding, segment and other masks are not supported "
      "by the flash kernel."
    )
  for uses_causal in (False, True):
    form = np.ones((q_len, n), dtype=bool)
    if uses_causal:
      form = causal_TxS[:, :n]
    if (mask[..., :n] == form).all():
      return uses_causal, n
  raise ValueError(
    "make_attention_fn supports masks of the forms: all keys, causal, or a "
    "key-padding prefix (the first n keys) shared by every example, alone "
    "or with causal; this mask differs between examples, heads or queries "
    "in another way. Per-example padding and segment masks are not "
    "supported by the flash kernel."
  )


def _refuse_unsupported(bias, dropout_rate, deterministic, module) -> None:
  """Raises for the Flax options the flash kernel does not have."""
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
      `is_causal=True` or a concrete lower-triangular `mask`). A concrete
      `mask` is combined with it; see `mask_as_kernel_options` for the
      masks the kernel can represent.

  Returns:
    A function with Flax's `dot_product_attention` signature. Its output is
    cast back to the query's dtype, as Flax's own attention returns it.

  Raises (when called):
    ValueError: for features the flash kernel does not have: attention bias,
      dropout, sown attention weights, masks it cannot represent.
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
    _refuse_unsupported(bias, dropout_rate, deterministic, module)
    apply_causal = causal or bool(is_causal)
    if mask is not None:
      apply_causal, keys_used = mask_as_kernel_options(
        mask, query.shape[-3], key.shape[-3], apply_causal
      )
      key, value = key[..., :keys_used, :, :], value[..., :keys_used, :, :]
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
