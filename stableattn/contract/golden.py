"""The golden value: attention and its gradients in plain NumPy float64.

Independent of JAX and its settings, so it stays FP64 whether or not JAX
64-bit mode is on. Gradients are written from the formulas, not by finite
differences or autodiff. The features (masks, softcap, bias, sink) take the
arguments of `stableattn.attention` and follow `masking.py`.
"""

from __future__ import annotations

import numpy as np

from stableattn.contract import masking
from stableattn.contract.features import Features
from stableattn.contract.shapes import check_shapes


def _as_f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def _validate(q, k, v, features: dict):
  """The same checks and messages as `stableattn.attention`; the features'
  spec and operands (NumPy)."""
  q, k, v = (np.asarray(x) for x in (q, k, v))
  check_shapes(q, k, v)
  return Features.of(features).split(q.shape, k.shape, xp=np)


def _grouped(q, k):
  """q [B,T,H,D] -> [B,Hkv,G,T,D]; k [B,S,Hkv,D] -> [B,Hkv,S,D]."""
  batch, q_len, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  q_g = q.reshape(batch, q_len, kv_heads, heads // kv_heads, head_dim)
  return q_g.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3)


def _per_group(x):
  """[B,Hkv,S,D] -> [B,Hkv,1,S,D]: one matrix shared by a head group."""
  return x[:, :, None]


def _head_grouped(x, kv_heads: int):
  """[B|1, H|1, T, S] -> [B|1, Hkv|1, G|1, T, S]."""
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kv_heads, -1, *x.shape[2:])


class _Forward:
  """P, O and what the gradients need, in float64."""

  def __init__(self, q, k, v, spec, ops, logit_error=None):
    self.q, self.k, self.v = q, k, v
    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    self.kv_heads = kv_heads
    self.q_g, self.k_t = _grouped(q, k)
    self.v_t = v.transpose(0, 2, 1, 3)
    # Broadcast matmuls run in BLAS (an einsum over 5-D operands does not):
    # FP64 either way, ~20x faster at length 8192.
    x = np.matmul(self.q_g, _per_group(self.k_t).swapaxes(-1, -2))
    self.tanh = None
    if spec.softcap is None:
      s = x * spec.scale
    else:
      self.tanh = np.tanh(x * (spec.scale / spec.softcap))
      s = spec.softcap * self.tanh
    if ops.bias is not None:
      s = s + _head_grouped(_as_f64(ops.bias), kv_heads)
    if logit_error is not None:
      s = s + logit_error
    allowed = masking.allowed_pairs(spec, ops, q_len, kv_len, xp=np)
    s = np.where(_head_grouped(allowed, kv_heads), s, -np.inf)
    self.s = s
    m = s.max(axis=-1, keepdims=True)
    self.sink = None
    if ops.sink is not None:
      self.sink = _as_f64(ops.sink).reshape(1, kv_heads, -1, 1, 1)
      m = np.maximum(m, self.sink)
    m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(invalid="ignore"):
      p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    if self.sink is not None:
      total = total + np.exp(self.sink - m)
      self.lse = m + np.log(total)
    # A row no key attends (and no sink) has total 0: P = 0, output 0.
    self.p = p / np.where(total == 0, 1.0, total)
    self.o = np.matmul(self.p, _per_group(self.v_t))
    self.scale = spec.scale
    self.shape = (batch, q_len, heads, v.shape[3])

  def output(self):
    return self.o.transpose(0, 3, 1, 2, 4).reshape(self.shape)


def golden_attention(q, k, v, causal: bool = False, **features) -> np.ndarray:
  """softmax(Q K^T * scale) V in float64, with `stableattn.attention`'s
  features (causal_alignment, local_window_size, query_seq_lengths,
  key_value_seq_lengths, segment_ids, bias, mask, scale, softcap, sink).

  Args:
    q: [batch, q_len, heads, head_dim]; any float dtype (converted to f64).
    k: [batch, kv_len, kv_heads, head_dim]; kv_heads divides heads.
    v: [batch, kv_len, kv_heads, head_dim_v] (head_dim_v: MLA's value
      head dim, or head_dim).
    causal: mask keys after the query position (top-left aligned unless
      causal_alignment="bottom_right").

  Returns:
    float64 array [batch, q_len, heads, head_dim_v].
  """
  spec, ops = _validate(q, k, v, dict(features, causal=causal))
  return _Forward(_as_f64(q), _as_f64(k), _as_f64(v), spec, ops).output()


def _logit_ulps(f: _Forward, dtype) -> np.ndarray:
  """An ulp of `dtype` at each logit's largest partial sum: |s|, or with
  no softcap c sum_d |q_d k_d| where that is larger (a dot of terms that
  cancel rounds at the size its partial sums pass through, not at its
  result's); 0 where masked. float64 [b, kv_heads, group, q, kv]."""
  finite = np.isfinite(f.s)
  magnitude = np.where(finite, np.abs(f.s), 0.0)
  if f.tanh is None:
    terms = np.matmul(np.abs(f.q_g), _per_group(np.abs(f.k_t)).swapaxes(-1, -2))
    magnitude = np.maximum(magnitude, np.where(finite, terms * f.scale, 0.0))
  ulps = np.spacing(magnitude.astype(dtype)).astype(np.float64)
  return np.where(finite, ulps, 0.0)


def logit_sensitivity(q, k, v, dtype, causal: bool = False, **features):
  """How far each output element moves, to first order, when every logit
  moves by one ulp u_ij of `dtype` (at its largest partial sum,
  `_logit_ulps`): sum_j P_ij u_ij |v_j - o_i|, float64 [batch, q_len,
  heads, head_dim].

  Two correct kernels' logits differ by about that much: one scales q,
  another q and k by sqrt(scale) (PyTorch's math path), another the
  product, and each sums the dot in its own order. At logits of
  thousands an FP32 ulp is 1e-3, so the output of rows whose weights are
  spread over keys is uncertain by as much, whatever the kernel.
  """
  spec, ops = _validate(q, k, v, dict(features, causal=causal))
  f = _Forward(_as_f64(q), _as_f64(k), _as_f64(v), spec, ops)
  weights = f.p * _logit_ulps(f, dtype)
  v_t = _per_group(f.v_t)[..., None, :, :]  # [b, kv_heads, 1, 1, kv, d]
  out = np.empty_like(f.o)
  chunk = 64  # queries at a time: the [q, kv, d] differences stay small
  for start in range(0, f.o.shape[3], chunk):
    rows = slice(start, start + chunk)
    spread = np.abs(v_t - f.o[:, :, :, rows, None, :])
    out[:, :, :, rows] = np.einsum(
      "bhgqk,bhgqkd->bhgqd", weights[:, :, :, rows], spread
    )
  return out.transpose(0, 3, 1, 2, 4).reshape(f.shape)


def _rounding_error(s, draw: int) -> np.ndarray:
  """A number in [-1, 1) for each logit, a hash of its value and `draw`
  (splitmix64's mix of its bits): equal logits get equal errors, as a
  kernel rounds equal dot products alike (equal queries' rows, whose
  gradients may cancel, stay equal)."""
  bits = np.where(np.isfinite(s), s, 0.0).view(np.uint64)
  with np.errstate(over="ignore"):
    z = bits + np.uint64((draw + 1) * 0x9E3779B97F4A7C15 % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
  unit = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
  return 2.0 * unit - 1.0


def gradient_logit_sensitivity(
  q, k, v, d_out, dtype, causal: bool = False, draws: int = 3, **features
):
  """How far dQ, dK and dV move when every logit moves by an error within
  one ulp u of `dtype` (at its largest partial sum, `_logit_ulps`), as
  two correct kernels' logits differ: the largest change of the FP64
  gradients over `draws` draws of errors spread uniformly over [-u, u]
  and fixed by the logit's value (`_rounding_error`), float64, shaped
  like q, k and v.

  Measured, not bounded: a bound with the errors' signs aligned adds up
  the keys of a row that roundings largely cancel over, and at scores
  that rise along the keys it came to 10x what correct kernels differ
  by. Rows one key holds do not move (softmax ignores a shift every
  logit shares, and the others' P stays 0).
  """
  spec, ops = _validate(q, k, v, dict(features, causal=causal))
  q, k, v, d_out = _as_f64(q), _as_f64(k), _as_f64(v), _as_f64(d_out)
  exact = _Forward(q, k, v, spec, ops)
  ulps = _logit_ulps(exact, dtype)
  unmoved = _gradients(exact, d_out, spec, ops)[:3]
  moved = [np.zeros_like(g) for g in unmoved]
  for draw in range(draws):
    error = _rounding_error(exact.s, draw) * ulps
    shifted = _Forward(q, k, v, spec, ops, logit_error=error)
    grads = _gradients(shifted, d_out, spec, ops)[:3]
    moved = [
      np.maximum(m, np.abs(g - u)) for m, g, u in zip(moved, grads, unmoved)
    ]
  return tuple(moved)


def golden_attention_vjp(q, k, v, d_out, causal: bool = False, **features):
  """Gradients of `golden_attention` for the output cotangent `d_out`.

  With X = Q K^T, S = c X (or softcap * tanh(c X / softcap)) + bias,
  P = softmax(S), O = P V:
    dV = P^T dO,  dP = dO V^T,  delta = rowsum(dO * O),
    dS = P * (dP - delta),  dX = dS * c (times 1 - tanh^2 with softcap),
    dQ = dX K,  dK = dX^T Q,  d bias = dS,
    d sink = -sum_rows p_sink * delta (p_sink = exp(sink - lse)),
  where dK, dV of a shared (GQA) key/value head sum over its query heads
  and d bias over the axes it is broadcast along.

  Returns:
    (dq, dk, dv) in float64, shaped like q, k, v; then d bias if a bias is
    given, then d sink if a sink is given.
  """
  spec, ops = _validate(q, k, v, dict(features, causal=causal))
  out_shape = (*np.shape(q)[:3], np.shape(v)[3])
  if np.shape(d_out) != out_shape:
    raise ValueError(
      f"d_out must be shaped like the output {out_shape} (q's with v's "
      f"head dim), got {np.shape(d_out)}."
    )
  q, k, v, d_out = _as_f64(q), _as_f64(k), _as_f64(v), _as_f64(d_out)
  return _gradients(_Forward(q, k, v, spec, ops), d_out, spec, ops)


def _gradients(fwd: _Forward, d_out, spec, ops) -> tuple:
  """`golden_attention_vjp`'s values from a forward pass (float64)."""
  q, k = fwd.q, fwd.k
  batch, q_len, heads, head_dim = q.shape
  do_g, _ = _grouped(d_out, k)
  p, v_t, k_t = fwd.p, fwd.v_t, fwd.k_t
  dv = np.matmul(p.swapaxes(-1, -2), do_g).sum(axis=2)
  dp = np.matmul(do_g, _per_group(v_t).swapaxes(-1, -2))
  delta = np.sum(do_g * fwd.o, axis=-1, keepdims=True)
  ds = p * (dp - delta)
  dx = ds * fwd.scale
  if fwd.tanh is not None:
    dx = dx * (1.0 - fwd.tanh**2)
  dq = np.matmul(dx, _per_group(k_t))
  dk = np.matmul(dx.swapaxes(-1, -2), fwd.q_g).sum(axis=2)
  dq = dq.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, heads, head_dim)
  grads = [dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)]
  if ops.bias is not None:
    d_bias = ds.reshape(batch, heads, q_len, -1)
    per_example, per_head = spec.bias
    if not per_example:
      d_bias = d_bias.sum(axis=0, keepdims=True)
    if not per_head:
      d_bias = d_bias.sum(axis=1, keepdims=True)
    grads.append(d_bias)
  if fwd.sink is not None:
    p_sink = np.exp(fwd.sink - fwd.lse)
    grads.append(-(p_sink * delta).sum(axis=(0, 3, 4)).reshape(heads))
  return tuple(grads)
