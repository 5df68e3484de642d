"""The emulator's side of the stability options (policy options
delta_source, delta_product, sink_delta, softmax_residuals, softmax_sum,
ds_for_dq): what the forward keeps for the backward, the P it
recomputes, delta and dS K. Written from their documented semantics
(stableattn/kernels/residuals.py, backward_delta.py), as the rest of the
emulator."""

from __future__ import annotations

import numpy as np

STABILITY_DEFAULTS = dict(
  delta_source="output",
  delta_product="rowsum",
  sink_delta="shared",
  softmax_residuals="lse",
  softmax_sum="stats",
  ds_for_dq="rounded",
)


def probs_in_sum(em, p):
  """The P a tile adds to the softmax sum (softmax_sum=rounded_probs: P
  as rounded to `probs`)."""
  if em.options["softmax_sum"] == "rounded_probs":
    return em.r(p, "probs")
  return p


def row_residuals(em, m, l_):
  """(m, l) kept for the backward: 0 and 1 where no key attends."""
  c = em.carrier
  return np.where(m == -np.inf, c(0), m), np.where(l_ == 0, c(1), l_)


def recomputed_probs(em, s, x, rows):
  """P of one tile from the forward's residuals: exp(s - lse), or
  exp(s - m) * (1 / l) with softmax_residuals=max_sum."""
  st = lambda y: em.r(y, "softmax_stats")  # noqa: E731
  with np.errstate(invalid="ignore"):
    if em.options["softmax_residuals"] != "max_sum":
      p = em.exp(st(s - st(x["lse"][rows])[:, None]))
    else:
      inverse = st(em.carrier(1.0) / st(x["l"][rows]))
      p = st(em.exp(st(s - st(x["m"][rows])[:, None])) * inverse[:, None])
  return np.where(np.isnan(p), 0, p)  # a row no key attends: lse = +inf


def delta_rows(em, out_h, acc_h, d_out_h):
  """delta = rowsum(dO * O) of one head from O as delta_source says
  (output: O as stored; fp32: the accumulator in `out_accum`; hi_lo:
  round(O) + round(O - round(O)), both in `output`)."""
  source = em.options["delta_source"]
  o = out_h
  if source == "fp32":
    o = em.r(acc_h, "out_accum")
  elif source == "hi_lo":
    hi = em.r(acc_h, "output")
    o = hi + em.r(acc_h - hi, "output")
  r = lambda y: em.r(y, "delta")  # noqa: E731
  if em.options["delta_product"] != "matmul":
    return em.total(r(r(o) * r(d_out_h)), "delta")
  # delta_product=matmul: O in the matmul operands' format through a
  # matmul (dO O_hi^T's diagonal), the rest of O as a row sum.
  hi = em.operand(o)
  diagonal = np.einsum("ii->i", em.dot(d_out_h, hi.T))
  rest = em.total(r(r(o - hi) * r(d_out_h)), "delta")
  return r(diagonal + rest)


def probs_delta(em, x, scores_of, tiles):
  """delta_source=probs: (rowsum(P * dP), rowsum(P)) over the key tiles
  in order, each product and each tile's sum of the first rounded to
  `delta`, the second unrounded; `scores_of(qs, ks)` gives a tile's
  scores."""
  block_q, block_k, tp, sp = tiles
  st = lambda y: em.r(y, "softmax_stats")  # noqa: E731
  delta = np.zeros(tp, em.carrier)
  sums = np.zeros(tp)
  for qs in range(0, tp, block_q):
    rows = slice(qs, qs + block_q)
    acc = np.zeros(block_q, em.carrier)
    for ks in range(0, sp, block_k):
      if not x["allowed"][rows, ks : ks + block_k].any():
        continue
      p = recomputed_probs(em, scores_of(qs, ks), x, rows)
      dp = st(em.dot(x["do"][rows], x["v"][ks : ks + block_k].T))
      products = em.r(em.r(p, "delta") * dp, "delta")
      acc = em.r(acc + em.total(products, "delta"), "delta")
      sums[rows] += np.sum(p, axis=1)
    delta[rows] = acc
  return delta, sums


def dq_step(em, ds, k_tile, scale):
  """dS K * scale in `matmul_accum`: dS rounded to `probs`, or with
  ds_for_dq=hi_lo as dS_hi K + dS_lo K."""
  hi = em.r(ds, "probs")
  step = em.r(em.dot(hi, k_tile) * scale, "matmul_accum")
  if em.options["ds_for_dq"] != "hi_lo":
    return step
  lo = em.r(ds - hi, "probs")
  low = em.r(em.dot(lo, k_tile) * scale, "matmul_accum")
  return em.r(step + low, "matmul_accum")


def residual_arrays(out_shape, rows_shape) -> dict:
  """Zeros for what `keep_residuals` records: acc [B, Tp, H, D], m and l
  [B, H, Tp]."""
  return dict(
    acc=np.zeros(out_shape), m=np.zeros(rows_shape), l=np.zeros(rows_shape)
  )


def keep_residuals(em, kept, where, acc, stats):
  """Records one query block's normalized accumulator and (m, l) at
  `where` = (batch, rows, head) for the backward."""
  b, rows, h = where
  kept["acc"][b, rows, h] = acc
  kept["m"][b, h, rows], kept["l"][b, h, rows] = row_residuals(em, *stats)


def backward_delta(em, f, x, tiles, for_sink=False):
  """delta of one head: `x["delta"]` (from O), or with delta_source=probs
  rowsum(P * dP) over the key tiles. `for_sink`: (delta, None) or, with
  sink_delta=probs, (rowsum(P * dP), rowsum(P)) for d(sink)."""
  recomputed = em.options["delta_source"] == "probs"
  if for_sink and em.options["sink_delta"] == "probs":
    recomputed = True
  if not recomputed:
    return (x["delta"], None) if for_sink else x["delta"]
  block_q, block_k = tiles[:2]

  def scores(qs, ks):
    rows, cols = slice(qs, qs + block_q), slice(ks, ks + block_k)
    bias = None if x["bias"] is None else x["bias"][rows, cols]
    allowed = x["allowed"][rows, cols]
    return em.scores(x["q"][rows], x["k"][cols], f, allowed, bias)[0]

  delta, sums = probs_delta(em, x, scores, tiles)
  if not for_sink:
    return delta
  return delta, (sums if em.options["sink_delta"] == "probs" else None)


def sink_gradient(em, f, x, tiles, sink, t):
  """One head's d(sink) = -sum_i p_sink,i delta_i over its `t` rows, with
  sink_delta=probs from the unrounded P, normalized by its sum."""
  p_sink = np.exp(np.float64(sink) - x["lse"][:t])
  delta, sums = backward_delta(em, f, x, tiles, for_sink=True)
  delta = delta[:t].astype(np.float64)
  if sums is not None:
    total = p_sink + sums[:t]
    p_sink, delta = p_sink / total, delta / total
  return -np.sum(p_sink * delta)
