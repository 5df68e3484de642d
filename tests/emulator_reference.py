"""The Baseline (materialized attention) of the emulator: S, P and P V
over whole rows, each rounded where the policy says."""

from __future__ import annotations

import numpy as np
from emulator_arithmetic import (
  Features,
  head_pairs,
  prepared_inputs,
  probs_times_values,
  tie_safe_max,
)


def reference(
  q,
  k,
  v,
  stages,
  *,
  causal,
  tie_beta=None,
  options=None,
  block_q=64,
  block_k=64,
  **kw,
):
  """Materialized baseline attention; `options` are the policy's
  quantization options (block scaling groups block_q / block_k rows), `kw`
  the features."""
  em, (q, k, v), scales = prepared_inputs(
    stages, options, (q, k, v), block_q, block_k
  )
  batch, t, heads, d = q.shape
  s_len = k.shape[1]
  f = Features(d, causal, **kw)
  c = em.carrier
  st = lambda x: em.r(x, "softmax_stats")  # noqa: E731
  base2 = em.options["exp2"]
  out = np.zeros(q.shape)
  for b in range(batch):
    for h, hk in head_pairs(q, k):
      allowed = f.allowed(b, h, t, s_len, t, s_len)
      head_scales = None
      if scales is not None:
        head_scales = (scales[0][b, h], scales[1][b, hk])
      s, _ = em.scores(
        q[b, :, h],
        k[b, :, hk],
        f,
        allowed,
        f.bias_of(b, h, t, s_len),
        head_scales,
        base2,
      )
      m = tie_safe_max(em, s, s.max(-1), tie_beta)
      if f.sink is not None:
        sink = em.in_base(f.sink[h], "softmax_stats", base2)
        m = np.maximum(m, sink)
      m = np.where(m == -np.inf, c(0), m)[:, None]
      p = em.exp(st(s - m), base2)
      l_ = st(em.total(p, "matmul_accum", keepdims=True))
      if f.sink is not None:
        l_ = st(l_ + em.exp(st(sink - m), base2))
      l_ = np.where(l_ == 0, c(1), l_)
      p = st(p * st(1.0 / l_))
      sv = None if scales is None else scales[2][b, hk]
      o = _reference_pv(em, p, v[b, :, hk], sv)
      out[b, :, h] = em.r(em.r(o, "out_accum"), "output")
  return out


def _reference_pv(em, p, v, sv):
  """The Baseline's P V: one scale of V factors out of the sum over keys
  (as in the kernel's `probs_times_values`); per-block scales are
  multiplied back into V before the matmul."""
  c = em.carrier
  p_scale = em.options["p_scale"]
  if sv is None or em.options["scaling"] != "block":
    return probs_times_values(em, p, v, sv)
  p_hat = em.r((p * c(p_scale)).astype(c), "probs")
  v_dq = (
    em.r((v * (c(1) / sv)[:, None]).astype(c), "matmul_operands") * sv[:, None]
  )
  wide = p_hat.astype(np.float64) @ v_dq.astype(c).astype(np.float64)
  pv = em.r(wide.astype(c), "matmul_accum")
  return (pv * c(1.0 / p_scale)).astype(c)
