"""The emulator's arithmetic: formats and their casts, microscaling, the
`Emulator` of one policy (each stage's rounding, dot products, exp, log),
the features' masks, and the quantization and split-KV helpers that the
algorithms in `policy_emulator.py` are written from. Shares no code with
`stableattn`."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from emulator_kv_cache import read_from_cache
from emulator_mma import blocked_dot, mma_dot
from emulator_stability import STABILITY_DEFAULTS

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
    return fp22(x.astype(np.float32)).astype(x.dtype)
  if fmt_name in SATURATING:
    x = np.clip(x, -SATURATING[fmt_name], SATURATING[fmt_name])
  if fmt_name == "int8":
    return np.round(x).astype(x.dtype)
  with np.errstate(over="ignore"):
    return x.astype(FORMATS[fmt_name]).astype(x.dtype)


# Microscaling as documented: values per shared scale, and the largest
# exponent of each element format's normal numbers (OCP MX v1.0).
MICRO_GROUPS = {"mx": 32, "nvfp4": 16}
# A policy with exp2 measures scores in base 2: the scale carries log2(e).
LOG2E = math.log2(math.e)
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


def fp22(x):
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
      exp2=False,
      **dict(mma_chunk=0, mma_rounding="nearest", score_chunk=0),
      **dict(promote_every=1, kv_cache="none", **STABILITY_DEFAULTS),
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

  def exp(self, x, base2=False):
    """exp (2^x with `base2`) correctly rounded to the carrier, then
    rounded to the stage."""
    with np.errstate(invalid="ignore"):
      wide = (np.exp2 if base2 else np.exp)(np.asarray(x, np.float64))
    return self.r(wide.astype(self.carrier), "softmax_stats")

  def in_base(self, x, stage, base2):
    """A logit (bias, sink) rounded to `stage`; with `base2` times log2(e),
    rounded again."""
    x = self.r(x, stage)
    if not base2:
      return x
    return self.r(x * self.carrier(LOG2E), stage)

  def lse(self, m, l_sum, base2=False):
    """m + log(l) in `softmax_stats`; with `base2` (m in base 2)
    (m + log2(l)) * ln(2)."""
    st = lambda x: self.r(x, "softmax_stats")  # noqa: E731
    with np.errstate(divide="ignore"):
      if not base2:
        return st(m + self.log(l_sum))
      log2 = st(np.log2(np.asarray(l_sum, np.float64)).astype(self.carrier))
      return st(st(m + log2) * self.carrier(math.log(2.0)))

  def log(self, x):
    wide = np.log(np.asarray(x, np.float64))
    return self.r(wide.astype(self.carrier), "softmax_stats")

  def scores(self, q, k, f, mask, bias=None, scales=None, base2=False):
    """(S, tanh of the softcap or None) of one tile; -inf where masked.
    `scales`: (q row scales, k row scales): Q/s_q and K/s_k enter the
    matmul, whose product is multiplied by s_q s_k. With `base2` the
    scale (or softcap) and the bias carry log2(e)."""
    c = self.carrier
    # QK^T summed once, or chunk by chunk (mma_chunk, score_chunk).
    dot = self.dot
    if self.options["mma_chunk"] or self.options["score_chunk"]:
      chunked = mma_dot if self.options["mma_chunk"] else blocked_dot
      dot = lambda a, b: chunked(self, a, b)  # noqa: E731
    if scales is None:
      x = dot(q, k.T)
    else:
      sq, sk = (np.asarray(v, c) for v in scales)
      x = dot(
        (q * (c(1) / sq)[:, None]).astype(c),
        (k * (c(1) / sk)[:, None]).T.astype(c),
      )
      x = (x * (sq[:, None] * sk[None, :]).astype(c)).astype(c)
    tanh = None
    to_base = LOG2E if base2 else 1.0
    if f.softcap is None:
      s = self.r(x * c(f.scale * to_base), "scores")
    else:
      tanh = np.tanh((x * c(f.scale / f.softcap)).astype(np.float64)).astype(c)
      s = self.r(c(f.softcap * to_base) * tanh, "scores")
    s = self.r(s, "softmax_stats")
    if bias is not None:
      s = self.r(s + self.in_base(bias, "scores", base2), "softmax_stats")
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
      q_seg = pad(np.asarray(self.segments[0][b]), padded_t)
      kv_seg = pad(np.asarray(self.segments[1][b]), padded_s)
      a &= q_seg[:, None] == kv_seg[None, :]
    if self.mask is not None:
      m = self.mask[b if self.mask.shape[0] > 1 else 0]
      m = m[h if m.shape[0] > 1 else 0]
      a &= pad(pad(m, padded_t).T, padded_s).T
    return a

  def bias_of(self, b, h, padded_t, padded_s):
    if self.bias is None:
      return None
    x = self.bias[b if self.bias.shape[0] > 1 else 0]
    x = np.asarray(x[h if x.shape[0] > 1 else 0], np.float64)
    return pad(pad(x, padded_t).T, padded_s).T


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


def pad(x, length):
  return np.concatenate(
    [x, np.zeros((length - x.shape[0],) + x.shape[1:], x.dtype)]
  )


def head_pairs(q, k):
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


def probs_times_values(em, p, vb, sv):
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


def split_ranges(key_blocks, num_splits, split_size, block_k):
  """(first, end) key-block ranges of the splits; one range without."""
  if split_size is not None:
    per = split_size // block_k
  elif num_splits is not None:
    per = -(-key_blocks // num_splits)
  else:
    return [(0, key_blocks)]
  return [(s, min(s + per, key_blocks)) for s in range(0, key_blocks, per)]


def merge_splits(em, parts):
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


def prepared_inputs(stages, options, qkv, block_q, block_k):
  """(the policy's Emulator, q/k/v rounded to `inputs` and, below 16
  bits, quantized, their scales or None): where every algorithm starts."""
  em = Emulator(stages, options)
  q, k, v = (em.r(x, "inputs") for x in qkv)
  k, v = read_from_cache(em, k, v, cast)
  scales = None
  if em.quantizes:
    q, k, v, scales = quantize_inputs(em, q, k, v, block_q, block_k)
  return em, (q, k, v), scales
