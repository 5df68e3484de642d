"""Inference's ways of computing the same attention, measured against each
other and against FP64: split-KV counts and sizes, batch size, chunked
prefill, paged caches and decode position (Thinking Machines 2025,
"Defeating Nondeterminism in LLM Inference"; FlashAttention's
`num_splits`; SGLang's and FlashInfer's fixed split size).

One decode step is the workload: a batch of sequences, each with one new
query at the end of a padded KV cache of its own length. Every axis runs
the same rows two ways and records the difference in ulps of the output
format (at the rows' largest FP64 value) beside the error against FP64;
split axes run with the partial outputs in FP32 and in the input format
(the `partials` stage).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from stableattn.auditing.inputs import Shape, make_inputs, round_to
from stableattn.auditing.invariance import ulp_at
from stableattn.contract.golden import golden_attention
from stableattn.contract.options import Options
from stableattn.experiments.config_values import spec
from stableattn.experiments.forward.study import (
  Claim,
  Section,
  Study,
  claim_findings,
  deviation_values,
  policies,
  require,
  row,
  verdict,
)
from stableattn.experiments.plotting import Series, line_plot
from stableattn.experiments.reporting import num, select, table
from stableattn.numerics.precision import Precision
from stableattn.ops.dispatch import attention
from stableattn.ops.paged import paged_attention

PARTIALS = ("fp32", "input")
# Batch-invariance schedules: one pass over the keys; a fixed split size
# (the first of `split_sizes`); a split count from the batch size.
SCHEDULES = ("unsplit", "split_size", "num_splits_by_batch")
# A launch heuristic's split count (FlashAttention's idea, simplified):
# enough splits that batch x heads x splits fills 128 multiprocessors.
MULTIPROCESSORS = 128
MAX_HEURISTIC_SPLITS = 16
# "Harmless": the split output's error against FP64 stays within this
# factor of the unsplit kernel's.
HARMLESS_FACTOR = 1.25


def heuristic_splits(batch: int, heads: int) -> int:
  return max(1, min(MAX_HEURISTIC_SPLITS, MULTIPROCESSORS // (batch * heads)))


@dataclasses.dataclass(frozen=True)
class Config:
  policies: tuple[str, ...] = spec(parse=policies)
  partials: tuple[str, ...] = spec(choices=PARTIALS)
  cache_len: int = spec(minimum=2)
  batch: int = spec(minimum=1)  # sequences in the decode step
  split_counts: tuple[int, ...] = spec(minimum=1)
  split_sizes: tuple[int, ...] = spec(minimum=1)  # multiples of block_k
  batch_sizes: tuple[int, ...] = spec(minimum=2)  # a row among N
  chunk_sizes: tuple[int, ...] = spec(minimum=1)
  page_sizes: tuple[int, ...] = spec(minimum=1)  # multiples of block_k
  positions: int = spec(minimum=1)  # decode positions compared with prefill
  seeds: int = spec(minimum=1)


class _Workload:
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


def _compare(name, value, reference, other, golden, fmt, **labels) -> dict:
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


def _split_rows(w: _Workload, c, fmt) -> list[dict]:
  examples = np.arange(c.batch)
  whole, _ = w.decode(examples)
  golden = w.golden(examples)
  rows = []
  for count in c.split_counts:
    split, _ = w.decode(examples, num_splits=count)
    rows.append(_compare("num_splits", count, whole, split, golden, fmt))
  for size in c.split_sizes:
    split, _ = w.decode(examples, split_size=size)
    rows.append(_compare("split_size", size, whole, split, golden, fmt))
  return rows


def _batch_rows(w: _Workload, c, s, fmt) -> list[dict]:
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
        _compare(
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


def _prefill(w: _Workload, queries, ends, **features):
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


def _chunk_rows(w: _Workload, c, fmt) -> list[dict]:
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
      _prefill(
        w,
        w.q[:1, start : start + chunk],
        start + chunk,
        causal_alignment="bottom_right",
      )
      for start in range(0, length, chunk)
    ]
    chunked = np.concatenate(parts, axis=1)
    rows.append(_compare("chunk", chunk, whole, chunked, golden, fmt))
  return rows


def _position_rows(w: _Workload, c, fmt) -> list[dict]:
  """Position t decoded alone (keys 0..t valid in the cache buffer) vs its
  row of the full causal pass, at evenly spaced positions."""
  length = c.cache_len
  whole, golden = w.full_pass
  positions = np.unique(np.linspace(0, length - 1, c.positions).astype(int))
  decoded = np.concatenate(
    [
      _prefill(w, w.q[:1, t : t + 1], t + 1, causal_alignment="bottom_right")
      for t in positions
    ],
    axis=1,
  )
  return [
    _compare(
      "position",
      int(t),
      whole[:, t : t + 1],
      decoded[:, i : i + 1],
      golden[:, t : t + 1],
      fmt,
    )
    for i, t in enumerate(positions)
  ]


def _page_rows(w: _Workload, c, fmt) -> list[dict]:
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
    rows.append(_compare("page_size", page, whole, paged, golden, fmt))
  return rows


def _partials_policy(policy: Precision, partials: str) -> Precision:
  fmt = policy.inputs if partials == "input" else partials
  return policy.with_stage(partials=fmt)


def fixed_split_invariant(rows) -> dict:
  """A fixed split size is bitwise batch-invariant (so is one pass)."""
  rows = require(
    select(rows, axis="batch", schedule="split_size"),
    "inference_fixed_split",
    "inference",
  )
  holds = [r for r in rows if r["bitwise_min"] == 1.0]
  return {
    "verdict": verdict(len(holds), len(rows)),
    "bitwise": len(holds),
    "rows": len(rows),
    "batch_sizes": sorted({r["value"] for r in rows}),
  }


def heuristic_breaks(rows) -> dict:
  """A split count chosen from the batch size breaks batch invariance."""
  rows = require(
    select(rows, axis="batch", schedule="num_splits_by_batch"),
    "inference_heuristic_split",
    "inference",
  )
  by_policy: dict = {}
  for r in rows:
    by_policy.setdefault(r["policy"], []).append(r)
  broken = {
    p: max(r["diff_ulps_max"] for r in group)
    for p, group in by_policy.items()
    if any(r["bitwise_min"] < 1.0 for r in group)
  }
  return {
    "verdict": verdict(len(broken), len(by_policy)),
    "largest_ulps": broken,
    "policies": sorted(by_policy),
  }


def split_error(rows) -> dict:
  """Splitting the keys changes the output by less than its own error
  against FP64 (FP32 partials)."""
  rows = require(
    [
      r
      for r in rows
      if r["axis"] in ("num_splits", "split_size") and r["partials"] == "fp32"
    ],
    "inference_split_error",
    "inference",
  )
  ratio = {}
  for r in rows:
    share = r["diff_ulps_max"] / max(r["reference_error_ulps_max"], 1e-300)
    ratio[r["policy"]] = max(ratio.get(r["policy"], 0.0), share)
  below = [p for p, v in ratio.items() if v < 1.0]
  return {"verdict": verdict(len(below), len(ratio)), "ratio": ratio}


def fp32_partials_harmless(rows) -> dict:
  """With FP32 partials the split count leaves the error against FP64
  where one pass has it (within HARMLESS_FACTOR); with partials in the
  input format it may not."""
  rows = require(
    [r for r in rows if r["axis"] in ("num_splits", "split_size")],
    "inference_fp32_partials",
    "inference",
  )
  worst: dict = {}
  for r in rows:
    key = (r["policy"], r["partials"])
    worst[key] = max(worst.get(key, 0.0), r["error_ratio_max"])
  fp32 = {p: v for (p, f), v in worst.items() if f == "fp32"}
  require(fp32, "inference_fp32_partials (FP32 partials)", "inference")
  harmless = [p for p, v in fp32.items() if v <= HARMLESS_FACTOR]
  return {
    "verdict": verdict(len(harmless), len(fp32)),
    "worst_error_ratio": {f"{p} ({f})": v for (p, f), v in worst.items()},
    "factor": HARMLESS_FACTOR,
  }


class Inference(Study):
  name = "inference"
  title = "Inference: split-KV, batch, chunked prefill, pages, decode position"
  Config = Config
  extendable = ("seeds",)
  claims = {
    "inference_fixed_split": Claim(
      "a fixed split size is bitwise batch-invariant",
      fixed_split_invariant,
      lambda c: (
        f"{c['bitwise']} of {c['rows']} rows bitwise equal, batch sizes "
        f"{c['batch_sizes']}"
      ),
    ),
    "inference_heuristic_split": Claim(
      "a split count chosen from the batch size breaks batch invariance",
      heuristic_breaks,
      lambda c: (
        "rows move by up to "
        + (
          ", ".join(f"{p}: {num(v)} ulps" for p, v in c["largest_ulps"].items())
          or "0 ulps"
        )
        + f" (policies {c['policies']})"
      ),
    ),
    "inference_split_error": Claim(
      "splits change the output by less than its error against FP64",
      split_error,
      lambda c: (
        "largest change / FP64 error: "
        + ", ".join(f"{p} {num(v)}" for p, v in c["ratio"].items())
      ),
    ),
    "inference_fp32_partials": Claim(
      "FP32 partials make the split count harmless",
      fp32_partials_harmless,
      lambda c: (
        "worst error vs FP64 over split schedules / one pass's: "
        + ", ".join(f"{k} {num(v)}" for k, v in c["worst_error_ratio"].items())
        + f" (harmless: <= {c['factor']})"
      ),
    ),
  }

  def seeds(self, common, config) -> int:
    return config.seeds

  def points(self, s, c):
    for size in (*c.split_sizes, *c.page_sizes):
      if size % s.block_k:
        raise ValueError(
          f"inference: split and page sizes must be multiples of block_k="
          f"{s.block_k}; got {size}."
        )
    return [
      {"policy": policy, "partials": partials}
      for policy in c.policies
      for partials in c.partials
    ]

  def measure(self, engine, s, c, p, seed):
    policy = _partials_policy(Precision.from_name(p["policy"]), p["partials"])
    w = _Workload(s, c, policy, seed)
    fmt = policy.output
    rows = _split_rows(w, c, fmt)
    if p["partials"] == c.partials[0]:
      # Only the split axes depend on the partials' format.
      rows += _batch_rows(w, c, s, fmt)
      rows += _chunk_rows(w, c, fmt)
      rows += _position_rows(w, c, fmt)
      if not policy.quantizes:
        # Operands below 16 bits are scaled per key block of a
        # contiguous cache; the paged kernel refuses them.
        rows += _page_rows(w, c, fmt)
    return rows

  def ran(self, s, c):
    return (
      f"one decode step of {c.batch} sequences over caches of "
      f"{c.cache_len // 2}-{c.cache_len} keys ({s.heads} heads, head dim "
      f"{s.head_dim}, tiles {s.block_q}x{s.block_k}), policies "
      f"{list(c.policies)}, partials {list(c.partials)}; split counts "
      f"{list(c.split_counts)}, sizes {list(c.split_sizes)}; a row among "
      f"{list(c.batch_sizes)}; prefill chunks {list(c.chunk_sizes)}; pages "
      f"{list(c.page_sizes)} (policies of 16 bits or more); "
      f"{c.positions} decode positions; "
      f"{c.seeds} seed(s)."
    )

  def report(self, ctx):
    rows = ctx.rows
    if not rows:
      return None
    header = ["policy", "partials", "axis", "value", "schedule", "bitwise"]
    header += ["diff (ulps)", "error vs FP64 (ulps)", "one pass's error"]
    ordered = sorted(
      rows,
      key=lambda r: (
        r["policy"],
        r["partials"],
        r["axis"],
        r.get("schedule", ""),
        r["value"],
      ),
    )
    body = [
      [
        r["policy"],
        r["partials"],
        r["axis"],
        r["value"],
        r.get("schedule", "-"),
        "yes" if r["bitwise_min"] == 1.0 else "**no**",
        num(r["diff_ulps_max"]),
        num(r["error_ulps_max"]),
        num(r["reference_error_ulps_max"]),
      ]
      for r in ordered
    ]
    findings = claim_findings(self.claims, ctx)
    series = []
    for (policy, partials), group in _by(rows, "num_splits").items():
      group.sort(key=lambda r: r["value"])
      series.append(
        Series(
          f"{policy}, {partials} partials",
          [r["value"] for r in group],
          [r["error_ratio_mean"] for r in group],
        )
      )
    plots = []
    if series:
      plot = line_plot(
        ctx.out_dir / "inference.png",
        series,
        title="Split-KV: error against FP64 relative to one pass "
        "(mean over seeds)",
        xlabel="num_splits (capped at the number of key blocks)",
        ylabel="max error / one pass's max error",
        logy=False,
      )
      plots.append(plot.name)
    return Section(table(header, body), findings, plots)


def _by(rows, axis: str) -> dict:
  out: dict = {}
  for r in rows:
    if r["axis"] == axis:
      out.setdefault((r["policy"], r["partials"]), []).append(r)
  return out


STUDY = Inference()
