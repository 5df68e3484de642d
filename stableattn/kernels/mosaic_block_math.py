"""The Hopper path's per-tile arithmetic under the precision policy.

These are `block_math`'s steps, and `pallas_forward`'s and
`pallas_backward`'s, in the same order and with the same roundings, on
tiles in wgmma's register layout: a per-row vector reaches a tile by
`as_rows` or `as_columns` (Mosaic GPU broadcasts by layout, not by
indexing). Each result is rounded to the stage named beside it by the
plan's `PolicyArithmetic`: a cast round trip in a compiled kernel, XLA's
rounding in interpret mode. At an FP32 stage the rounding is the
identity, so the FlashAttention-2 presets' kernels are unchanged; the
BF16 and FP16 presets round scores, statistics, the output accumulator
and the gradient accumulators to 16 bits, as they do on the Triton path.
The backward's P and dS are `block_math`'s own (`recomputed_probs`,
`score_gradients`), given `as_rows` or `as_columns` to place a row's
statistics.
"""

from __future__ import annotations

import jax.numpy as jnp

from stableattn.contract.masking import logits_in_base, scores
from stableattn.kernels.block_math import (
  stats_exp,
  stored_lse,
  summed_probs,
  tie_safe_max,
)
from stableattn.kernels.mosaic_support import MosaicPlan, as_rows


def _rounder(plan: MosaicPlan, stage: str):
  ar = plan.arithmetic
  return lambda x: ar.round(x, stage)


def block_scores(product, plan: MosaicPlan, *, base2: bool):
  """(S, tanh of the softcap or None) from Q K^T in FP32: the scaled (or
  softcapped) product in `scores` (`masking.scores`), held in
  `softmax_stats`; with `base2` in base 2, the forward's softmax under
  the policy option `exp2`."""
  s, tanh = scores(product, plan, plan.arithmetic, base2)
  return _rounder(plan, "softmax_stats")(s), tanh


def plus_additive(s, tile, plan: MosaicPlan, *, base2: bool):
  """S plus the additive tile (the bias, rounded to `scores`, and -inf
  where a dense mask blocks) in the scores' base, in `softmax_stats`."""
  ar = plan.arithmetic
  added = s + logits_in_base(tile, ar, base2, "scores")
  return ar.round(added, "softmax_stats")


def sink_in_base(sink, plan: MosaicPlan):
  """The sink's logit on each row, in `softmax_stats` and the forward's
  base (`pallas_forward._initial_state`)."""
  return logits_in_base(sink, plan.arithmetic, plan.exp2, "softmax_stats")


def online_softmax(s, m, l_sum, plan: MosaicPlan):
  """FlashAttention-2's statistics after one tile of scores S (base 2
  under `exp2`): (P, the rescale factor alpha in `out_accum`, new m, new
  l), rounded as `pallas_forward._fa2_update` rounds them; with
  `tie_beta`, the tile's maximum moved off its ties (Qiu & Yao,
  `block_math.tie_safe_max`)."""
  ar, stats = plan.arithmetic, _rounder(plan, "softmax_stats")
  m_block = tie_safe_max(s, s.max(axis=1), ar, plan, as_rows)
  m_new = jnp.maximum(m, m_block)
  # A row with no key so far keeps m = -inf; subtract 0 instead.
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = stats_exp(stats(m - m_use), ar, plan.exp2)
  p = stats_exp(stats(s - as_rows(m_use, s.shape)), ar, plan.exp2)
  l_new = stats(stats(alpha * l_sum) + summed_probs(p, ar))
  return p, ar.round(alpha, "out_accum"), m_new, l_new


def rescaled(acc, alpha, plan: MosaicPlan):
  """alpha * O in `out_accum`."""
  return _rounder(plan, "out_accum")(as_rows(alpha, acc.shape) * acc)


def plus_pv(scaled, pv, plan: MosaicPlan):
  """alpha O + P V in `out_accum`, P V rounded to it first."""
  accum = _rounder(plan, "out_accum")
  return accum(scaled + accum(pv))


def normalized(acc, l_safe, plan: MosaicPlan):
  """O = acc * (1 / l), the reciprocal in `softmax_stats`, then both in
  `out_accum` (`pallas_forward._store`)."""
  ar = plan.arithmetic
  inverse = ar.round(ar.round(1.0 / l_safe, "softmax_stats"), "out_accum")
  return ar.round(acc * as_rows(inverse, acc.shape), "out_accum")


def log_sum_exp(m, l_safe, plan: MosaicPlan):
  """m + log l in natural log and `softmax_stats` (`block_math.stored_lse`)."""
  lse = stored_lse(m, l_safe, plan.arithmetic, plan.exp2)
  return _rounder(plan, "softmax_stats")(lse)


def low_part(ds, plan: MosaicPlan):
  """dS - round(dS) rounded to `probs`: dS_lo of ds_for_dq=hi_lo."""
  probs = _rounder(plan, "probs")
  return probs(ds - probs(ds))


def accumulated(total, step, plan: MosaicPlan):
  """A gradient accumulator plus one block's step, both in `grad_accum`."""
  grad = _rounder(plan, "grad_accum")
  return grad(total + grad(step))


def gradient_stored(x, plan: MosaicPlan):
  """x rounded to `grad_accum` (d(bias)'s tile before it is stored)."""
  return _rounder(plan, "grad_accum")(x)
