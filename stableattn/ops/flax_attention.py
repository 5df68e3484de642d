"""`make_attention_fn`: our attention as Flax's `attention_fn` (nnx and
linen `MultiHeadAttention`)."""

from __future__ import annotations

import jax.numpy as jnp

from stableattn.contract.features import Features
from stableattn.contract.options import Options
from stableattn.numerics.monitor import attention_statistics
from stableattn.ops.dispatch import attention, split_keywords


def _refuse_unsupported(dropout_rate, deterministic, module, sows) -> None:
  """Raises for the Flax options the flash kernel does not have."""
  if dropout_rate > 0.0 and not deterministic:
    raise ValueError(
      f"make_attention_fn does not support attention dropout (got "
      f"dropout_rate={dropout_rate}); use dropout_rate=0 or "
      "deterministic=True."
    )
  if module is not None and not sows:
    raise ValueError(
      "make_attention_fn never materializes attention weights, so it "
      "cannot sow them; call the module with sow_weights=False (or make "
      "the function with monitor=True or capture=True, whose values it "
      "sows instead)."
    )
  if sows and module is None:
    raise ValueError(
      "make_attention_fn(monitor=True or capture=True) sows through the "
      "module: call nnx.MultiHeadAttention with sow_weights=True."
    )
  if sows:
    from flax import nnx

    if not isinstance(module, nnx.Module):
      raise ValueError(
        "make_attention_fn(monitor=True or capture=True) sows into a "
        f"flax.nnx module; got {type(module).__name__} (a linen module "
        "takes the drop-in without them)."
      )


def _sow(module, query, key, value, causal: bool, monitor: bool, capture: bool):
  """Flax's convention for values a training step reads back:
  `nnx.Intermediate`s, collected by `nnx.capture(fn, nnx.Intermediate)`."""
  from flax import nnx

  if monitor:
    module.sow(
      nnx.Intermediate,
      "attention_statistics",
      attention_statistics(query, key, causal=causal, v_BxTxHxD=value),
    )
  if capture:
    module.sow(nnx.Intermediate, "attention_inputs", (query, key, value))


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
  implementation: str = "flash",
  monitor: bool = False,
  capture: bool = False,
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
    implementation: as for `stableattn.attention`; default "flash": our
      flash kernel, on the Hopper path where it runs the request on a
      Hopper GPU, else the Triton path.
    monitor: sow each call's monitor statistics
      (`stableattn.numerics.monitor.attention_statistics`: largest logit,
      near ties, FP16 underflow, outlier channels; from q and k, causal
      when the call is, other masks not applied) as the
      `nnx.Intermediate` "attention_statistics". The module must be
      called with `sow_weights=True`, which asks for exactly this.
    capture: sow (q, k, v) as the kernel receives them as the
      `nnx.Intermediate` "attention_inputs", and perturb the output
      ("attention_output", an `nnx.Perturbation`) so that `nnx.capture`
      with `nnx.grad` gives its cotangent dO (docs/monitor.md), for
      `stableattn.auditing.captures.save`.
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
    _refuse_unsupported(dropout_rate, deterministic, module, monitor or capture)
    if query.ndim != 4:
      raise ValueError(
        "make_attention_fn needs inputs [batch, seq, heads, head_dim]; got "
        f"query shape {query.shape}."
      )
    call_features = _with_flax(features, query, bias, mask, is_causal)
    if monitor or capture:
      _sow(module, query, key, value, call_features.causal, monitor, capture)
    out = attention(
      query,
      key,
      value,
      implementation=implementation,
      options=options,
      features=call_features,
    )
    out = out.astype(query.dtype)
    if capture:
      # Flax's gradient extraction: under nnx.capture with perturbations,
      # the gradient of this zero perturbation is dO.
      out = module.perturb("attention_output", out)
    return out

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
