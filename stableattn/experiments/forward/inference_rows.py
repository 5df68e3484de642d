"""The inference study's measurements: one decode step (a batch of
sequences, each with one new query at the end of its own padded KV cache)
computed two ways along each axis (split count and size, batch, chunked
prefill, decode position, pages), one row per comparison."""

from __future__ import annotations

import functools
import math

import numpy as np

from stableattn.auditing.inputs import Shape, make_inputs, round_to
from stableattn.auditing.invariance import ulp_at
from stableattn.contract.golden import golden_attention
from stableattn.contract.options import Options
from stableattn.experiments.forward.study import (
  deviation_values,
  row,
)
from stableattn.numerics.precision import Precision
from stableattn.ops.dispatch import attention
from stableattn.ops.paged import paged_attention

# Batch-invariance schedules: one pass over the keys; a fixed split size
# (the first of `split_sizes`); a split count from the batch size.
SCHEDULES = ("unsplit", "split_size", "num_splits_by_batch")
# A launch heuristic's split count (FlashAttention's idea, simplified):
# enough splits that batch x heads x splits fills 128 multiprocessors.
MULTIPROCESSORS = 128
MAX_HEURISTIC_SPLITS = 16


def heuristic_splits(batch: int, heads: int) -> int:
  return max(1, min(MAX_HEURISTIC_SPLITS, MULTIPROCESSORS // (batch * heads)))


class Workload:
  """One policy's inputs and the unsplit decode step it is measured by."""

  def __init__(self, s, c, policy: Precision, seed: int):
    self.policy, self.c, self.s = policy, c, s
    # The decode step's sequences, and others to batch them with.
    largest = c.batch + max(c.batch_sizes)
    self.shape = Shape(
      largest, c.cache_len, c.cache_len, s.heads, s.kv_heads, s.head_dim
    )
    self.q, self.k, self.v = (
      round_to(x, policy.inputs)
      for x in make_inputs(s.distributions[0], seed, self.shape)
    )
    rng = np.random.default_rng([seed, 31])
    self.lengths = rng.integers(
      c.cache_len // 2, c.cache_len + 1, size=largest
    ).astype(np.int32)
    self.rng = rng
    self.options = Options(policy, block_q=s.block_q, block_k=s.block_k)

  def decode_inputs(self, examples):
    """The new query of `examples` at the end of their caches, and the
    features that place it there."""
    features = dict(
      causal=True,
      causal_alignment="bottom_right",
      key_value_seq_lengths=self.lengths[examples],
    )
    return self.q[examples, -1:], features

  def decode(self, examples, **options):
    q, features = self.decode_inputs(examples)
    out = attention(
      q,
      self.k[examples],
      self.v[examples],
      options=self.options.replace(**options),
      **features,
    )
    return np.asarray(out).astype(np.float64), (q, features)

  @functools.cached_property
  def full_pass(self):
    """Sequence 0's causal pass over its whole cache, and its golden
    value: what chunked prefill and decoded positions are held to."""
    q, k, v = self.q[:1], self.k[:1], self.v[:1]
    out = attention(q, k, v, options=self.options, causal=True)
    return (
      np.asarray(out).astype(np.float64),
      golden_attention(q, k, v, causal=True),
    )

  def golden(self, examples):
    q, features = self.decode_inputs(examples)
    return golden_attention(q, self.k[examples], self.v[examples], **features)


# What each axis compares: the other way against the reference way.
COMPARISONS = {
  "num_splits": "split_vs_one_pass",
  "split_size": "split_vs_one_pass",
  "batch": "batched_vs_alone",
  "chunk": "chunked_vs_one_pass",
  "position": "decoded_vs_prefill",
  "page_size": "paged_vs_contiguous",
}


def compare(name, value, reference, other, golden, fmt, **labels) -> dict:
  """A row: `other` against `reference` (the deviation and in ulps of
  `fmt` at the largest FP64 value), and both against FP64."""
  ulp = ulp_at(np.max(np.abs(golden)), fmt)
  diff = float(np.max(np.abs(reference - other)))
  error = float(np.max(np.abs(other - golden)))
  reference_error = float(np.max(np.abs(reference - golden)))
  return row(
    {
      "comparison": COMPARISONS[name],
      "axis": name,
      "value": value,
      **labels,
    },
    {
      **deviation_values(reference, other),
      "bitwise": float(np.array_equal(reference, other)),
      "diff_ulps": diff / ulp,
      "error_max_abs": error,
      "error_ulps": error / ulp,
      "reference_error_ulps": reference_error / ulp,
      "error_ratio": error / reference_error if reference_error else 1.0,
    },
  )


def split_rows(w: Workload, c, fmt) -> list[dict]:
  examples = np.arange(c.batch)
  whole, _ = w.decode(examples)
  golden = w.golden(examples)
  rows = []
  for count in c.split_counts:
    split, _ = w.decode(examples, num_splits=count)
    rows.append(compare("num_splits", count, whole, split, golden, fmt))
  for size in c.split_sizes:
    split, _ = w.decode(examples, split_size=size)
    rows.append(compare("split_size", size, whole, split, golden, fmt))
  return rows


def batch_rows(w: Workload, c, s, fmt) -> list[dict]:
  """The decode step's sequences, each alone (batch 1), against the same
  sequences at random places among N."""
  rows = []
  mine = np.arange(c.batch)
  golden = w.golden(mine)
  for schedule in SCHEDULES:

    def options(batch, schedule=schedule):
      if schedule == "split_size":
        return {"split_size": c.split_sizes[0]}
      if schedule == "num_splits_by_batch":
        return {"num_splits": heuristic_splits(batch, s.heads)}
      return {}

    alone = np.concatenate([w.decode([i], **options(1))[0] for i in mine])
    for size in c.batch_sizes:
      if size < c.batch:
        raise ValueError(
          f"inference.batch_sizes: {size} cannot hold the decode step's "
          f"{c.batch} sequences."
        )
      others = w.rng.choice(
        np.arange(c.batch, len(w.q)), size - c.batch, replace=False
      )
      order = w.rng.permutation(np.concatenate([mine, others]))
      batched, _ = w.decode(order, **options(size))
      places = [int(np.flatnonzero(order == i)[0]) for i in mine]
      rows.append(
        compare(
          "batch",
          size,
          alone,
          batched[places],
          golden,
          fmt,
          schedule=schedule,
        )
      )
  return rows


def prefill(w: Workload, queries, ends, **features):
  """Queries [1, n] of sequence 0 over its first `ends` keys (the cache
  buffer's length marks the rest invalid)."""
  out = attention(
    queries,
    w.k[:1],
    w.v[:1],
    options=w.options,
    causal=True,
    key_value_seq_lengths=np.array([ends], np.int32),
    **features,
  )
  return np.asarray(out).astype(np.float64)


def chunk_rows(w: Workload, c, fmt) -> list[dict]:
  """Chunked prefill over a cache buffer of the full length: chunk j's
  queries see keys up to its end (bottom-right causal, the cache's length
  marking the rest invalid), against one causal pass."""
  length = c.cache_len
  whole, golden = w.full_pass
  rows = []
  for chunk in c.chunk_sizes:
    if length % chunk:
      raise ValueError(
        f"inference.chunk_sizes: {chunk} does not divide cache_len {length}."
      )
    parts = [
      prefill(
        w,
        w.q[:1, start : start + chunk],
        start + chunk,
        causal_alignment="bottom_right",
      )
      for start in range(0, length, chunk)
    ]
    chunked = np.concatenate(parts, axis=1)
    rows.append(compare("chunk", chunk, whole, chunked, golden, fmt))
  return rows


def position_rows(w: Workload, c, fmt) -> list[dict]:
  """Position t decoded alone (keys 0..t valid in the cache buffer) vs its
  row of the full causal pass, at evenly spaced positions."""
  length = c.cache_len
  whole, golden = w.full_pass
  positions = np.unique(np.linspace(0, length - 1, c.positions).astype(int))
  decoded = np.concatenate(
    [
      prefill(w, w.q[:1, t : t + 1], t + 1, causal_alignment="bottom_right")
      for t in positions
    ],
    axis=1,
  )
  return [
    compare(
      "position",
      int(t),
      whole[:, t : t + 1],
      decoded[:, i : i + 1],
      golden[:, t : t + 1],
      fmt,
    )
    for i, t in enumerate(positions)
  ]


def page_rows(w: Workload, c, fmt) -> list[dict]:
  examples = np.arange(c.batch)
  whole, (q, features) = w.decode(examples)
  golden = w.golden(examples)
  rows = []
  for page in c.page_sizes:
    per_sequence = math.ceil(c.cache_len / page)
    pad = per_sequence * page - c.cache_len
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    pages = c.batch * per_sequence
    slots = w.rng.permutation(pages).reshape(c.batch, per_sequence)
    pools = []
    for x in (w.k[examples], w.v[examples]):
      padded = np.pad(x, widths).reshape(pages, page, *x.shape[2:])
      pool = np.empty_like(padded)
      pool[slots.ravel()] = padded
      pools.append(pool)
    out = paged_attention(
      q, *pools, slots.astype(np.int32), options=w.options, **features
    )
    paged = np.asarray(out).astype(np.float64)
    rows.append(compare("page_size", page, whole, paged, golden, fmt))
  return rows


def partials_policy(policy: Precision, partials: str) -> Precision:
  fmt = policy.inputs if partials == "input" else partials
  return policy.with_stage(partials=fmt)
