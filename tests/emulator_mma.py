"""The tensor core's accumulator, emulated (policy options mma_chunk,
mma_rounding, promote_every): a matmul's reduction added k products at a
time into an accumulator in `matmul_accum`, each add formed in the carrier
and rounded to nearest or toward zero; and the two-level output
accumulation of the forward kernel. Also Q K^T in head-dim chunks summed
pairwise (score_chunk). Written from the documented semantics
(docs/precision.md), sharing no code with `stableattn`."""

from __future__ import annotations

import numpy as np

MANTISSA_BITS = {"fp32": 23, "fp22": 13, "bf16": 7}


def round_accumulator(em, x):
  """x (carrier) rounded to `matmul_accum` by `mma_rounding`."""
  x = np.asarray(x, em.carrier)
  if em.options["mma_rounding"] == "nearest":
    return em.r(x, "matmul_accum")
  drop = 23 - MANTISSA_BITS[em.stages["matmul_accum"]]
  bits = x.astype(np.float32).view(np.uint32)
  kept = bits & np.uint32((0xFFFFFFFF >> drop) << drop)
  return kept.view(np.float32).astype(em.carrier)


def mma_dot(em, a, b, probs=False, acc=None):
  """a @ b with a's columns taken `mma_chunk` at a time, each chunk's exact
  sum (in float64, then the carrier) added into `acc` (zero if None)."""
  if probs and em.quantizes:
    a = np.asarray(a, em.carrier).astype(np.float64)
  else:
    a = em.operand(a).astype(np.float64)
  b = em.operand(b).astype(np.float64)
  k, c = em.options["mma_chunk"], em.carrier
  for start in range(0, a.shape[1], k):
    part = (a[:, start : start + k] @ b[start : start + k]).astype(c)
    acc = round_accumulator(em, part if acc is None else (acc + part).astype(c))
  return acc


def blocked_dot(em, a, b):
  """a @ b with a's columns `score_chunk` at a time: each chunk's exact
  sum in the carrier, the chunk sums added pairwise in the carrier, the
  total rounded to `matmul_accum`."""
  a = em.operand(a).astype(np.float64)
  b = em.operand(b).astype(np.float64)
  k = em.options["score_chunk"]
  sums = [
    (a[:, i : i + k] @ b[i : i + k]).astype(em.carrier)
    for i in range(0, a.shape[1], k)
  ]
  while len(sums) > 1:
    odd = sums[-1:] if len(sums) % 2 else []
    sums = [(x + y).astype(em.carrier) for x, y in zip(*[iter(sums)] * 2)]
    sums += odd
  return em.r(sums[0], "matmul_accum")


def raw_probs_times_values(em, p, vb, sv, acc, per_channel=False):
  """(P V added into `acc`, before descaling; the descale factor): the
  kernel's P V, V's scale one per tile or (per_channel) per column."""
  c = em.carrier
  p_scale = em.options["p_scale"]
  if sv is None and p_scale == 1.0:
    return mma_dot(em, em.r(p, "probs"), vb, acc=acc), c(1)
  p_hat = em.round_probs((p * c(p_scale)).astype(c))
  if sv is None:
    return mma_dot(em, p_hat, vb, probs=True, acc=acc), c(1.0 / p_scale)
  if per_channel:
    v_hat = (vb * (c(1) / sv)[None, :]).astype(c)
    pv = mma_dot(em, p_hat, v_hat, probs=True, acc=acc)
    return pv, (sv * c(1.0 / p_scale)).astype(c)[None, :]
  v_hat = (vb * (c(1) / sv)[:, None]).astype(c)
  pv = mma_dot(em, p_hat, v_hat, probs=True, acc=acc)
  return pv, c(c(sv[0]) * c(1.0 / p_scale))


def two_level_step(em, acc, mma, alpha, add_pv, visited):
  """One key tile with P V kept in the MMA accumulator: both rescaled by
  alpha, P V added into it, and every `promote_every` visited tiles
  (never if 0) it is descaled into the FP32 output and restarted."""
  oa = lambda x: em.r(x, "out_accum")  # noqa: E731
  t, _ = mma
  a = oa(alpha)[:, None]
  t, descale = add_pv(oa(a * t))
  acc = oa(a * acc)
  every = em.options["promote_every"]
  if every and (visited + 1) % every == 0:
    return promote(em, acc, (t, descale)), (np.zeros_like(t), descale)
  return acc, (t, descale)


def promote(em, acc, mma):
  """The output accumulator plus the MMA accumulator, descaled."""
  t, descale = mma
  oa = lambda x: em.r(x, "out_accum")  # noqa: E731
  return oa(acc + oa((t * descale).astype(em.carrier)))
