"""Timing: FLOP counts, side-by-side compilation, alternating runs.

FLOPs follow the FlashAttention convention: forward 4*B*H*T*S*D (halved
when causal), and forward+backward 3.5 times that (the backward counted as
2.5 forwards).
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.experiments.benchmark.settings import MASK_SETTINGS, Settings
from stableattn.numerics.precision import Precision
from stableattn.ops.dispatch import attention
from stableattn.ops.registry import resolve


def flops(batch, heads, seq_len, head_dim, causal, mode) -> float:
  forward = 4.0 * batch * heads * seq_len * seq_len * head_dim
  if causal:
    forward /= 2
  return forward * (3.5 if mode == "forward_backward" else 1.0)


def attention_fn(name: str, precision: str, causal: bool, **options):
  """fn(q, k, v) -> out for one attention name (inputs in their dtype)."""
  return functools.partial(
    resolve(name, precision=precision, **options), causal=causal
  )


def timed_fn(fn, mode: str):
  """`fn` itself for "forward", else the gradient of a sum of its output."""
  if mode == "forward":
    return fn

  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def random_inputs(key, shape, precision: str) -> tuple:
  dtype = Precision.from_name(precision).dtype("inputs")
  keys = jax.random.split(key, 3)
  return tuple(jax.random.normal(k, shape, dtype) for k in keys)


def compile_all(fns: dict, args, workers: int = 8) -> dict:
  """name -> compiled fn, or the first line of its error (out of memory, a
  shared-memory limit). Compiles in threads: XLA and Triton release the GIL,
  so a GPU tile search compiles its candidates side by side."""

  def compile_one(item):
    name, fn = item
    try:
      return name, jax.jit(fn).lower(*args).compile()
    except Exception as e:  # recorded in the row; the sweep goes on
      return name, first_line(e)

  with ThreadPoolExecutor(workers) as pool:
    return dict(pool.map(compile_one, fns.items()))


def first_line(error: Exception) -> str:
  return str(error).strip().splitlines()[0][:200]


def median_ms(fn, args, warmup: int, repeats: int) -> float | str:
  """Median wall time of `repeats` runs after `warmup`, or the error."""
  try:
    for _ in range(max(warmup, 1)):
      jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - start)
  except Exception as e:  # out of memory at run time
    return first_line(e)
  return 1e3 * float(np.median(times))


def time_point(s: Settings, mode, causal, precision, head_dim, seq_len):
  """Rows for every implementation at one point, timed in alternation."""
  shape = (s.batch, seq_len, s.heads, head_dim)
  args = random_inputs(jax.random.key(seq_len), shape, precision)
  tiles = dict(block_q=s.block_q, block_k=s.block_k)
  compiled = compile_all(
    {
      name: timed_fn(attention_fn(name, precision, causal, **tiles), mode)
      for name in s.implementations
    },
    args,
  )
  times, errors = _alternating_times(compiled, args, s.warmup, s.repeats)
  labels = {
    "kind": "timing",
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "mode": mode,
    "causal": causal,
    "precision": precision,
    "head_dim": head_dim,
    "seq_len": seq_len,
    "batch": s.batch,
    "heads": s.heads,
  }
  work = flops(s.batch, s.heads, seq_len, head_dim, causal, mode)
  timed = [_timing_row(labels, name, ts, work) for name, ts in times.items()]
  for row in timed:
    for other in timed:
      if other is not row:
        row[f"time_ratio_vs_{other['implementation']}"] = (
          row["median_ms"] / other["median_ms"]
        )
  failed = [
    {**labels, "implementation": name, "error": error}
    for name, error in errors.items()
  ]
  return timed + failed


def _alternating_times(compiled: dict, args, warmup: int, repeats: int):
  """({name: run times}, {name: first line of the error}) of `compiled`
  (`compile_all`'s: a function, or the error that kept it from
  compiling); one that fails in its warm-up (out of memory at run time)
  is left out too."""
  errors = {n: fn for n, fn in compiled.items() if not callable(fn)}
  fns = {n: fn for n, fn in compiled.items() if callable(fn)}
  for name, fn in fns.items():
    try:
      for _ in range(max(warmup, 1)):
        jax.block_until_ready(fn(*args))
    except Exception as e:  # recorded in the row; the others are timed
      errors[name] = first_line(e)
  fns = {name: fn for name, fn in fns.items() if name not in errors}
  times = {name: [] for name in fns}
  for _ in range(repeats):  # alternate so drifts hit all alike
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[name].append(time.perf_counter() - start)
  return times, errors


def _timing_row(labels: dict, name: str, times, work: float) -> dict:
  ts = np.asarray(times)
  median = float(np.median(ts))
  return {
    **labels,
    "implementation": name,
    "median_ms": 1e3 * median,
    "p25_ms": 1e3 * float(np.percentile(ts, 25)),
    "p75_ms": 1e3 * float(np.percentile(ts, 75)),
    "min_ms": 1e3 * float(ts.min()),
    "tflops": work / median / 1e12,
  }


# What each mask setting of the block-skipping measurement passes to
# `stableattn.attention`.
def time_masks(s: Settings, mode, precision, head_dim, seq_len):
  """Our kernel under each mask setting, timed in alternation: what
  skipping the key blocks a mask empties saves (time vs "full")."""
  shape = (s.batch, seq_len, s.heads, head_dim)
  args = random_inputs(jax.random.key(seq_len), shape, precision)
  fns = {
    name: timed_fn(
      functools.partial(
        attention,
        precision=precision,
        block_q=s.block_q,
        block_k=s.block_k,
        features=MASK_SETTINGS[name],
      ),
      mode,
    )
    for name in s.mask_settings
  }
  compiled = compile_all(fns, args)
  times, errors = _alternating_times(compiled, args, s.warmup, s.repeats)
  labels = {
    "kind": "masks",
    "device": jax.devices()[0].device_kind,
    "mode": mode,
    "precision": precision,
    "head_dim": head_dim,
    "seq_len": seq_len,
  }
  rows = [
    {**labels, "mask": name, "median_ms": 1e3 * float(np.median(ts))}
    for name, ts in times.items()
  ]
  full = next((r for r in rows if r["mask"] == "full"), None)
  for r in rows:
    if full is not None:
      r["time_vs_full"] = r["median_ms"] / full["median_ms"]
  return rows + [
    {**labels, "mask": name, "error": error} for name, error in errors.items()
  ]
