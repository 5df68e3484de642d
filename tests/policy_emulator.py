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
  "fp8_e4m3": ml_dtypes.float8_e4m3fn,
  "fp8_e5m2": ml_dtypes.float8_e5m2,
  "fp4_e2m1": ml_dtypes.float4_e2m1fn,
  "int8": "int8",
}
# Formats whose casts saturate (documented): the largest finite value.
SATURATING = {"fp8_e4m3": 448.0, "fp4_e2m1": 6.0, "int8": 127.0}
LARGEST = {**SATURATING, "fp8_e5m2": 57344.0}


def cast(x, fmt_name):
  """x rounded to a format (a NumPy/ml_dtypes cast; saturating formats
  clip first, int8 rounds half to even; fp22, FP32 with 13 fraction bits,
  by integer arithmetic on the FP32 bits), back in x's dtype."""
  x = np.asarray(x)
  if fmt_name == "fp22":
    return _fp22(x.astype(np.float32)).astype(x.dtype)
  if fmt_name in SATURATING:
    x = np.clip(x, -SATURATING[fmt_name], SATURATING[fmt_name])
  if fmt_name == "int8":
    return np.round(x).astype(x.dtype)
  with np.errstate(over="ignore"):
    return x.astype(FORMATS[fmt_name]).astype(x.dtype)


# Microscaling as documented: values per shared scale, and the largest
# exponent of each element format's normal numbers (OCP MX v1.0).
MICRO_GROUPS = {"mx": 32, "nvfp4": 16}
ELEMENT_EMAX = {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp4_e2m1": 2}


def micro_round(x, fmt, scaling, tensor_scale=None):
  """x (FP32) quantized by groups along its last axis (zero-padded to a
  whole group) and dequantized: "mx" scales 2^(floor(log2 amax) - emax),
  "nvfp4" scales e4m3(amax / (6 t)) * t (1 * t if that is 0)."""
  x = np.asarray(x, np.float32)
  group = MICRO_GROUPS[scaling]
  *lead, n = x.shape
  padded = -(-n // group) * group
  xp = np.zeros((*lead, padded), np.float32)
  xp[..., :n] = x
  g = xp.reshape(*lead, padded // group, group)
  amax = np.abs(g).max(-1, keepdims=True)
  if scaling == "mx":
    _, exponent = np.frexp(amax)  # amax = m 2^e, m in [0.5, 1)
    shared = np.clip(exponent - 1 - ELEMENT_EMAX[fmt], -126, 127)
    scale = np.ldexp(np.float32(1), shared).astype(np.float32)
  else:
    t = np.float32(tensor_scale)
    inv = np.float32(1) / np.float32(np.float32(6) * t)
    block = cast((amax * inv).astype(np.float32), "fp8_e4m3")
    scale = (np.where(block > 0, block, np.float32(1)) * t).astype(np.float32)
  elements = cast((g * (np.float32(1) / scale)).astype(np.float32), fmt)
  out = (elements * scale).astype(np.float32).reshape(*lead, padded)
  return out[..., :n]


def _fp22(x):
  """Nearest even at 13 fraction bits: add half an ulp of the kept bits
  (less one unless the lowest kept bit is set) and clear the dropped bits."""
  bits = x.view(np.uint32).astype(np.uint64)
  kept_lsb = (bits >> 10) & 1
  bits = ((bits + 0x1FF + kept_lsb) & ~np.uint64(0x3FF)).astype(np.uint32)
  return bits.view(np.float32)


class Emulator:
  def __init__(self, stages: dict[str, str], options: dict | None = None):
    self.stages = dict(stages)
    self.options = dict(
      scaling="none",
      p_scale=1.0,
      hadamard=False,
      key_order="forward",
      smooth_k=False,
    )
    self.options.update(options or {})
    self.carrier = np.float64 if "fp64" in self.stages.values() else np.float32

  @property
  def quantizes(self):
    return self.stages["matmul_operands"] in LARGEST

  @property
  def micro(self):
    return self.options["scaling"] in MICRO_GROUPS

  def r(self, x, stage):
    """x rounded to `stage`, held in the carrier."""
    return cast(np.asarray(x, self.carrier), self.stages[stage])

  def round_probs(self, p):
    """P (times p_scale) as it enters P V; microscaled along keys, with
    NVFP4's static tensor scale p_scale / (448 * 6)."""
    fmt = self.stages["probs"]
    if not self.micro or fmt not in LARGEST:
      return self.r(p, "probs")
    t = np.float32(self.options["p_scale"] / (448.0 * 6.0))
    return micro_round(p, fmt, self.options["scaling"], t)

  def operand(self, x):
    if self.micro:  # quantized before (Q, K, V) or by round_probs (P)
      return np.asarray(x, self.carrier)
    return self.r(x, "matmul_operands")

  def dot(self, a, b, probs=False):
    """a @ b from operands in `matmul_operands`; below 16 bits P (a, if
    `probs`) enters P V as it is, in `probs`."""
    if probs and self.quantizes:
      a = np.asarray(a, self.carrier).astype(np.float64)
    else:
      a = self.operand(a).astype(np.float64)
    b = self.operand(b).astype(np.float64)
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

  def scores(self, q, k, f, mask, bias=None, scales=None):
    """(S, tanh of the softcap or None) of one tile; -inf where masked.
    `scales`: (q row scales, k row scales): Q/s_q and K/s_k enter the
    matmul, whose product is multiplied by s_q s_k."""
    c = self.carrier
    if scales is None:
      x = self.dot(q, k.T)
    else:
      sq, sk = (np.asarray(v, c) for v in scales)
      x = self.dot(
        (q * (c(1) / sq)[:, None]).astype(c),
        (k * (c(1) / sk)[:, None]).T.astype(c),
      )
      x = (x * (sq[:, None] * sk[None, :]).astype(c)).astype(c)
    tanh = None
    if f.softcap is None:
      s = self.r(x * c(f.scale), "scores")
    else:
      tanh = np.tanh((x * c(f.scale / f.softcap)).astype(np.float64)).astype(c)
      s = self.r(c(f.softcap) * tanh, "scores")
    s = self.r(s, "softmax_stats")
    if bias is not None:
      s = self.r(s + self.r(bias, "scores"), "softmax_stats")
    return np.where(mask, s, -np.inf).astype(c), tanh


class Features:
  """The attention features, from `stableattn.attention`'s arguments, as
  documented: a pair attends iff every feature in use allows it."""

  def __init__(self, head_dim, causal=False, **kw):
    self.causal = causal
    self.alignment = kw.get("causal_alignment", "top_left")
    window = kw.get("local_window_size")
    if isinstance(window, int):
      window = (window, window)
    self.window = window
    self.q_lengths = kw.get("query_seq_lengths")
    self.kv_lengths = kw.get("key_value_seq_lengths")
    segments = kw.get("segment_ids")
    if segments is not None and not isinstance(segments, tuple):
      segments = (segments, segments)
    self.segments = segments
    self.bias = kw.get("bias")
    self.mask = kw.get("mask")
    scale = kw.get("scale")
    self.scale = head_dim**-0.5 if scale is None else scale
    self.softcap = kw.get("softcap")
    self.sink = kw.get("sink")

  def allowed(self, b, h, t, s_len, padded_t, padded_s):
    """[padded_t, padded_s] boolean for example b, query head h."""
    q_n = t if self.q_lengths is None else int(self.q_lengths[b])
    kv_n = s_len if self.kv_lengths is None else int(self.kv_lengths[b])
    i = np.arange(padded_t)[:, None]
    j = np.arange(padded_s)[None, :]
    a = (i < q_n) & (j < kv_n)
    key_pos = j - (kv_n - q_n if self.alignment == "bottom_right" else 0)
    if self.causal:
      a &= key_pos <= i
    if self.window is not None:
      left, right = (None if w in (None, -1) else w for w in self.window)
      if left is not None:
        a &= key_pos >= i - left
      if right is not None:
        a &= key_pos <= i + right
    if self.segments is not None:
      q_seg = _pad(np.asarray(self.segments[0][b]), padded_t)
      kv_seg = _pad(np.asarray(self.segments[1][b]), padded_s)
      a &= q_seg[:, None] == kv_seg[None, :]
    if self.mask is not None:
      m = self.mask[b if self.mask.shape[0] > 1 else 0]
      m = m[h if m.shape[0] > 1 else 0]
      a &= _pad(_pad(m, padded_t).T, padded_s).T
    return a

  def bias_of(self, b, h, padded_t, padded_s):
    if self.bias is None:
      return None
    x = self.bias[b if self.bias.shape[0] > 1 else 0]
    x = np.asarray(x[h if x.shape[0] > 1 else 0], np.float64)
    return _pad(_pad(x, padded_t).T, padded_s).T


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


def _heads(q, k):
  heads, kv_heads = q.shape[2], k.shape[2]
  return [(h, h // (heads // kv_heads)) for h in range(heads)]


def hadamard_rotation(d):
  """diag(signs) H / sqrt(d) as documented: Sylvester's H, random signs
  from NumPy's default_rng(0).choice([-1, 1], d)."""
  h = np.ones((1, 1))
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  signs = np.random.default_rng(0).choice([-1.0, 1.0], d)
  return signs[:, None] * h, np.float32(d**-0.5)


def row_scales(x, em, block):
  """[B, heads, T] scales of x [B, T, heads, D]: amax / largest value of
  the operand format per group (the whole array, or block rows of one
  (batch, head)); 1 for an all-zero group or without scaling."""
  batch, t, heads, _ = x.shape
  scaling = em.options["scaling"]
  if scaling == "none" or scaling in MICRO_GROUPS:
    return np.ones((batch, heads, t), np.float32)
  largest = np.float32(LARGEST[em.stages["matmul_operands"]])
  mag = np.abs(x).astype(np.float32)

  def scale(amax):
    s = (np.float32(amax) * np.float32(1 / np.float64(largest))).astype(
      np.float32
    )
    return np.where(s > 0, s, np.float32(1))

  if scaling == "tensor":
    return np.full((batch, heads, t), scale(mag.max()), np.float32)
  if scaling == "token":
    return scale(mag.max(-1)).transpose(0, 2, 1).astype(np.float32)
  out = np.zeros((batch, heads, t), np.float32)
  for b in range(batch):
    for h in range(heads):
      for start in range(0, t, block):
        out[b, h, start : start + block] = scale(
          mag[b, start : start + block, h].max()
        )
  return out


def channel_scales(v, em):
  """[B, heads, D] scales of v: amax over tokens / largest value."""
  largest = np.float32(LARGEST[em.stages["matmul_operands"]])
  amax = np.abs(v).astype(np.float32).max(axis=1)
  s = (amax * np.float32(1 / np.float64(largest))).astype(np.float32)
  return np.where(s > 0, s, np.float32(1))


def per_channel(em):
  return em.options["scaling"] == "token"


def quantize_inputs(em, q, k, v, block_q, block_k):
  """Smoothed k (if `smooth_k`), rotated q, k (if `hadamard`) and the
  scales of q, k (rows) and v (rows, or channels with token scaling)."""
  if em.options.get("smooth_k"):
    # The documented mean: FP32 sum times FP32 1/n, rounded to BF16.
    k = k.astype(np.float32)
    total = np.sum(k.astype(np.float64), axis=1, keepdims=True)
    mean = total.astype(np.float32) * np.float32(1.0 / k.shape[1])
    k = (k - mean.astype(ml_dtypes.bfloat16).astype(np.float32)).astype(
      np.float32
    )
  if em.options["hadamard"]:
    signed_h, norm = hadamard_rotation(q.shape[-1])
    q, k = (
      ((x.astype(np.float64) @ signed_h).astype(np.float32) * norm)
      for x in (q, k)
    )
  if em.micro:
    fmt, scaling = em.stages["matmul_operands"], em.options["scaling"]

    def tensor_scale(x):
      s = np.float32(np.abs(x).max()) * np.float32(1 / (448.0 * 6.0))
      return s if s > 0 else np.float32(1)

    q, k = (micro_round(x, fmt, scaling, tensor_scale(x)) for x in (q, k))
    v = np.moveaxis(
      micro_round(np.moveaxis(v, 1, -1), fmt, scaling, tensor_scale(v)), -1, 1
    )
  return (
    q,
    k,
    v,
    (
      row_scales(q, em, block_q),
      row_scales(k, em, block_k),
      channel_scales(v, em) if per_channel(em) else row_scales(v, em, block_k),
    ),
  )


def _pv(em, p, vb, sv):
  """P V: round(P * p_scale) and round(V / s_v) (s_v one value per tile,
  or one per column), times s_v / p_scale; the plain product without
  scaling."""
  c = em.carrier
  p_scale = em.options["p_scale"]
  if sv is None and p_scale == 1.0:
    return em.dot(em.r(p, "probs"), vb)
  p_hat = em.round_probs((p * c(p_scale)).astype(c))
  if sv is None:
    return (em.dot(p_hat, vb, probs=True) * c(1.0 / p_scale)).astype(c)
  if per_channel(em):
    pv = em.dot(p_hat, (vb * (c(1) / sv)[None, :]).astype(c), probs=True)
    return (pv * (sv * c(1.0 / p_scale)).astype(c)[None, :]).astype(c)
  pv = em.dot(p_hat, (vb * (c(1) / sv)[:, None]).astype(c), probs=True)
  return (pv * (c(sv[0]) * c(1.0 / p_scale))).astype(c)


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
  **kw,
):
  """Flash forward (fa1 or fa2). Returns (out float64, lse float64 [B,H,T]);
  `options` are the policy's quantization options, `kw` the features.
  With `num_splits` or `split_size`, split-KV: each split's keys give a
  partial output (in `partials`) and lse, merged in split order."""
  em = Emulator(stages, options)
  q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  scales = None
  if em.quantizes:
    q, k, v, scales = quantize_inputs(em, q, k, v, block_q, block_k)
  batch, t, heads, d = q.shape
  s_len = k.shape[1]
  f = Features(d, causal, **kw)
  tp = math.ceil(t / block_q) * block_q
  sp = math.ceil(s_len / block_k) * block_k
  out = np.zeros((batch, tp, heads, d))
  lse = np.zeros((batch, heads, tp))
  for b in range(batch):
    for h, hk in _heads(q, k):
      qh, kh = _pad(q[b, :, h], tp), _pad(k[b, :, hk], sp)
      vh = _pad(v[b, :, hk], sp)
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
        for first, end in _split_blocks(
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
          with np.errstate(divide="ignore"):
            lse_rows = em.r(
              m + em.log(np.where(l_ == 0, 1, l_)), "softmax_stats"
            )
          parts.append((o, np.where(l_ == 0, -np.inf, lse_rows)))
        if num_splits is None and split_size is None:
          ((o, lse_rows),) = parts
          out[b, rows, h] = em.r(o, "output")
          lse[b, h, rows] = np.where(lse_rows == -np.inf, np.inf, lse_rows)
        else:
          out[b, rows, h], lse[b, h, rows] = _merge(em, parts)
  return out[:, :t], lse


def _split_blocks(key_blocks, num_splits, split_size, block_k):
  """(first, end) key-block ranges of the splits; one range without."""
  if split_size is not None:
    per = split_size // block_k
  elif num_splits is not None:
    per = -(-key_blocks // num_splits)
  else:
    return [(0, key_blocks)]
  return [(s, min(s + per, key_blocks)) for s in range(0, key_blocks, per)]


def _merge(em, parts):
  """lse = max + log(sum_s exp(lse_s - max)); O = sum_s exp(lse_s - lse)
  O_s, in split order; O_s in `partials`, sums in `out_accum`."""
  c = em.carrier
  st = lambda x: em.r(x, "softmax_stats")  # noqa: E731
  oa = lambda x: em.r(x, "out_accum")  # noqa: E731
  lses = [np.asarray(lse_s, c) for _, lse_s in parts]
  top = np.max(lses, axis=0)
  empty = top == -np.inf
  top = np.where(empty, c(0), top).astype(c)
  total = np.zeros_like(top)
  for lse_s in lses:
    total = st(total + em.exp(st(lse_s - top)))
  lse = st(top + em.log(np.where(empty, c(1), total)))
  out = np.zeros(parts[0][0].shape, c)
  for (o_s, _), lse_s in zip(parts, lses):
    weight = oa(em.exp(st(lse_s - lse)))
    out = oa(out + oa(weight[:, None] * em.r(o_s, "partials")))
  return em.r(out, "output"), np.where(empty, np.inf, lse)


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
  bq, d = qb.shape
  sp = kh.shape[0]
  c = em.carrier
  acc = np.zeros((bq, d), c)
  if sink is None:
    m = np.full((bq,), -np.inf, c)
    l_ = np.zeros((bq,), c)
  else:  # the sink: a logit with value 0, counted from the start
    m = np.full((bq,), em.r(sink, "softmax_stats"), c)
    l_ = np.ones((bq,), c)
  st = lambda x: em.r(x, "softmax_stats")  # noqa: E731
  oa = lambda x: em.r(x, "out_accum")  # noqa: E731
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
    )
    m_block = tie_safe_max(em, s, s.max(-1), tie_beta)
    m_new = np.maximum(m, m_block)
    m_use = np.where(m_new == -np.inf, c(0), m_new)
    alpha = em.exp(st(m - m_use))
    row_sum = lambda p: st(em.total(p, "matmul_accum"))  # noqa: E731
    if scheme == "fa2":
      p = em.exp(st(s - m_use[:, None]))
      l_ = st(st(alpha * l_) + row_sum(p))
      pv = oa(_pv(em, p, vb, sv))
      acc = oa(oa(oa(alpha)[:, None] * acc) + pv)
    else:
      m_ref = np.where(m_block == -np.inf, m_use, m_block)
      p = em.exp(st(s - m_ref[:, None]))
      beta = em.exp(st(m_ref - m_use))
      old_sum = st(alpha * l_)
      l_ = st(old_sum + st(beta * row_sum(p)))
      pv = oa(_pv(em, p, vb, sv))
      l_safe = np.where(l_ == 0, c(1), l_)
      old_w = oa(st(old_sum / l_safe))
      new_w = oa(st(beta / l_safe))
      acc = oa(oa(old_w[:, None] * acc) + oa(new_w[:, None] * pv))
    m = m_new
  if scheme == "fa2":
    l_safe = np.where(l_ == 0, c(1), l_)
    acc = oa(acc * oa(st(c(1.0) / l_safe))[:, None])
  return acc, m, l_


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
  em = Emulator(stages, options)
  q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  scales = None
  if em.quantizes:
    q, k, v, scales = quantize_inputs(em, q, k, v, block_q, block_k)
  batch, t, heads, d = q.shape
  s_len = k.shape[1]
  f = Features(d, causal, **kw)
  c = em.carrier
  st = lambda x: em.r(x, "softmax_stats")  # noqa: E731
  out = np.zeros(q.shape)
  for b in range(batch):
    for h, hk in _heads(q, k):
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
      )
      m = tie_safe_max(em, s, s.max(-1), tie_beta)
      if f.sink is not None:
        sink = em.r(f.sink[h], "softmax_stats")
        m = np.maximum(m, sink)
      m = np.where(m == -np.inf, c(0), m)[:, None]
      p = em.exp(st(s - m))
      l_ = st(em.total(p, "matmul_accum", keepdims=True))
      if f.sink is not None:
        l_ = st(l_ + em.exp(st(sink - m)))
      l_ = np.where(l_ == 0, c(1), l_)
      p = st(p * st(1.0 / l_))
      sv = None if scales is None else scales[2][b, hk]
      o = _reference_pv(em, p, v[b, :, hk], sv)
      out[b, :, h] = em.r(em.r(o, "out_accum"), "output")
  return out


def _reference_pv(em, p, v, sv):
  """The Baseline's P V: one scale of V factors out of the sum over keys
  (as in the kernel's `_pv`); per-block scales are multiplied back into V
  before the matmul."""
  c = em.carrier
  p_scale = em.options["p_scale"]
  if sv is None or em.options["scaling"] != "block":
    return _pv(em, p, v, sv)
  p_hat = em.r((p * c(p_scale)).astype(c), "probs")
  v_dq = (
    em.r((v * (c(1) / sv)[:, None]).astype(c), "matmul_operands") * sv[:, None]
  )
  wide = p_hat.astype(np.float64) @ v_dq.astype(c).astype(np.float64)
  pv = em.r(wide.astype(c), "matmul_accum")
  return (pv * c(1.0 / p_scale)).astype(c)


def _probs_and_ds(em, x, f, qs, ks, block_q, block_k):
  """Recomputed P, dS (both rounded to `probs`; dS with the softcap's
  slope) and dS of the biased scores (the bias gradient) of one tile."""
  st = lambda y: em.r(y, "softmax_stats")  # noqa: E731
  rows, cols = slice(qs, qs + block_q), slice(ks, ks + block_k)
  bias = None if x["bias"] is None else x["bias"][rows, cols]
  s, tanh = em.scores(
    x["q"][rows], x["k"][cols], f, x["allowed"][rows, cols], bias
  )
  with np.errstate(invalid="ignore"):
    p = em.exp(st(s - st(x["lse"][rows])[:, None]))
  p = np.where(np.isnan(p), 0, p)  # a row no key attends: lse = +inf
  dp = st(em.dot(x["do"][rows], x["v"][cols].T))
  ds_logits = st(p * st(dp - st(x["delta"][rows])[:, None]))
  ds = ds_logits
  if tanh is not None:
    ds = st(ds * st(1.0 - st(tanh * tanh)))
  return em.r(p, "probs"), em.r(ds, "probs"), ds_logits


def straight_through(q, k, v, stages, options, block_q, block_k):
  """The operands a quantizing forward's matmuls saw, round(x / s) * s in
  FP32 (after the rotation), and the backward's stages: every stage below
  16 bits but `inputs` in FP32 (documented straight-through backward)."""
  em = Emulator(stages, options)
  q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  q, k, v, scales = quantize_inputs(em, q, k, v, block_q, block_k)
  if em.micro:
    seen = [q, k, v]
    scales = ()
  else:
    seen = []
  for name, x, s in zip("qkv", (q, k, v), scales):
    if name == "v" and per_channel(em):
      s = s[:, None]  # [B, 1, heads, D]
    else:
      s = s.transpose(0, 2, 1)[..., None]  # [B, T, heads, 1]
    scaled = (x * (np.float32(1) / s)).astype(np.float32)
    seen.append(em.r(scaled, "matmul_operands") * s)
  wide = {
    stage: "fp32" if fmt in LARGEST and stage != "inputs" else fmt
    for stage, fmt in stages.items()
  }
  return seen, wide


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
  out, lse = forward(
    q,
    k,
    v,
    stages,
    block_q=block_q,
    block_k=block_k,
    scheme=scheme,
    causal=causal,
    options=options,
    **kw,
  )
  if Emulator(stages).quantizes:
    (q, k, v), stages = straight_through(
      q, k, v, stages, options, block_q, block_k
    )
  else:
    q, k, v = (Emulator(stages).r(x, "inputs") for x in (q, k, v))
  em = Emulator(stages)
  d_out = em.r(d_out, "output")
  batch, t, heads, d = q.shape
  s_len, kv_heads = k.shape[1], k.shape[2]
  f = Features(d, causal, **kw)
  tp = math.ceil(t / block_q) * block_q
  sp = math.ceil(s_len / block_k) * block_k
  scale = em.carrier(f.scale)
  g = lambda x: em.r(x, "grad_accum")  # noqa: E731
  dq = np.zeros((batch, t, heads, d))
  dk_per_head = np.zeros((batch, sp, heads, d), em.carrier)
  dv_per_head = np.zeros((batch, sp, heads, d), em.carrier)
  d_bias = np.zeros((batch, heads, tp, sp))
  d_sink = np.zeros(heads)
  for b in range(batch):
    for h, hk in _heads(q, k):
      qh, doh = _pad(q[b, :, h], tp), _pad(d_out[b, :, h], tp)
      oh = _pad(out[b, :, h], tp)
      kh, vh = _pad(k[b, :, hk], sp), _pad(v[b, :, hk], sp)
      delta = em.total(
        em.r(em.r(oh, "delta") * em.r(doh, "delta"), "delta"), "delta"
      )
      lse_h = lse[b, h]
      if f.sink is not None:
        p_sink = np.exp(np.float64(f.sink[h]) - lse_h[:t])
        d_sink[h] -= np.sum(p_sink * delta[:t])

      rows_of = dict(
        q=qh,
        k=kh,
        v=vh,
        do=doh,
        lse=lse_h,
        delta=delta,
        allowed=f.allowed(b, h, t, s_len, tp, sp),
        bias=f.bias_of(b, h, tp, sp),
      )
      for ks in range(0, sp, block_k):
        dk_acc = np.zeros((block_k, d), em.carrier)
        dv_acc = np.zeros((block_k, d), em.carrier)
        for qs in range(0, tp, block_q):
          if not rows_of["allowed"][qs : qs + block_q, ks : ks + block_k].any():
            continue  # an empty tile adds exact zeros
          p, ds, _ = _probs_and_ds(em, rows_of, f, qs, ks, block_q, block_k)
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
        for ks in range(0, sp, block_k):
          if not rows_of["allowed"][qs : qs + block_q, ks : ks + block_k].any():
            continue
          _, ds, ds_logits = _probs_and_ds(
            em, rows_of, f, qs, ks, block_q, block_k
          )
          d_bias[b, h, qs : qs + block_q, ks : ks + block_k] = ds_logits
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
  grads = [em.r(x, "inputs").astype(np.float64) for x in grads]
  if f.bias is not None:
    grads.append(em.r(d_bias[:, :, :t, :s_len], "grad_accum"))
  if f.sink is not None:
    grads.append(em.r(d_sink, "grad_accum"))
  return tuple(grads)
