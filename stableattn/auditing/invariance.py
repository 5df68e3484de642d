"""Does a kernel give the same row however inference computes it?

Serving computes one attention row many ways: alone or among other
requests (batch invariance, Thinking Machines 2025; vLLM's and SGLang's
deterministic modes), one token at a time from a KV cache or in one
prefill pass, in chunks of prefill, over a cache padded or paged
differently, split across a varying number of key splits. Each probe
here runs the same rows two ways through a kernel on the audit's
contract, `fn(q, k, v, **features)`, and reports whether they are
bitwise equal and, if not, the largest difference in units in the last
place (ulps) of the output format at the rows' largest FP64 value, beside
the kernel's own error against FP64 in the same unit. A difference far
below the error costs no accuracy but still breaks reproducibility.

A probe the kernel cannot run (it does not take `key_value_seq_lengths`,
a page table or split options) gives "n/a" with the reason.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from stableattn.auditing.edge_invariance import (
  EDGE_DESCRIPTIONS,
  EDGE_INVARIANCES,
  EdgeProbes,
  argmax_flips,
)
from stableattn.auditing.inputs import Shape, make_inputs, round_to
from stableattn.auditing.measure import first_line
from stableattn.auditing.offsets import DESCRIPTIONS as SHIFT_DESCRIPTIONS
from stableattn.auditing.offsets import SHIFT_INVARIANCES
from stableattn.contract import arguments
from stableattn.contract.golden import golden_attention
from stableattn.numerics.formats import to_dtype
from stableattn.numerics.precision import Precision
from stableattn.ops.dispatch import attention
from stableattn.ops.paged import paged_attention
from stableattn.ops.registry import unaccepted_features

INVARIANCES = (
  "batch",
  "decode",
  "chunked_prefill",
  "padded_cache",
  "splits",
  *EDGE_INVARIANCES,
  *SHIFT_INVARIANCES,
)
DESCRIPTIONS = {
  **EDGE_DESCRIPTIONS,
  **SHIFT_DESCRIPTIONS,
  "batch": "a row alone vs at a random position among N others, and a "
  "decode step (one query per sequence) alone vs in a batch",
  "decode": "a query decoded alone over its prefix vs its row of the full "
  "causal pass",
  "chunked_prefill": "queries in chunks of C over their prefix vs one pass",
  "padded_cache": "the same keys in a longer padded (or paged) cache",
  "splits": "split-KV counts and sizes vs one pass over the keys",
}


def parse(value) -> tuple[str, ...]:
  """`value` ("batch,decode", a sequence, "all", "" or None) as names."""
  return arguments.chosen(value, "invariances", INVARIANCES)


def split(names) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(bitwise probes, shift invariances) of `names`: the first compare
  two ways of computing the same rows bit for bit (`measure`), the second
  are judged rows, like an edge regime's (`offsets.shift_cases`)."""
  return (
    tuple(n for n in names if n not in SHIFT_INVARIANCES),
    tuple(n for n in names if n in SHIFT_INVARIANCES),
  )


@dataclasses.dataclass(frozen=True)
class ProbeSizes:
  """How hard each probe looks (sizes that a CPU runs in seconds)."""

  batch_sizes: tuple[int, ...] = (8, 64)
  decode_positions: int = 8  # first positions decoded one token at a time
  chunk: int = 32  # chunked prefill's chunk length
  cache_pads: tuple[int, ...] = (7, 64)  # padding added to the cache
  split_counts: tuple[int, ...] = (1, 2, 4, 8)
  split_blocks: tuple[int, ...] = (1, 2)  # split sizes, in key blocks


def our_attention(fn) -> dict | None:
  """The keywords of `stableattn.attention` bound in fn, if fn is one of
  our implementations (`registry.resolve`), else None."""
  if isinstance(fn, functools.partial) and fn.func is attention:
    return dict(fn.keywords)
  return None


def ulp_at(largest: float, fmt: str) -> float:
  """One unit in the last place of `fmt` at magnitude `largest`."""
  info = ml_dtypes.finfo(to_dtype(fmt))
  largest = max(float(largest), float(info.tiny))
  return float(2.0 ** (np.floor(np.log2(largest)) - info.nmant))


class _NotApplicable(Exception):
  """The kernel cannot run this probe (the reason is the message)."""


class Prober(EdgeProbes):
  """Runs the probes of one kernel at one policy on one shape."""

  def __init__(
    self,
    fn,
    policy: Precision,
    shape: Shape,
    *,
    distribution: str = "normal",
    seed: int = 0,
    sizes: ProbeSizes = ProbeSizes(),
  ):
    self.fn, self.policy, self.sizes = fn, policy, sizes
    self.length = shape.kv_len
    # One sequence per example, self-attention; enough examples for the
    # largest batch.
    self.shape = Shape(
      max(sizes.batch_sizes),
      shape.kv_len,
      shape.kv_len,
      shape.heads,
      shape.kv_heads,
      shape.head_dim,
    )
    arrays = make_inputs(distribution, seed, self.shape)
    self.q, self.k, self.v = (round_to(x, policy.inputs) for x in arrays)
    self.dtype = policy.dtype("inputs")
    self.rng = np.random.default_rng(seed + 1)

  @staticmethod
  def require(fn, features: dict) -> None:
    missing = unaccepted_features(fn, features)
    if missing:
      raise _NotApplicable(f"the kernel takes no {missing}")

  def call(self, q, k, v, fn=None, **features):
    fn = self.fn if fn is None else fn
    self.require(fn, features)
    args = [jnp.asarray(np.asarray(x).astype(self.dtype)) for x in (q, k, v)]
    try:
      out = fn(*args, **features)
    except (ValueError, NotImplementedError) as e:
      first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
      raise _NotApplicable(f"the kernel refused: {first}") from e
    return np.asarray(out).astype(np.float64)

  def row(self, name, detail, reference, other, golden) -> dict:
    """One comparison of two ways to compute the same rows."""
    fmt = self.policy.output
    ulp = ulp_at(np.max(np.abs(golden)), fmt)
    gap = float(np.max(np.abs(reference - other)))
    return {
      "invariance": name,
      "detail": detail,
      "invariant": bool(np.array_equal(reference, other, equal_nan=True)),
      "max_abs_diff": gap,
      "diff_ulps": gap / ulp,
      "error_ulps": float(np.max(np.abs(reference - golden))) / ulp,
      "argmax_flips": argmax_flips(reference, other),
      "reason": "",
    }

  @staticmethod
  def not_applicable(name, detail, reason) -> dict:
    return {
      "invariance": name,
      "detail": detail,
      "invariant": None,
      "max_abs_diff": float("nan"),
      "diff_ulps": float("nan"),
      "error_ulps": float("nan"),
      "argmax_flips": float("nan"),
      "reason": reason,
    }

  def measure(self, names) -> list[dict]:
    rows = []
    for name in parse(names):
      for detail, probe in getattr(self, f"_{name}")():
        try:
          rows.append(self.row(name, detail, *probe()))
        except _NotApplicable as e:
          rows.append(self.not_applicable(name, detail, str(e)))
        except Exception as e:  # noqa: BLE001 - the kernel broke: go on
          row = self.not_applicable(name, detail, f"raised {first_line(e)}")
          rows.append({**row, "error": first_line(e)})
    return [{"error": "", **r} for r in rows]

  # Each probe: (detail, thunk -> (reference, other, golden)) pairs.

  def _batch(self):
    def probe(size):
      q, k, v = self.q, self.k, self.v
      alone = self.call(q[:1], k[:1], v[:1], causal=True)[0]
      others = self.rng.choice(np.arange(1, len(q)), size - 1, replace=False)
      at = int(self.rng.integers(size))
      order = np.insert(others, at, 0)
      batched = self.call(q[order], k[order], v[order], causal=True)[at]
      golden = golden_attention(q[:1], k[:1], v[:1], causal=True)[0]
      return alone, batched, golden

    def one_query(size):
      # A decode step: each example's last query over its whole cache.
      q, k, v = self.q[:size, -1:], self.k[:size], self.v[:size]
      alone = self.call(q[:1], k[:1], v[:1])[0]
      batched = self.call(q, k, v)[0]
      return alone, batched, golden_attention(q[:1], k[:1], v[:1])[0]

    for size in self.sizes.batch_sizes:
      yield f"batch 1 vs {size}", functools.partial(probe, size)
    size = self.sizes.batch_sizes[0]
    yield f"one query: batch 1 vs {size}", functools.partial(one_query, size)

  def _prefill(self, example=slice(0, 1)):
    """The full causal pass of one example and its golden value."""
    q, k, v = self.q[example], self.k[example], self.v[example]
    return (
      self.call(q, k, v, causal=True),
      golden_attention(q, k, v, causal=True),
    )

  def _decode(self):
    q, k, v = self.q[:1], self.k[:1], self.v[:1]
    last = self.length - 1

    def last_query():
      full, golden = self._prefill()
      alone = self.call(q[:, last:], k, v)  # the last query sees every key
      return full[:, last], alone[:, 0], golden[:, last]

    def token_by_token():
      # A decode loop over a cache buffer of the full length: position t
      # sees keys 0..t, marked valid by the cache's length.
      full, golden = self._prefill()
      positions = range(min(self.sizes.decode_positions, self.length))
      rows = [
        self.call(
          q[:, t : t + 1],
          k,
          v,
          key_value_seq_lengths=np.array([t + 1], np.int32),
        )[:, 0]
        for t in positions
      ]
      return (
        full[:, : len(rows)],
        np.stack(rows, axis=1),
        golden[:, : len(rows)],
      )

    yield "last query over its prefix", last_query
    yield (
      f"positions 0..{self.sizes.decode_positions - 1} one token at a time",
      token_by_token,
    )

  def _chunked_prefill(self):
    q, k, v = self.q[:1], self.k[:1], self.v[:1]
    chunk = min(self.sizes.chunk, self.length)

    def probe():
      full, golden = self._prefill()
      parts = []
      for start in range(0, self.length, chunk):
        end = min(start + chunk, self.length)
        parts.append(
          self.call(
            q[:, start:end],
            k[:, :end],
            v[:, :end],
            causal=True,
            causal_alignment="bottom_right",
          )
        )
      return full, np.concatenate(parts, axis=1), golden

    yield f"chunks of {chunk}", probe

  def _decode_rows(self):
    """The last query of example 0 over its whole cache, and its golden."""
    q, k, v = self.q[:1, -1:], self.k[:1], self.v[:1]
    return q, k, v, self.call(q, k, v), golden_attention(q, k, v)

  def _padded_cache(self):
    def padded(pad):
      q, k, v, plain, golden = self._decode_rows()
      # Past the length a cache holds stale keys, not zeros.
      stale = (1, pad, *k.shape[2:])
      k_p, v_p = (
        np.concatenate(
          [x, round_to(self.rng.standard_normal(stale), self.policy.inputs)],
          axis=1,
        )
        for x in (k, v)
      )
      lengths = np.array([self.length], np.int32)
      other = self.call(q, k_p, v_p, key_value_seq_lengths=lengths)
      return plain, other, golden

    def paged():
      ours = our_attention(self.fn)
      if ours is None or ours.get("implementation") != "pallas":
        raise _NotApplicable("the kernel takes no page table")
      q, k, v, plain, golden = self._decode_rows()
      page = ours["options"].block_k
      if self.length % page:
        raise _NotApplicable(
          f"length {self.length} is not a whole number of {page}-key pages"
        )
      per_sequence = self.length // page
      spare = 3  # pool pages holding other sequences' keys (noise here)
      slots = self.rng.permutation(per_sequence + spare)[:per_sequence]
      pool_shape = (per_sequence + spare, page, *k.shape[2:])
      pools = []
      for x in (k, v):
        pool = round_to(
          self.rng.standard_normal(pool_shape), self.policy.inputs
        )
        pool[slots] = x[0].reshape(per_sequence, page, *x.shape[2:])
        pools.append(jnp.asarray(pool.astype(self.dtype)))
      out = paged_attention(
        jnp.asarray(q.astype(self.dtype)),
        *pools,
        slots[None].astype(np.int32),
        **ours,
      )
      return plain, np.asarray(out).astype(np.float64), golden

    for pad in self.sizes.cache_pads:
      yield f"cache padded by {pad} keys", functools.partial(padded, pad)
    yield "cache in shuffled pages", paged

  def _splits(self):
    ours = our_attention(self.fn)
    pallas = ours is not None and ours.get("implementation") == "pallas"

    def probe(**split):
      if not pallas:
        raise _NotApplicable(
          "the kernel takes no split options (num_splits, split_size)"
        )
      options = ours["options"].replace(num_splits=None, split_size=None)
      whole = functools.partial(attention, **{**ours, "options": options})
      q, k, v, _, golden = self._decode_rows()
      reference = self.call(q, k, v, fn=whole)
      split_fn = functools.partial(
        attention, **{**ours, "options": options.replace(**split)}
      )
      return reference, self.call(q, k, v, fn=split_fn), golden

    block_k = ours["options"].block_k if pallas else 64
    for count in self.sizes.split_counts:
      yield f"num_splits={count}", functools.partial(probe, num_splits=count)
    for blocks in self.sizes.split_blocks:
      size = blocks * block_k
      yield f"split_size={size}", functools.partial(probe, split_size=size)


def measure(fn, policy, shape: Shape, names, **kwargs) -> list[dict]:
  """The probe rows of `names` (see `INVARIANCES`) for fn at `policy`."""
  return Prober(fn, Precision.from_name(policy), shape, **kwargs).measure(names)


def verdicts(rows) -> dict:
  """{invariance: True (bitwise in every probe), False, or None (n/a)}."""
  out = {}
  for r in rows:
    seen = out.get(r["invariance"], None)
    if r["invariant"] is None:
      out.setdefault(r["invariance"], None)
    elif seen is None:
      out[r["invariance"]] = r["invariant"]
    else:
      out[r["invariance"]] = seen and r["invariant"]
  return out


def failures(rows) -> list[str]:
  """Every probe that was not bitwise invariant or raised, in words."""
  return [
    f"{r['invariance']} probe ({r['detail']}) raised {r['error']}"
    if r.get("error")
    else f"not {r['invariance']}-invariant ({r['detail']}): rows differ by "
    f"{r['diff_ulps']:.3g} ulps (its error against FP64: "
    f"{r['error_ulps']:.3g} ulps)"
    for r in rows
    if r["invariant"] is False or r.get("error")
  ]
