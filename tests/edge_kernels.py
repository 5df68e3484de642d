"""Six attention kernels, each wrong at one edge only: they pass the
default audit (benign inputs, whole tiles, many queries, one example) and
must fail the edge audit for their named reason.

Each is plain FP32 attention on the audit's contract, taking the features
the edge regimes and invariance probes pass, with one defect.
"""

import functools

import jax
import jax.numpy as jnp

from stableattn.contract import masking
from stableattn.contract.features import Features


def _grouped(x, heads):
  """K or V repeated over each group of query heads (GQA)."""
  return jnp.repeat(x, heads // x.shape[2], axis=2)


def _attention(
  q, k, v, *, guard=True, running_max=True, scale=None, **features
):
  """softmax(q k^T * scale + bias) v in FP32 over the allowed pairs
  (scale 1/sqrt of q's head dim unless given)."""
  spec, ops = Features.of(features).split(q.shape, k.shape)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  k, v = (_grouped(x, q.shape[2]) for x in (k, v))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  s = jnp.einsum("bthd,bshd->bhts", f32[0], f32[1]) * scale
  if ops.bias is not None:
    s = s + ops.bias.astype(jnp.float32)
  allowed = masking.allowed_pairs(spec, ops, q.shape[1], k.shape[1])
  s = jnp.where(allowed, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True) if running_max else 0.0
  if guard:  # a row no key attends: 0, not exp(-inf - -inf) = NaN
    m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  total = jnp.sum(p, axis=-1, keepdims=True)
  if guard:
    total = jnp.where(total == 0, 1.0, total)
  out = jnp.einsum("bhts,bshd->bthd", p / total, f32[2])
  return out.astype(q.dtype)


def nan_on_empty_rows(q, k, v, *, causal=False, causal_alignment="top_left",
                      query_seq_lengths=None, key_value_seq_lengths=None,
                      segment_ids=None):  # fmt: skip
  """A row no key may attend gives 0/0."""
  return _attention(
    q, k, v, guard=False, causal=causal, causal_alignment=causal_alignment,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths, segment_ids=segment_ids,
  )  # fmt: skip


def no_max_subtraction(q, k, v, *, causal=False):
  """exp(s) without a running max: overflows above 88.7 in FP32."""
  return _attention(q, k, v, running_max=False, causal=causal)


def v_scale_over_sequence(q, k, v, *, causal=False):
  """V stored as FP16 with one scale over the whole sequence, future keys
  included (an FP8-style per-tensor scale): row t depends on keys after t,
  far below any rule's tolerance."""
  v32 = v.astype(jnp.float32)
  scale = jnp.max(jnp.abs(v32)) / 448.0
  stored = (v32 / scale).astype(jnp.float16).astype(jnp.float32) * scale
  return _attention(q, k, stored, causal=causal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _wrong_single_query(q, k, v, causal):
  return _attention(q, k, v, causal=causal)


def _single_fwd(q, k, v, causal):
  return jax.vjp(lambda *a: _attention(*a, causal=causal), q, k, v)


def _single_bwd(causal, vjp, d_out):
  dq, dk, dv = vjp(d_out)
  if dq.shape[1] == 1:  # a decode step's dQ: a wrong factor
    dq = (1.5 * dq.astype(jnp.float32)).astype(dq.dtype)
  return dq, dk, dv


_wrong_single_query.defvjp(_single_fwd, _single_bwd)


def dq_wrong_for_single_query(q, k, v, *, causal=False):
  return _wrong_single_query(q, k, v, causal)


def drops_last_partial_tile(q, k, v, *, causal=False):
  """Keys past the last whole tile of 64 are never read."""
  whole = (k.shape[1] // 64) * 64 or k.shape[1]
  return _attention(q, k[:, :whole], v[:, :whole], causal=causal)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _batch_rounded_dk(q, k, v, causal):
  return _attention(q, k, v, causal=causal)


def _batch_bwd(causal, vjp, d_out):
  dq, dk, dv = vjp(d_out)
  if dk.shape[0] > 1:  # batched: dK through FP16 first (double rounding)
    # reduce_precision, not casts: XLA may fold a convert chain away.
    wide = dk.astype(jnp.float32)
    through_fp16 = jax.lax.reduce_precision(
      wide, exponent_bits=5, mantissa_bits=10
    )
    dk = through_fp16.astype(dk.dtype)
  return dq, dk, dv


_batch_rounded_dk.defvjp(_single_fwd, _batch_bwd)


def dk_rounded_in_a_batch(q, k, v, *, causal=False):
  return _batch_rounded_dk(q, k, v, causal)


# name -> what the edge audit must name in a failure
EXPECTED = {
  "nan_on_empty_rows": "regime empty_rows",
  "no_max_subtraction": "regime large_logits",
  "v_scale_over_sequence": "not causal_leak-invariant",
  "dq_wrong_for_single_query": "fails on dq at B16 T1",
  "drops_last_partial_tile": "fails on out at B1 T100 S100",
  "dk_rounded_in_a_batch": "not backward_batch-invariant",
}


# Kernels wrong in the regimes users reported (`reported_regimes.py`);
# each passes the default audit.


def scores_scaled_by_value_dim(q, k, v, *, causal=False):
  """MLA with the score scale taken from V's head dim (1/sqrt(128) where
  the query/key head dim is 192): right whenever the two dims agree."""
  return _attention(q, k, v, causal=causal, scale=v.shape[-1] ** -0.5)


def finite_mask_as_minus_inf(q, k, v, *, bias=None):
  """Scores at or below -1e30 taken as masked (-inf) and no guard for a
  row with no key left: a row fully masked by a finite bias of the
  format's minimum gives 0/0 (PyTorch #110213's symptom)."""
  k, v = (_grouped(x, q.shape[2]) for x in (k, v))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  s = jnp.einsum("bthd,bshd->bhts", f32[0], f32[1]) * q.shape[-1] ** -0.5
  if bias is not None:
    s = s + jnp.asarray(bias).astype(jnp.float32)
  s = jnp.where(s <= -1e30, -jnp.inf, s)
  p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
  p = p / jnp.sum(p, axis=-1, keepdims=True)
  return jnp.einsum("bhts,bshd->bthd", p, f32[2]).astype(q.dtype)


def split_merge_without_guard(
  q, k, v, *, num_splits=1, key_value_seq_lengths=None
):
  """Split-KV with a merge that weighs each split by exp(lse - max lse):
  a split with no key (past the length, or more splits than keys) has
  lse -inf and output 0/0 (flashinfer #4051's symptom)."""
  k, v = (_grouped(x, q.shape[2]) for x in (k, v))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  s_len = k.shape[1]
  s = jnp.einsum("bthd,bshd->bhts", f32[0], f32[1]) * q.shape[-1] ** -0.5
  if key_value_seq_lengths is not None:
    valid = jnp.arange(s_len)[None] < key_value_seq_lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
  bounds = [s_len * i // num_splits for i in range(num_splits + 1)]
  outs, lses = [], []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    part = s[..., lo:hi]
    m = jnp.max(part, axis=-1, keepdims=True, initial=-jnp.inf)
    p = jnp.exp(part - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    outs.append(jnp.einsum("bhts,bshd->bhtd", p / total, f32[2][:, lo:hi]))
    lses.append(m + jnp.log(total))
  lse = jnp.stack(lses)
  weights = jnp.exp(lse - jnp.max(lse, axis=0))
  weights = weights / jnp.sum(weights, axis=0)
  out = jnp.sum(weights * jnp.stack(outs), axis=0)
  return out.transpose(0, 2, 1, 3).astype(q.dtype)


# name -> (regime, what the audit must name in a failure)
REPORTED = {
  "scores_scaled_by_value_dim": ("head_dims", "regime head_dims"),
  "finite_mask_as_minus_inf": ("finite_mask", "regime finite_mask"),
  "split_merge_without_guard": ("empty_splits", "regime empty_splits"),
}
