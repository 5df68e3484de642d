"""What places a model's attention among the audit's regimes, computed
from its q and k at a logging step: the attention monitor's statistics.

Training reports them per layer (metrics.jsonl, `kind: attention`), the
Flax drop-in sows them (`make_attention_fn(monitor=True)`), and the
calibration of `stableattn.auditing.thresholds` says which kernels miss
the rules where a run's statistics reach.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# FP16's smallest normal: probabilities below it lose bits in a half P.
FP16_TINY = float(jnp.finfo(jnp.float16).tiny)


# Its own program: a traced training step tells the monitor's FP32
# products (an observation) apart from the model's.
@functools.partial(jax.jit, static_argnames=("input_dtype", "causal"))
def attention_statistics(
  q_BxTxHxD, k_BxTxHxD, input_dtype=None, causal=True, v_BxTxHxD=None
):
  """What places attention among the audit's regimes, from q and k
  as given (logits in FP32, before any softcap, as a flash kernel's
  scores):

  - `max_logit`; `min_row_lse`, the smallest row log-sum-exp, and
    `median_n_eff`, the median exp(LSE - row max) (how many keys a row
    spreads over; 1 where its maximum dominates), rows of two keys or more;
  - `tied_max_share` (exact FP32 ties of a row's largest logit) and
    `near_tied_share` (its two largest within one ulp of `input_dtype`,
    the attention's input format; None: q's dtype), rows with two keys or
    more;
  - `fp16_underflow_share`: attended probabilities in (0, FP16's smallest
    normal);
  - `q_outlier_ratio`, `k_outlier_ratio`: the largest |value| of the
    largest channel over that of the median channel (massive activations);
  - `entropy`: the mean row entropy;
  - `key_offset_ratio` and, given v, `value_offset_ratio`: |mean_j x_j| /
    rms_j |x_j - mean| per (batch row, head) over every token, averaged
    over the batch, largest head for the layer: a component shared by
    every key (value), which FlashAttention-2's backward multiplies into
    dQ (Qiu & Yao, Eq. 1; `stableattn.auditing.offsets`).

  Each also per head, as `<name>_per_head` ([H]: the same statistic over
  that head's rows and channels), since field failures sit in one head
  (MaxText and Megatron log the largest logit per head).

  `causal`: the statistics of causal attention (True) or of every key
  (False); q and k of one length and of as many heads (repeat k for GQA).
  """
  q = jax.lax.stop_gradient(q_BxTxHxD).astype(jnp.float32)
  k = jax.lax.stop_gradient(k_BxTxHxD).astype(jnp.float32)
  s = jnp.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
  t, n = s.shape[-2:]
  ones = jnp.ones((t, n), dtype=bool)
  allowed = jnp.tril(ones, n - t) if causal else ones
  first = 1 if causal else 0  # a causal first row has a single key
  s = jnp.where(allowed, s, -jnp.inf)
  log_p = jax.nn.log_softmax(s, axis=-1)
  p = jnp.exp(log_p)
  row_max = jnp.max(s, axis=-1)
  lse = jax.nn.logsumexp(s, axis=-1)
  # Per row [B, H, T]: what each statistic reduces over rows (and keys).
  rows = {
    "entropy": -jnp.sum(jnp.where(allowed, p * log_p, 0.0), -1),
    "tied": (jnp.sum(s == row_max[..., None], axis=-1) > 1)[..., first:],
    "near_tied": _near_tied(s, input_dtype or q_BxTxHxD.dtype)[..., first:],
    "n_eff": jnp.exp(lse - row_max)[..., first:],
  }
  underflow = allowed & (p > 0) & (p < FP16_TINY)
  attended = jnp.broadcast_to(allowed, p.shape)

  def reduce(over_heads: bool):
    """The statistics over every head (a layer's), or per head ([H])."""
    kept = (1,) if not over_heads else ()
    axes = lambda x: tuple(i for i in range(x.ndim) if i not in kept)  # noqa: E731
    share = lambda x: jnp.mean(x.astype(jnp.float32), axis=axes(x))  # noqa: E731
    return {
      "max_logit": jnp.max(s, axis=axes(s)),
      "min_row_lse": jnp.min(lse, axis=axes(lse)),
      "median_n_eff": _median(rows["n_eff"], over_heads),
      "entropy": jnp.mean(rows["entropy"], axis=axes(rows["entropy"])),
      "tied_max_share": share(rows["tied"]),
      "near_tied_share": share(rows["near_tied"]),
      "fp16_underflow_share": jnp.sum(underflow, axis=axes(p))
      / jnp.sum(attended, axis=axes(p)),
      "q_outlier_ratio": _outlier_ratio(q, over_heads),
      "k_outlier_ratio": _outlier_ratio(k, over_heads),
      **_offset_ratios(k, v_BxTxHxD, over_heads),
    }

  layer = reduce(over_heads=True)
  per_head = reduce(over_heads=False)
  return {**layer, **{f"{name}_per_head": v for name, v in per_head.items()}}


# The statistics the kernel's own pass gives (`kernel_statistics`); the
# others (entropy, FP16 underflow) need the normalized P of every key,
# which a flash forward never holds, and stay with `attention_statistics`.
KERNEL_STATISTICS = (
  "max_logit",
  "min_row_lse",
  "median_n_eff",
  "tied_max_share",
  "near_tied_share",
  "q_outlier_ratio",
  "k_outlier_ratio",
  "key_offset_ratio",
  "value_offset_ratio",
)


@functools.partial(jax.jit, static_argnames=("input_dtype",))
def kernel_statistics(
  rows: dict, q_BxTxHxD, k_BxTxHxD, input_dtype=None, v_BxTxHxD=None
):
  """The monitor's statistics from a flash kernel's own pass (MaxText
  reads splash's residuals the same way, TransformerEngine returns
  `max_logit`): `rows` holds per row [B, H, T] the log-sum-exp, the
  largest score and the second largest (`sa.attention(...,
  return_statistics=True)`), so no second pass over q and k is made; the
  outlier ratios read q and k's channels directly. Keys and meanings as
  `attention_statistics` (`KERNEL_STATISTICS`, each also per head), on
  the scores the kernel computed (after a softcap or bias, if any)."""
  lse = rows["lse"].astype(jnp.float32)
  top = rows["row_max"].astype(jnp.float32)
  second = rows["second"].astype(jnp.float32)
  attended = jnp.isfinite(top)  # a row some key attends
  two_keys = attended & jnp.isfinite(second)  # ... with two keys or more
  magnitude = jnp.maximum(jnp.abs(top), jnp.float32(2.0**-100))
  dtype = input_dtype or q_BxTxHxD.dtype
  ulp = jnp.exp2(jnp.floor(jnp.log2(magnitude)) - jnp.finfo(dtype).nmant)
  n_eff = jnp.where(two_keys, jnp.exp(lse - top), jnp.nan)
  q = jax.lax.stop_gradient(q_BxTxHxD).astype(jnp.float32)
  k = jax.lax.stop_gradient(k_BxTxHxD).astype(jnp.float32)

  def reduce(over_heads: bool):
    axes = (0, 2) if not over_heads else None

    def share(flags):
      flags = (flags & two_keys).astype(jnp.float32)
      return jnp.sum(flags, axes) / jnp.sum(two_keys.astype(jnp.float32), axes)

    return {
      "max_logit": jnp.max(jnp.where(attended, top, -jnp.inf), axes),
      "min_row_lse": jnp.min(jnp.where(attended, lse, jnp.inf), axes),
      "median_n_eff": jnp.nanmedian(n_eff, axes),
      "tied_max_share": share(second == top),
      "near_tied_share": share(top - second <= ulp),
      "q_outlier_ratio": _outlier_ratio(q, over_heads),
      "k_outlier_ratio": _outlier_ratio(k, over_heads),
      **_offset_ratios(k, v_BxTxHxD, over_heads),
    }

  layer = reduce(over_heads=True)
  per_head = reduce(over_heads=False)
  return {**layer, **{f"{name}_per_head": v for name, v in per_head.items()}}


def plain(stats: dict) -> dict:
  """Statistics as JSON holds them: numbers, and a list per head."""
  out = {}
  for name, value in stats.items():
    value = np.asarray(value, np.float64)
    out[name] = float(value) if value.ndim == 0 else value.tolist()
  return out


def _median(x_BxHxT, over_heads: bool):
  if over_heads:
    return jnp.median(x_BxHxT)
  return jnp.median(
    jnp.moveaxis(x_BxHxT, 1, 0).reshape(x_BxHxT.shape[1], -1), -1
  )


def _outlier_ratio(x_BxTxHxD, over_heads: bool = True):
  """The largest channel's max |x| over the median channel's: massive
  activations put a few channels hundreds of times above the rest. Over
  every head's channels, or per head ([H])."""
  per_channel = jnp.max(jnp.abs(x_BxTxHxD), axis=(0, 1))  # [H, D]
  if over_heads:
    per_channel = per_channel.ravel()
  return jnp.max(per_channel, -1) / jnp.maximum(
    jnp.median(per_channel, -1), jnp.float32(1e-30)
  )


def offset_ratio(x_BxTxHxD, over_heads: bool = True):
  """|mean over tokens| / rms |x_t - mean| per (batch row, head), averaged
  over the batch: per head ([H]), or the largest head's."""
  x = jax.lax.stop_gradient(x_BxTxHxD).astype(jnp.float32)
  mean = jnp.mean(x, axis=1, keepdims=True)
  spread = jnp.sqrt(jnp.mean(jnp.sum((x - mean) ** 2, -1), axis=1))  # [B, H]
  size = jnp.linalg.norm(mean[:, 0], axis=-1)  # [B, H]
  ratio = jnp.mean(size / jnp.maximum(spread, jnp.float32(1e-30)), axis=0)
  return jnp.max(ratio) if over_heads else ratio


def _offset_ratios(k, v, over_heads: bool) -> dict:
  out = {"key_offset_ratio": offset_ratio(k, over_heads)}
  if v is not None:
    out["value_offset_ratio"] = offset_ratio(v, over_heads)
  return out


def _near_tied(s, dtype):
  """Per row: whether its two largest logits lie within one ulp of the
  input format (`dtype`) at the larger: the rows where a flash backward's
  delta and dS cancel (docs/audit.md)."""
  # The two largest by two maxima, not lax.top_k: XLA's CPU top_k
  # followed by arithmetic took 16 ms here against 0.1 ms.
  top = jnp.max(s, axis=-1)
  at_top = s == top[..., None]
  tied = jnp.sum(at_top.astype(jnp.int32), axis=-1) > 1
  second = jnp.where(tied, top, jnp.max(jnp.where(at_top, -jnp.inf, s), -1))
  gap = top - second
  magnitude = jnp.maximum(jnp.abs(top), jnp.float32(2.0**-100))
  ulp = jnp.exp2(jnp.floor(jnp.log2(magnitude)) - jnp.finfo(dtype).nmant)
  return gap <= ulp
