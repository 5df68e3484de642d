"""An independent NumPy + ml_dtypes emulation of the attention algorithms.

Written from the documented semantics (README, "Rounding semantics"), op by
op, looping over tiles as the kernels do, and sharing no code with
`stableattn`: every rounding is a NumPy/ml_dtypes cast, which is a real
rounding. Dot products and sums are formed in float64 from rounded operands
and rounded to the carrier (FP32, or FP64 for policies with an FP64 stage),
so they can differ from a compiled FP32 sum only in summation order; exp
and log are correctly rounded (XLA's FP32 exp differs from that in about
1 value in 10).

A policy is a plain dict stage -> format name.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FORMATS = {
  "bf16": ml_dtypes.bfloat16,
  "fp16": np.float16,
  "fp32": np.float32,
  "fp64": np.float64,
}


class Emulator:
  def __init__(self, stages: dict[str, str]):
    self.stages = dict(stages)
    self.carrier = np.float64 if "fp64" in self.stages.values() else np.float32

  def r(self, x, stage):
    """x rounded to `stage`, held in the carrier."""
    fmt = FORMATS[self.stages[stage]]
    with np.errstate(over="ignore"):
      return np.asarray(x, self.carrier).astype(fmt).astype(self.carrier)

  def dot(self, a, b):
    a = self.r(a, "matmul_operands").astype(np.float64)
    b = self.r(b, "matmul_operands").astype(np.float64)
    return self.r((a @ b).astype(self.carrier), "matmul_accum")

  def total(self, x, stage, axis=-1, keepdims=False):
    s = np.sum(np.asarray(x, np.float64), axis=axis, keepdims=keepdims)
    return self.r(s.astype(self.carrier), stage)

  def exp(self, x):
    """exp correctly rounded to the carrier, then rounded to the stage."""
    with np.errstate(invalid="ignore"):
      wide = np.exp(np.asarray(x, np.float64))
    return self.r(wide.astype(self.carrier), "softmax_stats")

  def log(self, x):
    wide = np.log(np.asarray(x, np.float64))
    return self.r(wide.astype(self.carrier), "softmax_stats")

  def scores(self, q, k, scale, mask):
    s = self.dot(q, k.T)
    s = self.r(self.r(s * self.carrier(scale), "scores"), "softmax_stats")
    return np.where(mask, s, -np.inf).astype(self.carrier)


def tie_safe_max(em, s, r_m, tie_beta):
  """Qiu & Yao's Alg. 1 as documented: with ties at r_m, m = r_m + shift,
  shift = (beta - 1) r_m if r_m > 0, -r_m if r_m < 0; a shift above half
  the statistics format's natural-log range wraps into [cap - 1, cap)."""
  if tie_beta is None:
    return r_m
  c = em.carrier
  tied = (s == r_m[..., None]).sum(-1) > 1
  finite = np.isfinite(r_m)
  r = np.where(finite, r_m, c(0))
  shift = np.where(
    tied & (r > 0), c(tie_beta - 1) * r, np.where(tied & (r < 0), -r, c(0))
  ).astype(c)
  tiny = ml_dtypes.finfo(FORMATS[em.stages["softmax_stats"]]).tiny
  cap = c(-0.5 * np.log(float(tiny)))
  wrapped = (cap - c(1)) + (shift - np.floor(shift))
  shift = np.where(shift > cap, wrapped, shift)
  return np.where(finite, em.r(r + shift, "softmax_stats"), r_m)


def _pad(x, length):
  return np.concatenate(
    [x, np.zeros((length - x.shape[0],) + x.shape[1:], x.dtype)]
  )


def _mask(q_start, k_start, bq, bk, kv_len, causal):
  qi = q_start + np.arange(bq)[:, None]
  kj = k_start + np.arange(bk)[None, :]
  m = kj < kv_len
  if causal:
    m = m & (kj <= qi)
  return m


def _heads(q, k):
  heads, kv_heads = q.shape[2], k.shape[2]
  return [(h, h // (heads // kv_heads)) for h in range(heads)]


def forward(
  q, k, v, stages, *, block_q, block_k, scheme, causal, tie_beta=None
):
  """Flash forward (fa1 or fa2). Returns (out float64, lse float64 [B,H,T])."""
  em = Emulator(stages)
  q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  batch, t, heads, d = q.shape
  s_len = k.shape[1]
  tp = math.ceil(t / block_q) * block_q
  sp = math.ceil(s_len / block_k) * block_k
  scale = d**-0.5
  out = np.zeros((batch, tp, heads, d))
  lse = np.zeros((batch, heads, tp))
  for b in range(batch):
    for h, hk in _heads(q, k):
      qh, kh = _pad(q[b, :, h], tp), _pad(k[b, :, hk], sp)
      vh = _pad(v[b, :, hk], sp)
      for qs in range(0, tp, block_q):
        o, m, l_ = _forward_rows(
          em,
          qh[qs : qs + block_q],
          kh,
          vh,
          qs,
          scale,
          s_len,
          block_k,
          scheme,
          causal,
          tie_beta,
        )
        out[b, qs : qs + block_q, h] = o
        lse[b, h, qs : qs + block_q] = em.r(m + em.log(l_), "softmax_stats")
  return out[:, :t], lse


def _forward_rows(
  em, qb, kh, vh, qs, scale, kv_len, block_k, scheme, causal, tie_beta
):
  bq, d = qb.shape
  sp = kh.shape[0]
  n_k = sp // block_k
  upper = min((qs + bq - 1) // block_k + 1, n_k) if causal else n_k
  acc = np.zeros((bq, d), em.carrier)
  m = np.full((bq,), -np.inf, em.carrier)
  l_ = np.zeros((bq,), em.carrier)
  st = lambda x: em.r(x, "softmax_stats")  # noqa: E731
  oa = lambda x: em.r(x, "out_accum")  # noqa: E731
  for j in range(upper):
    ks = j * block_k
    kb, vb = kh[ks : ks + block_k], vh[ks : ks + block_k]
    s = em.scores(qb, kb, scale, _mask(qs, ks, bq, block_k, kv_len, causal))
    m_block = tie_safe_max(em, s, s.max(-1), tie_beta)
    m_new = np.maximum(m, m_block)
    with np.errstate(invalid="ignore"):
      alpha = em.exp(st(m - m_new))
    row_sum = lambda p: st(em.total(p, "matmul_accum"))  # noqa: E731
    if scheme == "fa2":
      p = em.exp(st(s - m_new[:, None]))
      l_ = st(st(alpha * l_) + row_sum(p))
      pv = oa(em.dot(em.r(p, "probs"), vb))
      acc = oa(oa(oa(alpha)[:, None] * acc) + pv)
    else:
      m_ref = np.where(m_block == -np.inf, m_new, m_block)
      p = em.exp(st(s - m_ref[:, None]))
      beta = em.exp(st(m_ref - m_new))
      old_sum = st(alpha * l_)
      l_ = st(old_sum + st(beta * row_sum(p)))
      pv = oa(em.dot(em.r(p, "probs"), vb))
      old_w = oa(st(old_sum / l_))
      new_w = oa(st(beta / l_))
      acc = oa(oa(old_w[:, None] * acc) + oa(new_w[:, None] * pv))
    m = m_new
  if scheme == "fa2":
    acc = oa(acc * oa(st(em.carrier(1.0) / l_))[:, None])
  return em.r(acc, "output"), m, l_


def reference(q, k, v, stages, *, causal, tie_beta=None):
  """Materialized baseline attention."""
  em = Emulator(stages)
  q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  batch, t, heads, d = q.shape
  s_len = k.shape[1]
  st = lambda x: em.r(x, "softmax_stats")  # noqa: E731
  out = np.zeros(q.shape)
  mask = _mask(0, 0, t, s_len, s_len, causal)
  for b in range(batch):
    for h, hk in _heads(q, k):
      s = em.scores(q[b, :, h], k[b, :, hk], d**-0.5, mask)
      m = tie_safe_max(em, s, s.max(-1), tie_beta)[:, None]
      p = em.exp(st(s - m))
      l_ = st(em.total(p, "matmul_accum", keepdims=True))
      p = em.r(st(p * st(1.0 / l_)), "probs")
      o = em.r(em.r(em.dot(p, v[b, :, hk]), "out_accum"), "output")
      out[b, :, h] = o
  return out


def _probs_and_ds(em, x, qs, ks, block_q, block_k, kv_len, causal):
  """Recomputed P and dS of one tile, both rounded to `probs`."""
  st = lambda y: em.r(y, "softmax_stats")  # noqa: E731
  rows, cols = slice(qs, qs + block_q), slice(ks, ks + block_k)
  d = x["q"].shape[-1]
  mask = _mask(qs, ks, block_q, block_k, kv_len, causal)
  s = em.scores(x["q"][rows], x["k"][cols], d**-0.5, mask)
  p = em.exp(st(s - st(x["lse"][rows])[:, None]))
  dp = st(em.dot(x["do"][rows], x["v"][cols].T))
  ds = st(p * st(dp - st(x["delta"][rows])[:, None]))
  return em.r(p, "probs"), em.r(ds, "probs")


def backward(q, k, v, d_out, stages, *, block_q, block_k, scheme, causal):
  """(dq, dk, dv) of the flash kernel: delta, dK/dV and dQ passes."""
  em = Emulator(stages)
  out, lse = forward(
    q,
    k,
    v,
    stages,
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
  )
  q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  d_out = em.r(d_out, "output")
  batch, t, heads, d = q.shape
  s_len, kv_heads = k.shape[1], k.shape[2]
  tp = math.ceil(t / block_q) * block_q
  sp = math.ceil(s_len / block_k) * block_k
  scale = em.carrier(d**-0.5)
  g = lambda x: em.r(x, "grad_accum")  # noqa: E731
  dq = np.zeros((batch, t, heads, d))
  dk_per_head = np.zeros((batch, sp, heads, d), em.carrier)
  dv_per_head = np.zeros((batch, sp, heads, d), em.carrier)
  for b in range(batch):
    for h, hk in _heads(q, k):
      qh, doh = _pad(q[b, :, h], tp), _pad(d_out[b, :, h], tp)
      oh = _pad(out[b, :, h], tp)
      kh, vh = _pad(k[b, :, hk], sp), _pad(v[b, :, hk], sp)
      delta = em.total(
        em.r(em.r(oh, "delta") * em.r(doh, "delta"), "delta"), "delta"
      )
      lse_h = lse[b, h]

      rows_of = dict(q=qh, k=kh, v=vh, do=doh, lse=lse_h, delta=delta)
      for ks in range(0, sp, block_k):
        dk_acc = np.zeros((block_k, d), em.carrier)
        dv_acc = np.zeros((block_k, d), em.carrier)
        lower = ks // block_q if causal else 0
        for qi in range(lower, tp // block_q):
          qs = qi * block_q
          p, ds = _probs_and_ds(
            em, rows_of, qs, ks, block_q, block_k, s_len, causal
          )
          dv_step = g(em.dot(p.T, doh[qs : qs + block_q]))
          dk_step = em.r(
            em.dot(ds.T, qh[qs : qs + block_q]) * scale, "matmul_accum"
          )
          dk_acc = g(dk_acc + g(dk_step))
          dv_acc = g(dv_acc + dv_step)
        dk_per_head[b, ks : ks + block_k, h] = dk_acc
        dv_per_head[b, ks : ks + block_k, h] = dv_acc
      for qs in range(0, tp, block_q):
        dq_acc = np.zeros((block_q, d), em.carrier)
        n_k = sp // block_k
        upper = min((qs + block_q - 1) // block_k + 1, n_k) if causal else n_k
        for j in range(upper):
          ks = j * block_k
          _, ds = _probs_and_ds(
            em, rows_of, qs, ks, block_q, block_k, s_len, causal
          )
          dq_step = em.r(
            em.dot(ds, kh[ks : ks + block_k]) * scale, "matmul_accum"
          )
          dq_acc = g(dq_acc + g(dq_step))
        rows = slice(qs, min(qs + block_q, t))
        dq[b, rows, h] = dq_acc[: rows.stop - qs]
  group = heads // kv_heads

  def sum_groups(x):
    x = x.reshape(batch, sp, kv_heads, group, d)[:, :s_len]
    if group == 1:
      return x[:, :, :, 0]
    return em.total(x, "grad_accum", axis=3)

  dk, dv = sum_groups(dk_per_head), sum_groups(dv_per_head)
  return tuple(em.r(x, "inputs").astype(np.float64) for x in (dq, dk, dv))
