"""An independent NumPy + ml_dtypes emulation of the attention algorithms.

Written from the documented semantics (README, "Rounding semantics"), op by
op, looping over tiles as the kernels do, and sharing no code with
`stableattn`: every rounding is a NumPy/ml_dtypes cast, which is a real
rounding. Dot products and sums are formed in float64 from rounded operands
and rounded to the carrier (FP32, or FP64 for policies with an FP64 stage),
so they can differ from a compiled FP32 sum only in summation order; exp
and log are correctly rounded (XLA's FP32 exp differs from that in about
1 value in 10).

A policy is a plain dict stage -> format name. `forward` and `backward`
are the flash kernel's algorithms, `reference` the Baseline's
(`emulator_reference.py`); their arithmetic is `emulator_arithmetic.py`.
"""

from __future__ import annotations

import math

import numpy as np
from emulator_arithmetic import (
  FORMATS,
  Emulator,
  Features,
  cast,
  hadamard_rotation,
  head_pairs,
  merge_splits,
  pad,
  per_channel,
  prepared_inputs,
  probs_times_values,
  split_ranges,
  tie_safe_max,
)
from emulator_mma import promote, two_level_step
from emulator_mma import raw_probs_times_values as mma_pv
from emulator_reference import reference
from emulator_stability import (
  backward_delta,
  delta_rows,
  dq_step,
  keep_residuals,
  probs_in_sum,
  recomputed_probs,
  residual_arrays,
  sink_gradient,
)
from emulator_straight_through import straight_through

# What the tests call: the algorithms, and the formats they round to.
__all__ = ["FORMATS", "backward", "cast", "forward", "reference"]


def forward(
  q,
  k,
  v,
  stages,
  *,
  block_q,
  block_k,
  scheme,
  causal,
  tie_beta=None,
  options=None,
  num_splits=None,
  split_size=None,
  residuals=False,
  **kw,
):
  """Flash forward (fa1 or fa2). Returns (out float64, lse float64 [B,H,T]);
  `options` are the policy's quantization options, `kw` the features.
  With `num_splits` or `split_size`, split-KV: each split's keys give a
  partial output (in `partials`) and lse, merged in split order. With
  `residuals`, also {"acc": the normalized accumulator [B, Tp, H, D], "m",
  "l": [B, H, Tp]} for the backward's stability options."""
  em, (q, k, v), scales = prepared_inputs(
    stages, options, (q, k, v), block_q, block_k
  )
  batch, t, heads, d = q.shape
  s_len = k.shape[1]
  f = Features(d, causal, **kw)
  tp = math.ceil(t / block_q) * block_q
  sp = math.ceil(s_len / block_k) * block_k
  out = np.zeros((batch, tp, heads, v.shape[3]))
  lse = np.zeros((batch, heads, tp))
  kept = residual_arrays(out.shape, lse.shape)
  for b in range(batch):
    for h, hk in head_pairs(q, k):
      qh, kh = pad(q[b, :, h], tp), pad(k[b, :, hk], sp)
      vh = pad(v[b, :, hk], sp)
      allowed = f.allowed(b, h, t, s_len, tp, sp)
      bias = f.bias_of(b, h, tp, sp)
      sink = None if f.sink is None else f.sink[h]
      head_scales = None
      if scales is not None:
        sq, sk, sv = scales
        head_scales = (  # padding rows repeat the last row's scale
          np.pad(sq[b, h], (0, tp - t), mode="edge"),
          np.pad(sk[b, hk], (0, sp - s_len), mode="edge"),
          sv[b, hk]
          if per_channel(em)
          else np.pad(sv[b, hk], (0, sp - s_len), mode="edge"),
        )
      for qs in range(0, tp, block_q):
        rows = slice(qs, qs + block_q)
        parts = []
        for first, end in split_ranges(
          sp // block_k, num_splits, split_size, block_k
        ):
          o, m, l_ = _forward_rows(
            em,
            qh[rows],
            kh,
            vh,
            f,
            allowed[rows],
            None if bias is None else bias[rows],
            sink if first == 0 else None,
            block_k,
            scheme,
            tie_beta,
            None
            if head_scales is None
            else (head_scales[0][rows], head_scales[1], head_scales[2]),
            key_blocks=(first, end),
          )
          lse_rows = em.lse(m, np.where(l_ == 0, 1, l_), em.options["exp2"])
          parts.append((o, np.where(l_ == 0, -np.inf, lse_rows)))
        if num_splits is None and split_size is None:
          ((o, lse_rows),) = parts
          out[b, rows, h] = em.r(o, "output")
          keep_residuals(em, kept, (b, rows, h), o, (m, l_))
          lse[b, h, rows] = np.where(lse_rows == -np.inf, np.inf, lse_rows)
        else:
          out[b, rows, h], lse[b, h, rows] = merge_splits(em, parts)
  if residuals:
    return out[:, :t], lse, kept
  return out[:, :t], lse


def _forward_rows(
  em,
  qb,
  kh,
  vh,
  f,
  allowed,
  bias,
  sink,
  block_k,
  scheme,
  tie_beta,
  scales,
  key_blocks=None,
):
  """One query block over the key blocks in `key_blocks` (first, end),
  all by default; the output normalized (fa2) but not yet stored."""
  sp = kh.shape[0]
  c = em.carrier
  base2 = em.options["exp2"]
  acc, m, l_, mma = _initial_state(em, (qb.shape[0], vh.shape[1]), sink)
  visited = 0
  st = lambda x: em.r(x, "softmax_stats")  # noqa: E731
  oa = lambda x: em.r(x, "out_accum")  # noqa: E731
  exp = lambda x: em.exp(x, base2)  # noqa: E731
  first, end = key_blocks or (0, sp // block_k)
  starts = list(range(first * block_k, end * block_k, block_k))
  if em.options["key_order"] == "reversed":
    starts = starts[::-1]
  for ks in starts:
    cols = slice(ks, ks + block_k)
    if not allowed[:, cols].any():
      continue  # an empty block changes nothing
    kb, vb = kh[cols], vh[cols]
    tile_scales = sv = None
    if scales is not None:
      tile_scales = (scales[0], scales[1][cols])
      sv = scales[2] if per_channel(em) else scales[2][cols]
    s, _ = em.scores(
      qb,
      kb,
      f,
      allowed[:, cols],
      None if bias is None else bias[:, cols],
      tile_scales,
      base2,
    )
    m_block = tie_safe_max(em, s, s.max(-1), tie_beta)
    m_new = np.maximum(m, m_block)
    m_use = np.where(m_new == -np.inf, c(0), m_new)
    alpha = exp(st(m - m_use))
    row_sum = lambda p: st(em.total(probs_in_sum(em, p), "matmul_accum"))  # noqa: E731
    if scheme == "fa2":
      p = exp(st(s - m_use[:, None]))
      l_ = st(st(alpha * l_) + row_sum(p))
      acc, mma = _fa2_output(em, acc, mma, alpha, (p, vb, sv), visited)
      visited += 1
    else:
      m_ref = np.where(m_block == -np.inf, m_use, m_block)
      p = exp(st(s - m_ref[:, None]))
      beta = exp(st(m_ref - m_use))
      old_sum = st(alpha * l_)
      l_ = st(old_sum + st(beta * row_sum(p)))
      pv = oa(probs_times_values(em, p, vb, sv))
      l_safe = np.where(l_ == 0, c(1), l_)
      old_w = oa(st(old_sum / l_safe))
      new_w = oa(st(beta / l_safe))
      acc = oa(oa(old_w[:, None] * acc) + oa(new_w[:, None] * pv))
    m = m_new
  if mma is not None:
    acc = promote(em, acc, mma)
  if scheme == "fa2":
    l_safe = np.where(l_ == 0, c(1), l_)
    acc = oa(acc * oa(st(c(1.0) / l_safe))[:, None])
  return acc, m, l_


def _initial_state(em, shape, sink):
  """(O, m, l, MMA accumulator or None) before the first key tile: the
  sink is a logit with value 0, counted from the start; with two-level
  accumulation (mma_chunk, promote_every != 1) P V is held in the MMA
  accumulator, counted in visited tiles."""
  bq, d = shape
  c = em.carrier
  if sink is None:
    m = np.full((bq,), -np.inf, c)
    l_ = np.zeros((bq,), c)
  else:
    m = np.full((bq,), em.in_base(sink, "softmax_stats", em.options["exp2"]), c)
    l_ = np.ones((bq,), c)
  mma = None
  if em.options["mma_chunk"] and em.options["promote_every"] != 1:
    mma = (np.zeros((bq, d), c), c(1))
  return np.zeros((bq, d), c), m, l_, mma


def _fa2_output(em, acc, mma, alpha, tile, visited):
  """O = alpha O + P V for one key tile (`tile`: P, V, V's scales); with
  `mma` P V stays in the MMA accumulator across tiles (two levels)."""
  p, vb, sv = tile
  oa = lambda x: em.r(x, "out_accum")  # noqa: E731
  if mma is not None:

    def add_pv(t):
      return mma_pv(em, p, vb, sv, t, per_channel(em))

    return two_level_step(em, acc, mma, alpha, add_pv, visited)
  if em.options["mma_chunk"]:
    pv, descale = mma_pv(em, p, vb, sv, None, per_channel(em))
    pv = oa((pv * descale).astype(em.carrier))
  else:
    pv = oa(probs_times_values(em, p, vb, sv))
  return oa(oa(oa(alpha)[:, None] * acc) + pv), mma


def _probs_and_ds(em, x, f, qs, ks, block_q, block_k):
  """Recomputed P, dS (both rounded to `probs`; dS with the softcap's
  slope) and dS of the biased scores (the bias gradient) of one tile."""
  st = lambda y: em.r(y, "softmax_stats")  # noqa: E731
  rows, cols = slice(qs, qs + block_q), slice(ks, ks + block_k)
  bias = None if x["bias"] is None else x["bias"][rows, cols]
  s, tanh = em.scores(
    x["q"][rows], x["k"][cols], f, x["allowed"][rows, cols], bias
  )
  p = recomputed_probs(em, s, x, rows)
  dp = st(em.dot(x["do"][rows], x["v"][cols].T))
  ds_logits = st(p * st(dp - st(x["delta"][rows])[:, None]))
  ds = ds_logits
  if tanh is not None:
    ds = st(ds * st(1.0 - st(tanh * tanh)))
  return em.r(p, "probs"), ds, ds_logits


def _dk_dv(em, f, rows_of, tiles, scale):
  """One head's dK and dV ([sp, d] in the carrier): per key block, the
  query blocks in order, each step rounded to `grad_accum`."""
  block_q, block_k, tp, sp = tiles
  d = rows_of["q"].shape[-1]
  g = lambda x: em.r(x, "grad_accum")  # noqa: E731
  dv_dim = rows_of["v"].shape[-1]
  dk = np.zeros((sp, d), em.carrier)
  dv = np.zeros((sp, dv_dim), em.carrier)
  for ks in range(0, sp, block_k):
    dk_acc = np.zeros((block_k, d), em.carrier)
    dv_acc = np.zeros((block_k, dv_dim), em.carrier)
    for qs in range(0, tp, block_q):
      if not rows_of["allowed"][qs : qs + block_q, ks : ks + block_k].any():
        continue  # an empty tile adds exact zeros
      p, ds, _ = _probs_and_ds(em, rows_of, f, qs, ks, block_q, block_k)
      dv_step = g(em.dot(p.T, rows_of["do"][qs : qs + block_q]))
      dk_step = em.r(
        em.dot(em.r(ds, "probs").T, rows_of["q"][qs : qs + block_q]) * scale,
        "matmul_accum",
      )
      dk_acc = g(dk_acc + g(dk_step))
      dv_acc = g(dv_acc + dv_step)
    dk[ks : ks + block_k] = dk_acc
    dv[ks : ks + block_k] = dv_acc
  return dk, dv


def _dq(em, f, rows_of, tiles, scale, t, d_bias_h):
  """One head's dQ ([t, d]): per query block, the key blocks in order;
  writes the logits' gradient into `d_bias_h` [tp, sp]."""
  block_q, block_k, tp, sp = tiles
  d = rows_of["q"].shape[-1]
  g = lambda x: em.r(x, "grad_accum")  # noqa: E731
  dq = np.zeros((t, d))
  for qs in range(0, tp, block_q):
    dq_acc = np.zeros((block_q, d), em.carrier)
    for ks in range(0, sp, block_k):
      if not rows_of["allowed"][qs : qs + block_q, ks : ks + block_k].any():
        continue
      _, ds, ds_logits = _probs_and_ds(em, rows_of, f, qs, ks, block_q, block_k)
      d_bias_h[qs : qs + block_q, ks : ks + block_k] = ds_logits
      step = dq_step(em, ds, rows_of["k"][ks : ks + block_k], scale)
      dq_acc = g(dq_acc + g(step))
    rows = slice(qs, min(qs + block_q, t))
    dq[rows] = dq_acc[: rows.stop - qs]
  return dq


def _input_grads(em, dq, dk_per_head, dv_per_head, kv_shape, options):
  """dQ, dK, dV in `inputs`: per-head dK and dV summed over each GQA
  group (in `grad_accum`), and back through a Hadamard rotation."""
  batch, s_len, kv_heads, _ = kv_shape
  sp, heads, d = dk_per_head.shape[1:]
  group = heads // kv_heads

  def sum_groups(x):
    x = x.reshape(batch, sp, kv_heads, group, x.shape[-1])[:, :s_len]
    if group == 1:
      return x[:, :, :, 0]
    return em.total(x, "grad_accum", axis=3)

  dk, dv = sum_groups(dk_per_head), sum_groups(dv_per_head)
  grads = [em.r(x, "inputs") for x in (dq, dk, dv)]
  options = options or {}
  if options.get("hadamard"):
    # Back through the rotation x R: the gradient times R^T, in FP32.
    signed_h, norm = hadamard_rotation(d)
    for i in (0, 1):
      rotated_back = (grads[i].astype(np.float64) @ signed_h.T).astype(
        np.float32
      )
      grads[i] = (rotated_back * norm).astype(np.float32)
  # k - mean(k) passes dK unchanged: the mean is a constant (documented).
  return [em.r(x, "inputs").astype(np.float64) for x in grads]


def backward(
  q,
  k,
  v,
  d_out,
  stages,
  *,
  block_q,
  block_k,
  scheme,
  causal,
  options=None,
  **kw,
):
  """(dq, dk, dv) of the flash kernel: delta, dK/dV and dQ passes; then
  d bias (per example and head, [B, H, T, S]) if a bias is given and
  d sink if a sink is given. With operands below 16 bits, the forward is
  quantized (`options`) and the passes are straight-through."""
  out, lse, kept = forward(
    q,
    k,
    v,
    stages,
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
    options=options,
    residuals=True,
    **kw,
  )
  if Emulator(stages).quantizes:
    (q, k, v), stages = straight_through(
      q, k, v, stages, options, block_q, block_k
    )
    em = Emulator(stages)
  else:
    em = Emulator(stages, options)
    q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  d_out = em.r(d_out, "output")
  batch, t, heads, d = q.shape
  s_len = k.shape[1]
  f = Features(d, causal, **kw)
  tp = math.ceil(t / block_q) * block_q
  sp = math.ceil(s_len / block_k) * block_k
  scale = em.carrier(f.scale)
  dq = np.zeros((batch, t, heads, d))
  dk_per_head = np.zeros((batch, sp, heads, d), em.carrier)
  dv_per_head = np.zeros((batch, sp, heads, v.shape[3]), em.carrier)
  d_bias = np.zeros((batch, heads, tp, sp))
  d_sink = np.zeros(heads)
  for b in range(batch):
    for h, hk in head_pairs(q, k):
      qh, doh = pad(q[b, :, h], tp), pad(d_out[b, :, h], tp)
      oh = pad(out[b, :, h], tp)
      kh, vh = pad(k[b, :, hk], sp), pad(v[b, :, hk], sp)
      delta = delta_rows(em, oh, kept["acc"][b, :, h], doh)
      lse_h = lse[b, h]
      rows_of = dict(
        q=qh,
        k=kh,
        v=vh,
        do=doh,
        lse=lse_h,
        delta=delta,
        allowed=f.allowed(b, h, t, s_len, tp, sp),
        bias=f.bias_of(b, h, tp, sp),
        m=kept["m"][b, h],
        l=kept["l"][b, h],
      )
      tiles = (block_q, block_k, tp, sp)
      delta = rows_of["delta"] = backward_delta(em, f, rows_of, tiles)
      if f.sink is not None:
        d_sink[h] += sink_gradient(em, f, rows_of, tiles, f.sink[h], t)
      dk_h, dv_h = _dk_dv(em, f, rows_of, tiles, scale)
      dk_per_head[b, :, h], dv_per_head[b, :, h] = dk_h, dv_h
      dq[b, :, h] = _dq(em, f, rows_of, tiles, scale, t, d_bias[b, h])
  grads = _input_grads(em, dq, dk_per_head, dv_per_head, k.shape, options)
  if f.bias is not None:
    grads.append(em.r(d_bias[:, :, :t, :s_len], "grad_accum"))
  if f.sink is not None:
    grads.append(em.r(d_sink, "grad_accum"))
  return tuple(grads)
