"""Invariances beyond a batch of equal-length rows.

Where kernels break reproducibility in practice: a decode row beside
prefill rows of other lengths (vLLM's mixed batches), rows packed by
segments against the same rows padded, the backward of a row alone
against the same row in a micro-batch (a grad-norm explosion in RL
training, verl #3595), and causal leakage, where a scale or a reduction
over a block of keys spans the future so a row depends on tokens it must
not see (TransformerEngine #3248). Each probe yields (reference, other,
golden) like `invariance.Prober`'s, which mixes these in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.auditing.inputs import round_to
from stableattn.contract.golden import golden_attention, golden_attention_vjp

EDGE_INVARIANCES = ("mixed_batch", "packed", "backward_batch", "causal_leak")
EDGE_DESCRIPTIONS = {
  "mixed_batch": "a decode row (one query over its cache) beside prefill "
  "rows of other lengths, and beside decode rows over caches of other "
  "lengths, vs the decode row alone",
  "packed": "rows of three lengths packed by segment ids vs the same rows "
  "padded in a batch",
  "backward_batch": "dQ, dK, dV of a row alone vs in a batch of 8",
  "causal_leak": "every key and value after position t replaced: rows up "
  "to t must not change",
}
# Argmax flips: each output row projected on this many random directions
# (a small vocabulary's logits), whose argmax should not change.
VOCABULARY = 16


def argmax_flips(reference, other) -> float:
  """Share of output rows whose argmax over a fixed random projection (a
  vocabulary's logits) differs between two ways of computing them."""
  d = reference.shape[-1]
  w = np.random.default_rng(7).standard_normal((d, VOCABULARY))
  a = np.argmax(reference.reshape(-1, d) @ w, axis=-1)
  b = np.argmax(other.reshape(-1, d) @ w, axis=-1)
  return float(np.mean(a != b))


class EdgeProbes:
  """Probes for `invariance.Prober` (self.q/k/v: [batch, length, ...],
  self.call, self.rng, self.length, self.dtype)."""

  def _mixed_batch(self):
    def probe():
      q, k, v = self.q[:4], self.k[:4], self.v[:4]
      n = self.length
      kv_lengths = np.array([n // 2 + 1, n, n // 2, n - 3], np.int32)
      q_lengths = np.array([1, n, n // 2, n - 3], np.int32)
      batched = self.call(
        q, k, v, causal=True, causal_alignment="bottom_right",
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
      )  # fmt: skip
      # Example 0 is a decode row: its one query sees its whole cache.
      cache = slice(0, int(kv_lengths[0]))
      alone = self.call(q[:1, :1], k[:1, cache], v[:1, cache])
      golden = golden_attention(q[:1, :1], k[:1, cache], v[:1, cache])
      return alone, batched[:1, :1], golden

    def decode_rows():
      # A decode batch: one query per sequence over caches of 4 lengths.
      n = self.length
      lengths = np.array([n // 2 + 1, n, n // 2, n - 3], np.int32)
      q, k, v = self.q[:4, -1:], self.k[:4], self.v[:4]
      batched = self.call(q, k, v, key_value_seq_lengths=lengths)
      cache = slice(0, int(lengths[0]))
      alone = self.call(q[:1], k[:1, cache], v[:1, cache])
      golden = golden_attention(q[:1], k[:1, cache], v[:1, cache])
      return alone, batched[:1], golden

    yield "decode row beside 3 prefill rows", probe
    yield "decode rows over caches of 4 lengths", decode_rows

  def _packed(self):
    def probe():
      n = self.length
      cuts = [0, n // 4, n // 4 + n // 2, n]
      ids = np.zeros((1, n), np.int32)
      for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        ids[0, a:b] = i
      q, k, v = self.q[:1], self.k[:1], self.v[:1]
      packed = self.call(q, k, v, causal=True, segment_ids=ids)
      lengths = np.diff(cuts).astype(np.int32)
      padded_q, padded_k, padded_v = (
        np.stack([
          np.concatenate([x[0, a:b], np.zeros_like(x[0, : n - (b - a)])])
          for a, b in zip(cuts, cuts[1:])
        ])
        for x in (q, k, v)
      )  # fmt: skip
      padded = self.call(
        padded_q, padded_k, padded_v, causal=True,
        query_seq_lengths=lengths, key_value_seq_lengths=lengths,
      )  # fmt: skip
      unpadded = np.concatenate([padded[i, :m] for i, m in enumerate(lengths)])[
        None
      ]
      golden = golden_attention(q, k, v, causal=True, segment_ids=ids)
      return packed, unpadded, golden

    yield "segments of n/4, n/2, n/4 vs padded", probe

  def _gradients(self, q, k, v, d_out):
    """(dq, dk, dv) of fn(q, k, v, causal=True) for cotangent d_out."""
    self.require(self.fn, {"causal": True})
    args = [jnp.asarray(np.asarray(x).astype(self.dtype)) for x in (q, k, v)]
    out, vjp = jax.vjp(lambda *a: self.fn(*a, causal=True), *args)
    grads = vjp(jnp.asarray(d_out).astype(out.dtype))
    return [np.asarray(g).astype(np.float64) for g in grads]

  def _backward_batch(self):
    def probe(size):
      q, k, v = self.q[:size], self.k[:size], self.v[:size]
      d_out = self.rng.standard_normal(q.shape)
      alone = self._gradients(q[:1], k[:1], v[:1], d_out[:1])
      batched = self._gradients(q, k, v, d_out)
      golden = golden_attention_vjp(q[:1], k[:1], v[:1], d_out[:1], causal=True)
      flat = [np.concatenate([g[0].ravel() for g in x]) for x in (
        alone, batched, golden)]  # fmt: skip
      return tuple(x[:, None] for x in flat)

    yield "dQ, dK, dV: batch 1 vs 8", lambda: probe(8)

  def _causal_leak(self):
    def probe():
      q, k, v = self.q[:1], self.k[:1], self.v[:1]
      t = self.length // 2
      later = (1, self.length - t - 1, *k.shape[2:])
      scale = 10.0  # larger values, so any scale over the future moves
      k2, v2 = (
        np.concatenate(
          [x[:, : t + 1], scale * self.rng.standard_normal(later)], 1
        )
        for x in (k, v)
      )
      k2, v2 = (round_to(x, self.policy.inputs) for x in (k2, v2))
      before = self.call(q, k, v, causal=True)[:, : t + 1]
      after = self.call(q, k2, v2, causal=True)[:, : t + 1]
      golden = golden_attention(q, k, v, causal=True)[:, : t + 1]
      return before, after, golden

    yield "keys and values after t = length/2 replaced", probe
