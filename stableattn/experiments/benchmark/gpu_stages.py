"""Three stages of a GPU session, each writing its rows as it goes so that a
stage cut off at its time limit keeps what it measured:

* `price`: what stability costs. Each stable preset and its base preset
  (and, in BF16, jax's Pallas `mha` and cuDNN) timed in one alternation,
  forward and forward+backward, with each compiled program's memory
  (arguments, outputs and XLA's temporaries, from its memory analysis).
* `hopper` (`hopper_stage`): the Mosaic GPU path against cuDNN and the
  peers, its FlashAttention-3 forms and its features.
* `levers`: one configuration per forward lever (register pressure,
  shared-memory traffic, causal block skipping) timed in one alternation;
  with `ncu_pass` each runs once and only once, so that Nsight Compute's
  `-c N` profiles exactly the variants, in order (`parse_ncu_csv` reads
  its counters back).

The launcher is `launch/gpu_stage.py`; `launch/gpu_session.sh` runs both
in a GPU session, and a test runs them on the CPU at small sizes.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import pathlib

import jax

from stableattn.contract.tiling import fp32_gpu_tiles
from stableattn.experiments.benchmark.timing import (
  _alternating_times,
  _timing_row,
  attention_fn,
  compile_all,
  flops,
  random_inputs,
  timed_fn,
)
from stableattn.numerics.precision import Precision

# Each stable preset beside the preset it makes stable.
STABLE_PAIRS = (
  ("bf16-fa2", "bf16-fa2-stable"),
  ("fp16-fa2", "fp16-fa2-stable"),
  ("fp32", "fp32-stable"),
)
MODES = ("forward", "forward_backward")
# Peers timed beside the BF16 pair only: they take 16-bit inputs, and one
# alternation per length is enough to place ours against them.
PRICE_PEERS = ("jax_mha", "cudnn")
# Our Triton path under the base preset with Options(center_kv=True).
CENTER_KV = "center_kv"

# Nsight Compute counters read per lever (launch/gpu_session.sh asks ncu
# for these names).
NCU_METRICS = {
  "gpu__time_duration.sum": "gpu_time_ns",
  "smsp__inst_executed.sum": "instructions",
  "launch__registers_per_thread": "registers_per_thread",
  "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "shared_memory_wavefronts",
  "smsp__sass_inst_executed_op_local_ld.sum": "local_loads",
  "smsp__inst_executed_pipe_fma.sum": "fma_instructions",
  # The tensor pipe's busy share; its name differs by Nsight version and
  # chip (the session script asks ncu which one it has).
  "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": (
    "tensor_pipe_active_pct"
  ),
  "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": (
    "tensor_pipe_active_pct"
  ),
  "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": (
    "tensor_pipe_active_pct"
  ),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
  batch: int
  heads: int
  head_dim: int
  lengths: tuple[int, ...]  # in the order they are measured
  warmup: int
  repeats: int
  block_q: int = 64
  block_k: int = 64
  fp32_length: int = 2048  # the FP32 pair's one length
  # The FP32 pair at `tiling.fp32_gpu_tiles` (a compiled kernel's tiles and
  # warps; interpret mode takes the sizes' own).
  fp32_tiles: bool = True


GPU_SIZES = Sizes(
  batch=4,
  heads=16,
  head_dim=128,
  lengths=(8192, 4096, 16384),
  warmup=1,
  repeats=5,
)
# Interpret mode on a CPU: the same code path at sizes a test can afford.
CPU_SIZES = Sizes(
  batch=1,
  heads=1,
  head_dim=16,
  lengths=(64,),
  warmup=1,
  repeats=1,
  block_q=32,
  block_k=32,
  fp32_tiles=False,
)


def sizes(small: bool) -> Sizes:
  return CPU_SIZES if small else GPU_SIZES


def program_bytes(compiled) -> dict:
  """Arguments, outputs and temporaries of one compiled program, from XLA's
  memory analysis (what it allocates; a custom call's own scratch, such as
  cuDNN's workspace, counts as XLA reserves it)."""
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # not every backend reports one
    analysis = None
  if analysis is None:
    return {}
  temp = int(analysis.temp_size_in_bytes)
  out = int(analysis.output_size_in_bytes)
  args = int(analysis.argument_size_in_bytes)
  alias = int(getattr(analysis, "alias_size_in_bytes", 0))
  return {"temp_bytes": temp, "program_bytes": temp + out + args - alias}


def _labels(stage, mode, causal, precision, s: Sizes, seq_len) -> dict:
  return {
    "kind": stage,
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "mode": mode,
    "causal": causal,
    "precision": precision,
    "head_dim": s.head_dim,
    "seq_len": seq_len,
    "batch": s.batch,
    "heads": s.heads,
  }


def _timed_rows(compiled, args, labels_of, s: Sizes, work) -> list[dict]:
  """One row per name of `compiled` ({name: program or error}), timed in
  alternation; `labels_of(name)` gives each row's labels."""
  times, errors = _alternating_times(compiled, args, s.warmup, s.repeats)
  rows = []
  for name, ts in times.items():
    row = _timing_row(labels_of(name), name, ts, work)
    rows.append({**row, **program_bytes(compiled[name])})
  rows += [
    {**labels_of(name), "implementation": name, "error": error}
    for name, error in errors.items()
  ]
  return rows


def price_points(s: Sizes, pairs=STABLE_PAIRS, modes=MODES):
  """(mode, causal, length, base, stable) in the order they are measured:
  the 16-bit pairs at each length in turn, then the FP32 pair at
  `fp32_length` alone, at its own tiles (`tiling.fp32_gpu_tiles`). At
  64x64 tiles the FP32 presets' compiled forward took 2.95 s at 8K on an
  H100 (a BF16 one 8.6 ms): at 8K their two forwards took 65 s of a 130 s
  stage."""
  half = [p for p in pairs if not _fp32_operands(p[0])]
  full = [p for p in pairs if _fp32_operands(p[0])]
  for seq_len, mode, causal, (base, stable) in itertools.product(
    s.lengths, modes, (False, True), half
  ):
    yield mode, causal, seq_len, base, stable
  for mode, causal, (base, stable) in itertools.product(
    modes, (False, True), full
  ):
    yield mode, causal, s.fp32_length, base, stable


def _fp32_operands(preset: str) -> bool:
  return Precision.from_name(preset).matmul_operands == "fp32"


def price_rows(s: Sizes, mode, causal, seq_len, base, stable) -> list[dict]:
  """Ours under `base` and under `stable` (and the peers, for BF16) in one
  alternation, inputs in the base preset's format."""
  shape = (s.batch, seq_len, s.heads, s.head_dim)
  args = random_inputs(jax.random.key(seq_len), shape, base)
  tiles = dict(block_q=s.block_q, block_k=s.block_k)
  if s.fp32_tiles and _fp32_operands(base):
    tiles = fp32_gpu_tiles(s.head_dim)
  fns = {
    precision: timed_fn(
      attention_fn("pallas", precision, causal, **tiles), mode
    )
    for precision in (base, stable)
  }
  presets = {base: base, stable: stable}  # what a name runs under
  if not _fp32_operands(base):
    # The exact fix for shared key and value offsets, on the base preset.
    fns[CENTER_KV] = timed_fn(
      attention_fn("pallas", base, causal, center_kv=True, **tiles), mode
    )
  if base == STABLE_PAIRS[0][0]:
    for peer in PRICE_PEERS:
      fns[peer] = timed_fn(attention_fn(peer, base, causal), mode)
    # The fixes on the Hopper path (Mosaic GPU keeps its own 64-row tiles).
    for name, precision, extra in (
      ("mosaic_gpu", base, {}),
      ("mosaic_gpu stable", stable, {}),
      (f"mosaic_gpu {CENTER_KV}", base, {"center_kv": True}),
    ):
      fns[name] = timed_fn(
        attention_fn("mosaic_gpu", precision, causal, **extra), mode
      )
      presets[name] = precision
  compiled = compile_all(fns, args)

  def labels_of(name):
    precision = presets.get(name, base)
    return {
      **_labels("price", mode, causal, precision, s, seq_len),
      "pair": base,
    }

  work = flops(s.batch, s.heads, seq_len, s.head_dim, causal, mode)
  rows = _timed_rows(compiled, args, labels_of, s, work)
  for row in rows:  # ours under a preset is "pallas"; peers keep their name
    if row["implementation"] in (base, stable):
      row["implementation"] = "pallas"
  return rows


# One configuration per lever, on top of bf16-fa2 with 64x64 tiles and 4
# warps (the defaults): (name, what it moves, options, causal).
LEVERS = (
  ("default", "-", {}, False),
  (
    "8 warps on 128x64 tiles",
    "registers per thread",
    {"block_q": 128, "num_warps": 8},
    False,
  ),
  ("64x32 tiles", "live score registers", {"block_k": 32}, False),
  ("two pipeline stages", "shared-memory traffic", {"num_stages": 2}, False),
  (
    "128x128 tiles, 8 warps",
    "shared-memory traffic per FLOP",
    {"block_q": 128, "block_k": 128, "num_warps": 8},
    False,
  ),
  (
    "softmax in base 2",
    "instructions",
    {"precision": "bf16-fa2+exp2=on"},
    False,
  ),
  (
    "128x128 tiles, 8 warps, base 2",
    "the levers together",
    {
      "block_q": 128,
      "block_k": 128,
      "num_warps": 8,
      "precision": "bf16-fa2+exp2=on",
    },
    False,
  ),
  ("causal", "causal block skipping", {}, True),
)
LEVER_PEER = "jax_mha"
HOPPER_PATH = "mosaic_gpu"


def _lever_fns(s: Sizes, small: bool):
  precision = "bf16-fa2"
  fns = {}
  for name, _, options, causal in LEVERS:
    options = {"block_q": s.block_q, "block_k": s.block_k, **options}
    if small:  # interpret mode has no Triton parameters; small tiles
      options = {
        k: min(v, s.block_q) if k.startswith("block") else v
        for k, v in options.items()
        if not k.startswith("num_")
      }
    policy = options.pop("precision", precision)
    fns[name] = attention_fn("pallas", policy, causal, **options)
  fns[LEVER_PEER] = attention_fn(LEVER_PEER, precision, False)
  # The Hopper path's forward beside them, for its Nsight counters.
  fns[HOPPER_PATH] = attention_fn(HOPPER_PATH, precision, False)
  return precision, fns


def lever_rows(s: Sizes, small: bool) -> list[dict]:
  """Every lever's forward, and jax's `mha`, in one alternation at the
  first length."""
  seq_len = s.lengths[0]
  precision, fns = _lever_fns(s, small)
  shape = (s.batch, seq_len, s.heads, s.head_dim)
  args = random_inputs(jax.random.key(seq_len), shape, precision)
  compiled = compile_all(fns, args)
  described = {
    name: (moves, opts, causal) for name, moves, opts, causal in LEVERS
  }

  def labels_of(name):
    moves, options, causal = described.get(name, ("-", {}, False))
    return {
      **_labels("lever", "forward", causal, precision, s, seq_len),
      "lever": name,
      "moves": moves,
      "options": json.dumps(options, sort_keys=True),
    }

  work = flops(s.batch, s.heads, seq_len, s.head_dim, False, "forward")
  rows = _timed_rows(compiled, args, labels_of, s, work)
  default = next(
    (r for r in rows if r["lever"] == "default" and "median_ms" in r), None
  )
  for row in rows:
    row["implementation"] = (
      "pallas" if row["lever"] in described else row["lever"]
    )
    if default is not None and "median_ms" in row:
      row["time_vs_default"] = row["median_ms"] / default["median_ms"]
  return rows


def ncu_pass(s: Sizes, small: bool) -> list[str]:
  """Each lever's forward run once, after compiling all of them, in the
  order `LEVERS`, the peer, then the Hopper path: the order of Nsight
  Compute's kernel IDs."""
  seq_len = s.lengths[0]
  precision, fns = _lever_fns(s, small)
  shape = (s.batch, seq_len, s.heads, s.head_dim)
  args = random_inputs(jax.random.key(seq_len), shape, precision)
  jax.block_until_ready(args)
  compiled = compile_all(fns, args)
  order = []
  for name, fn in compiled.items():
    if callable(fn):
      jax.block_until_ready(fn(*args))
      order.append(name)
  return order


def parse_ncu_csv(text: str, order: list[str]) -> list[dict]:
  """Nsight Compute's `--csv` rows (one per kernel and metric), one row
  per profiled kernel, labelled in `order` (`ncu_pass`'s)."""
  start = text.find('"ID"')
  if start < 0:
    raise ValueError('no Nsight Compute CSV table (a header with "ID")')
  kernels: dict[str, dict] = {}
  for record in csv.DictReader(io.StringIO(text[start:])):
    kernel = kernels.setdefault(
      record["ID"], {"kernel": record.get("Kernel Name", "")}
    )
    key = NCU_METRICS.get(record.get("Metric Name", ""))
    if key is not None:
      value = record["Metric Value"].replace(",", "")
      try:
        kernel[key] = float(value)
      except ValueError:
        kernel[key] = value
  ids = sorted(kernels, key=int)
  # The Hopper path's kernel is told by its name, so that a build whose
  # kernel the filter misses loses that row alone.
  hopper = [i for i in ids if "mosaic" in kernels[i]["kernel"]]
  ids = [i for i in ids if i not in hopper]
  named = [n for n in order if n == HOPPER_PATH]
  order = [n for n in order if n != HOPPER_PATH]
  if len(ids) != len(order):
    raise ValueError(
      f"{len(ids)} kernels profiled for {len(order)} variants {order}: "
      "the -c count or the kernel filter does not match the pass"
    )
  return [
    {"kind": "nsight", "lever": name, **kernels[i]}
    for name, i in [*zip(order, ids), *zip(named, hopper[:1])]
  ]


def append_rows(path: pathlib.Path, rows: list[dict]) -> None:
  with path.open("a") as f:
    for row in rows:
      f.write(json.dumps(row, sort_keys=True, default=str) + "\n")
