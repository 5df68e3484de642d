"""The fastest tiles and Triton parameters of our kernel (GPU only)."""

from __future__ import annotations

import itertools

import jax

from stableattn.experiments.benchmark.settings import Settings
from stableattn.experiments.benchmark.timing import (
  attention_fn,
  compile_all,
  median_ms,
  random_inputs,
  timed_fn,
)

# block_q, block_k, num_warps, num_stages
TILE_CANDIDATES = (64, 128), (32, 64, 128), (4, 8), (1, 2, 3)
# bwd_block_q, bwd_block_k, num_warps, num_stages
BACKWARD_TILE_CANDIDATES = (32, 64, 128), (32, 64, 128), (4, 8), (1, 2)


def tile_search(
  s: Settings, precision: str, head_dim: int, causal: bool, seq_len: int
) -> list[dict]:
  """The fastest (tiles, num_warps, num_stages), forward then backward.

  The backward search keeps the forward's best tiles and times the whole
  gradient, varying the backward tiles and the compiler parameters (which
  the forward and backward kernels share).
  """
  shape = (s.batch, seq_len, s.heads, head_dim)
  args = random_inputs(jax.random.key(1), shape, precision)

  def fn(tiles, warps, stages, backward_tiles=None):
    backward_tiles = backward_tiles or tiles
    return attention_fn(
      "pallas",
      precision,
      causal,
      block_q=tiles[0],
      block_k=tiles[1],
      bwd_block_q=backward_tiles[0],
      bwd_block_k=backward_tiles[1],
      num_warps=warps,
      num_stages=stages,
    )

  forward = {
    ((bq, bk), w, st): fn((bq, bk), w, st)
    for bq, bk, w, st in itertools.product(*TILE_CANDIDATES)
  }
  best = _fastest(s, compile_all(forward, args), args)
  labels = (precision, head_dim, causal, seq_len)
  rows = [_search_row(*labels, "forward", best)]
  if best is None:
    return rows
  tiles = best[0][0]
  backward = {
    (tiles, w, st, (bq, bk)): timed_fn(
      fn(tiles, w, st, (bq, bk)), "forward_backward"
    )
    for bq, bk, w, st in itertools.product(*BACKWARD_TILE_CANDIDATES)
  }
  best = _fastest(s, compile_all(backward, args), args)
  return rows + [_search_row(*labels, "forward_backward", best)]


def _fastest(s: Settings, compiled: dict, args):
  """(key, ms, candidates that ran, candidates) of the fastest, or None."""
  timed = {
    key: median_ms(fn, args, s.warmup, s.repeats)
    for key, fn in compiled.items()
    if callable(fn)
  }
  timed = {key: ms for key, ms in timed.items() if isinstance(ms, float)}
  if not timed:
    return None
  key = min(timed, key=timed.get)
  return key, timed[key], len(timed), len(compiled)


def _search_row(precision, head_dim, causal, seq_len, mode, best) -> dict:
  row = {
    "kind": "tile_search",
    "mode": mode,
    "precision": precision,
    "head_dim": head_dim,
    "causal": causal,
    "seq_len": seq_len,
  }
  if best is None:
    return {**row, "error": "no candidate compiled and ran"}
  key, ms, ran, tried = best
  tiles, warps, stages = key[:3]
  backward_tiles = key[3] if len(key) > 3 else tiles
  return {
    **row,
    "block_q": tiles[0],
    "block_k": tiles[1],
    "bwd_block_q": backward_tiles[0],
    "bwd_block_k": backward_tiles[1],
    "num_warps": warps,
    "num_stages": stages,
    "median_ms": ms,
    "candidates_ran": ran,
    "candidates": tried,
  }
