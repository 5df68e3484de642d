"""Speed and memory of our kernel against the attention users pick instead.

Implementations run in one process, in alternation, after warm-up: ours
("pallas"), "reference", "xla" (`jax.nn.dot_product_attention`), and on a
GPU also "cudnn" and jax's own Pallas kernel ("jax_mha"). FLOPs follow the
FlashAttention convention: forward 4*B*H*T*S*D (halved when causal), and
forward+backward 3.5 times that (the backward counted as 2.5 forwards).
Peak memory is measured per implementation and length in a fresh process
(`memory_probe`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import attention as jax_gpu_attention
from tqdm.auto import tqdm

from stableattn.dispatch import attention
from stableattn.experiments.config_values import as_tuple, field, field_tuple
from stableattn.experiments.reporting import num, table
from stableattn.experiments.rundir import RunDir
from stableattn.plotting import Series, line_panels, line_plot
from stableattn.precision import Precision, natural_policy

CPU_IMPLEMENTATIONS = ("pallas", "reference", "xla")
GPU_ONLY = ("cudnn", "jax_mha")


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def attention_fn(
  implementation: str,
  precision: str,
  causal: bool,
  block_q: int = 64,
  block_k: int = 64,
  num_warps: int | None = None,
  num_stages: int | None = None,
):
  """fn(q, k, v) -> out for one implementation (inputs in their dtype)."""
  if implementation in CPU_IMPLEMENTATIONS:
    return functools.partial(
      attention,
      implementation=implementation,
      precision=precision,
      causal=causal,
      block_q=block_q,
      block_k=block_k,
      num_warps=num_warps,
      num_stages=num_stages,
    )
  if implementation == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="cudnn"
    )
  if implementation == "jax_mha":
    # jax's kernel with its own defaults (128x128 tiles), as users call it.
    return lambda q, k, v: jax_gpu_attention.mha(
      q, k, v, segment_ids=None, sm_scale=q.shape[-1] ** -0.5, causal=causal
    )
  raise ValueError(
    f"Unknown implementation {implementation!r}; valid: "
    f"{list(CPU_IMPLEMENTATIONS + GPU_ONLY)}."
  )


MODES = ("forward", "forward_backward")


def _timed(fn, mode: str):
  if mode == "forward":
    return jax.jit(fn)

  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def flops(batch, heads, seq_len, head_dim, causal, mode) -> float:
  forward = 4.0 * batch * heads * seq_len * seq_len * head_dim
  if causal:
    forward /= 2
  return forward * (3.5 if mode == "forward_backward" else 1.0)


@dataclasses.dataclass(frozen=True)
class Settings:
  implementations: tuple[str, ...]
  modes: tuple[str, ...]
  causal: tuple[bool, ...]
  precisions: tuple[str, ...]  # presets timed; inputs in each's format
  head_dims: tuple[int, ...]
  seq_lens: tuple[int, ...]
  batch: int
  heads: int
  block_q: int
  block_k: int
  warmup: int
  repeats: int
  memory_seq_lens: tuple[int, ...]
  memory_implementations: tuple[str, ...]
  tile_search: bool
  search_seq_len: int


def settings_from_config(c) -> Settings:
  gpu = on_gpu()
  implementations = as_tuple(c.implementations)
  if gpu:
    implementations += tuple(i for i in GPU_ONLY if i not in implementations)
  for name in implementations:
    if name not in CPU_IMPLEMENTATIONS + GPU_ONLY:
      raise ValueError(
        f"Unknown implementation {name!r}; valid: "
        f"{list(CPU_IMPLEMENTATIONS + GPU_ONLY)}."
      )
    if name in GPU_ONLY and not gpu:
      raise ValueError(f"Implementation {name!r} needs a GPU.")
  g = "gpu" if gpu else "cpu"
  modes = field_tuple(c, "modes", str)
  bad = [m for m in modes if m not in MODES]
  if bad:
    raise ValueError(f"config.modes: unknown {bad}; valid: {list(MODES)}.")
  memory = field_tuple(c, "memory_implementations", str, allow_empty=True)
  bad = [m for m in memory if m not in CPU_IMPLEMENTATIONS]
  if bad:
    raise ValueError(
      f"config.memory_implementations: unknown {bad}; valid: "
      f"{list(CPU_IMPLEMENTATIONS)}."
    )
  causal = as_tuple(c.causal, lambda x: str(x).strip().lower())
  if not causal or any(x not in ("true", "false") for x in causal):
    raise ValueError(
      f"config.causal must hold True/False values, got {c.causal!r}."
    )
  return Settings(
    implementations=implementations,
    modes=modes,
    causal=tuple(x == "true" for x in causal),
    precisions=_precisions(c[g]),
    head_dims=field_tuple(c, "head_dims", int, minimum=1),
    seq_lens=field_tuple(c, f"{g}.seq_lens", int, minimum=1),
    batch=field(c, f"{g}.batch", minimum=1),
    heads=field(c, f"{g}.heads", minimum=1),
    block_q=field(c, f"{g}.block_q", minimum=1),
    block_k=field(c, f"{g}.block_k", minimum=1),
    warmup=field(c, "warmup", minimum=0),
    repeats=field(c, "repeats", minimum=1),
    memory_seq_lens=field_tuple(
      c, f"{g}.memory_seq_lens", int, minimum=1, allow_empty=True
    ),
    memory_implementations=memory,
    tile_search=bool(c.tile_search) and gpu,
    search_seq_len=field(c, f"{g}.search_seq_len", minimum=1),
  )


def _precisions(g) -> tuple[str, ...]:
  """`policies` if given, else each dtype's flash-kernel policy."""
  policies = as_tuple(g.get("policies", ()))
  if not policies:
    policies = tuple(
      natural_policy(dtype, "flash") for dtype in as_tuple(g.dtypes)
    )
  for name in policies:
    Precision.from_name(name)  # a clear error naming the valid presets
  return policies


def _random_inputs(key, shape, precision: str):
  dtype = Precision.from_name(precision).dtype("inputs")
  return (jax.random.normal(k, shape, dtype) for k in jax.random.split(key, 3))


def compile_all(fns: dict, args, workers: int = 8) -> dict:
  """name -> compiled fn, or the first line of its error (out of memory, a
  shared-memory limit). Compiles in threads: XLA and Triton release the GIL,
  so a GPU tile search compiles its candidates side by side."""

  def compile_one(item):
    name, fn = item
    try:
      return name, jax.jit(fn).lower(*args).compile()
    except Exception as e:  # recorded in the row; the sweep goes on
      return name, str(e).strip().splitlines()[0][:200]

  with ThreadPoolExecutor(workers) as pool:
    return dict(pool.map(compile_one, fns.items()))


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
    return str(e).strip().splitlines()[0][:200]
  return 1e3 * float(np.median(times))


def _time_point(s: Settings, mode, causal, precision, head_dim, seq_len):
  shape = (s.batch, seq_len, s.heads, head_dim)
  args = tuple(_random_inputs(jax.random.key(seq_len), shape, precision))
  compiled = compile_all(
    {
      name: _timed(
        attention_fn(name, precision, causal, s.block_q, s.block_k), mode
      )
      for name in s.implementations
    },
    args,
  )
  times = {name: [] for name, fn in compiled.items() if callable(fn)}
  for name in times:
    for _ in range(s.warmup):
      jax.block_until_ready(compiled[name](*args))
  for _ in range(s.repeats):  # alternate so drifts hit all alike
    for name in times:
      start = time.perf_counter()
      jax.block_until_ready(compiled[name](*args))
      times[name].append(time.perf_counter() - start)
  work = flops(s.batch, s.heads, seq_len, head_dim, causal, mode)
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
  rows = [
    {**labels, "implementation": name, "error": error}
    for name, error in compiled.items()
    if not callable(error)
  ]
  timed = []
  for name, ts in times.items():
    ts = np.asarray(ts)
    median = float(np.median(ts))
    timed.append(
      {
        **labels,
        "implementation": name,
        "median_ms": 1e3 * median,
        "p25_ms": 1e3 * float(np.percentile(ts, 25)),
        "p75_ms": 1e3 * float(np.percentile(ts, 75)),
        "min_ms": 1e3 * float(ts.min()),
        "tflops": work / median / 1e12,
      }
    )
  for row in timed:
    for other in timed:
      if other is not row:
        row[f"time_ratio_vs_{other['implementation']}"] = (
          row["median_ms"] / other["median_ms"]
        )
  return timed + rows


def _memory(s: Settings, implementation: str, seq_len: int) -> dict:
  cmd = [
    sys.executable,
    "-m",
    "stableattn.experiments.memory_probe",
    f"--implementation={implementation}",
    f"--seq_len={seq_len}",
    f"--heads={s.heads}",
    f"--head_dim={s.head_dims[0]}",
    f"--precision={s.precisions[0]}",
    f"--block_q={s.block_q}",
    f"--block_k={s.block_k}",
  ]
  out = subprocess.run(
    cmd, check=True, capture_output=True, text=True, timeout=900
  ).stdout
  return {
    "kind": "memory",
    "head_dim": s.head_dims[0],
    "precision": s.precisions[0],
    **json.loads(out.strip().splitlines()[-1]),
  }


TILE_CANDIDATES = (64, 128), (32, 64, 128), (4, 8), (1, 2, 3)
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
  args = tuple(_random_inputs(jax.random.key(1), shape, precision))

  def fn(tiles, warps, stages, backward_tiles=None):
    return functools.partial(
      attention,
      implementation="pallas",
      precision=precision,
      causal=causal,
      block_q=tiles[0],
      block_k=tiles[1],
      bwd_block_q=(backward_tiles or tiles)[0],
      bwd_block_k=(backward_tiles or tiles)[1],
      num_warps=warps,
      num_stages=stages,
    )

  forward = {
    ((bq, bk), w, st): fn((bq, bk), w, st)
    for bq, bk, w, st in itertools.product(*TILE_CANDIDATES)
  }
  best = _fastest(s, compile_all(forward, args), args)
  rows = [_search_row(precision, head_dim, causal, seq_len, "forward", best)]
  if best is None:
    return rows
  tiles = best[0][0]
  backward = {
    (tiles, w, st, (bq, bk)): _timed(
      fn(tiles, w, st, (bq, bk)), "forward_backward"
    )
    for bq, bk, w, st in itertools.product(*BACKWARD_TILE_CANDIDATES)
  }
  best = _fastest(s, compile_all(backward, args), args)
  rows.append(
    _search_row(precision, head_dim, causal, seq_len, "forward_backward", best)
  )
  return rows


def _fastest(s: Settings, compiled: dict, args):
  """(key, ms, candidates that ran) of the fastest compiled candidate."""
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


def run(config, workdir, *, restart: bool = False) -> dict:
  """Times and measures every point afresh (timings are never resumed)."""
  s = settings_from_config(config)
  run_dir = RunDir(workdir)
  with run_dir.lock():
    if restart:
      run_dir.clear()
    return _run(s, config, run_dir)


def _run(s: Settings, config, run_dir: RunDir) -> dict:
  run_dir.write_config(config.to_dict())
  run_dir.rewrite_metrics([])  # timings are re-measured, never resumed
  points = list(
    itertools.product(s.modes, s.causal, s.precisions, s.head_dims, s.seq_lens)
  )
  rows = []
  for point in tqdm(points, desc="benchmark", unit="point"):
    new = _time_point(s, *point)
    run_dir.append_metrics(new)
    rows += new
  for name, seq_len in tqdm(
    list(itertools.product(s.memory_implementations, s.memory_seq_lens)),
    desc="memory",
    unit="run",
  ):
    new = _memory(s, name, seq_len)
    run_dir.append_metrics([new])
    rows.append(new)
  if s.tile_search:
    for precision, head_dim, causal in itertools.product(
      s.precisions, s.head_dims, s.causal
    ):
      new = tile_search(s, precision, head_dim, causal, s.search_seq_len)
      run_dir.append_metrics(new)
      rows += new
  return _report(run_dir, s, rows)


def _time_cell(row: dict | None) -> str:
  if row is None:
    return "-"
  if "error" in row:
    return "failed: " + _short_error(row["error"])
  return f"{num(row['median_ms'])} ({num(row['tflops'])})"


def _search_cells(r: dict) -> list:
  cells = [r["mode"], r["precision"], r["head_dim"], r["causal"]]
  if "error" in r:
    return cells + [r["error"]] + [""] * 5
  return cells + [
    f"{r['block_q']}x{r['block_k']}",
    f"{r['bwd_block_q']}x{r['bwd_block_k']}",
    r["num_warps"],
    r["num_stages"],
    num(r["median_ms"]),
    f"{r['candidates_ran']} / {r['candidates']}",
  ]


def _short_error(message: str) -> str:
  if "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower():
    return "out of memory"
  if "All configs failed during profiling" in message:
    return "no GEMM config ran (autotuning)"
  return message[:60]


def _report(run_dir: RunDir, s: Settings, rows) -> dict:
  timings = [r for r in rows if r["kind"] == "timing"]
  memory = [r for r in rows if r["kind"] == "memory"]
  run_dir.write_csv("summary.csv", timings + memory)
  measured = next((r for r in timings if "device" in r), {})
  device = measured.get("device", jax.devices()[0].device_kind)
  jax_version = measured.get("jax", jax.__version__)
  parts = [
    "# Attention speed and memory",
    "",
    f"*Device:* {device}, jax {jax_version}; batch {s.batch}, "
    f"{s.heads} heads, tiles "
    f"{s.block_q}x{s.block_k} for ours; median of {s.repeats} runs "
    f"after {s.warmup} warm-up, implementations alternating; "
    "TFLOP/s by the FlashAttention FLOP count.",
    "",
  ]
  headline = {}
  panels = {}
  for mode, causal, precision, head_dim in itertools.product(
    s.modes, s.causal, s.precisions, s.head_dims
  ):
    group = [
      r
      for r in timings
      if (r["mode"], r["causal"], r["precision"], r["head_dim"])
      == (mode, causal, precision, head_dim)
    ]
    header = ["length"] + [f"{i} ms (TFLOP/s)" for i in s.implementations]
    others = [i for i in s.implementations if i != "pallas"]
    header += [f"time ours / {o}" for o in others]
    body = []
    for seq_len in s.seq_lens:
      by = {r["implementation"]: r for r in group if r["seq_len"] == seq_len}
      cells = [seq_len] + [_time_cell(by.get(i)) for i in s.implementations]
      ours = by.get("pallas", {})
      cells += [num(ours.get(f"time_ratio_vs_{o}")) for o in others]
      body.append(cells)
    parts += [
      f"## {mode}, {'causal' if causal else 'non-causal'}, {precision}, "
      f"head dim {head_dim}",
      "",
      table(header, body),
      "",
    ]
    panel = f"{mode.replace('_', '+')}, {'causal' if causal else 'non-causal'}"
    panels[f"{panel}, d={head_dim}, {precision}"] = [
      Series.from_points(
        name,
        [
          (r["seq_len"], r["tflops"])
          for r in group
          if r["implementation"] == name and "tflops" in r
        ],
      )
      for name in s.implementations
    ]
  target_len = 2048 if 2048 in s.seq_lens else max(s.seq_lens)
  fwd = {
    r["implementation"]: r
    for r in timings
    if r["mode"] == "forward"
    and not r["causal"]
    and r["seq_len"] == target_len
    and r["head_dim"] == s.head_dims[0]
    and r["precision"] == s.precisions[0]
  }
  if "pallas" in fwd and "reference" in fwd:
    ratio = fwd["pallas"]["median_ms"] / fwd["reference"]["median_ms"]
    headline["forward_time_ratio_vs_reference"] = ratio
    parts.append(
      f"**Finding.** Forward, non-causal, {s.precisions[0]}, head dim "
      f"{s.head_dims[0]}, length {target_len}: ours "
      f"{num(fwd['pallas']['median_ms'])} ms vs reference "
      f"{num(fwd['reference']['median_ms'])} ms ({ratio:.2f}x the "
      "reference's time)."
    )
  names = {r["implementation"] for r in memory}
  if memory:
    body = []
    for seq_len in s.memory_seq_lens:
      by = {r["implementation"]: r for r in memory if r["seq_len"] == seq_len}
      body.append(
        [seq_len]
        + [f"{by[n]['peak_bytes'] / 2**20:.1f}" for n in sorted(names)]
      )
    parts += [
      "",
      f"## Peak memory of one forward pass (MiB; {memory[0]['source']}; "
      f"batch 1, {s.heads} heads, head dim {memory[0]['head_dim']})",
      "",
      table(["length"] + sorted(names), body),
      "",
    ]
    longest = max(s.memory_seq_lens)
    by = {r["implementation"]: r for r in memory if r["seq_len"] == longest}
    if "pallas" in by and "reference" in by and by["reference"]["peak_bytes"]:
      share = by["pallas"]["peak_bytes"] / by["reference"]["peak_bytes"]
      headline["memory_ratio_vs_reference"] = share
      parts.append(
        f"**Finding.** At length {longest}, our kernel's peak is "
        f"{by['pallas']['peak_bytes'] / 2**20:.1f} MiB vs the reference's "
        f"{by['reference']['peak_bytes'] / 2**20:.1f} MiB ({share:.3f}x): "
        "flash attention never stores the length x length score matrix."
      )
    mem_series = [
      Series.from_points(
        n,
        [
          (r["seq_len"], r["peak_bytes"] / 2**20)
          for r in memory
          if r["implementation"] == n
        ],
      )
      for n in sorted(names)
    ]
    line_plot(
      run_dir.path / "memory.png",
      mem_series,
      title="Peak memory of one forward pass",
      xlabel="length",
      ylabel="MiB",
    )
  searches = [r for r in rows if r["kind"] == "tile_search"]
  if searches:
    parts += [
      "",
      "## Best tiles (GPU search)",
      "",
      f"Length {s.search_seq_len}; forward: every tile x warps x stages "
      "candidate; forward+backward: the forward's best tiles, every "
      "backward tile x warps x stages.",
      "",
      table(
        ["mode", "precision", "head dim", "causal", "tiles", "backward tiles"]
        + ["warps", "stages", "ms", "ran / tried"],
        [_search_cells(r) for r in searches],
      ),
    ]
  line_panels(
    run_dir.path / "tflops.png",
    panels,
    title=f"Throughput on {device}",
    xlabel="length",
    ylabel="TFLOP/s",
  )
  parts += ["", "![tflops](tflops.png)"]
  if memory:
    parts.append("![memory](memory.png)")
  run_dir.write_text("report.md", "\n".join(parts) + "\n")
  return {"workdir": str(run_dir.path), **headline}
