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


def _attention(q, k, v, *, guard=True, running_max=True, **features):
  """softmax(q k^T / sqrt(d) + bias) v in FP32 over the allowed pairs."""
  spec, ops = Features.of(features).split(q.shape, k.shape)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  s = jnp.einsum("bthd,bshd->bhts", f32[0], f32[1]) * q.shape[-1] ** -0.5
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
