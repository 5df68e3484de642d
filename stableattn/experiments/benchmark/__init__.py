"""Speed and memory of our kernel against the attention users pick instead.

Implementations run in one process, in alternation, after warm-up: ours
("pallas"), "reference", "xla" (`jax.nn.dot_product_attention`), and on a
GPU also "cudnn" and jax's own Pallas kernel ("jax_mha"); names resolve
through `stableattn.ops.registry`. Modules: `settings` (config), `timing`
(FLOPs, compilation, alternating runs), `memory` (peak memory in a fresh
process), `tile_search` (GPU), `report`, and `gpu_record` (a GPU session's
rows kept in the repository and the docs' tables regenerated from them).
"""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from stableattn.experiments.benchmark import monitor_overhead
from stableattn.experiments.benchmark.memory import measure as measure_memory
from stableattn.experiments.benchmark.report import write_report
from stableattn.experiments.benchmark.settings import (
  MODES,
  Settings,
  settings_from_config,
)
from stableattn.experiments.benchmark.tile_search import tile_search
from stableattn.experiments.benchmark.timing import (
  flops,
  time_masks,
  time_point,
)
from stableattn.harness.rundir import opened

__all__ = ["MODES", "Settings", "flops", "run", "settings_from_config"]


def run(config, workdir, *, restart: bool = False) -> dict:
  """Times and measures every point afresh (timings are never resumed)."""
  s = settings_from_config(config)
  with opened(workdir, config, restart=restart) as (run_dir, _):
    rows = []
    for new in _measurements(s):
      run_dir.append_metrics(new)
      rows += new
    return write_report(run_dir, s, rows)


def _measurements(s: Settings):
  """Lists of rows: timings, block skipping, memory, the GPU tile search."""
  points = list(
    itertools.product(s.modes, s.causal, s.precisions, s.head_dims, s.seq_lens)
  )
  for point in tqdm(points, desc="benchmark", unit="point"):
    yield time_point(s, *point)
  if s.mask_settings:
    for mode, precision in itertools.product(s.modes, s.precisions):
      yield time_masks(s, mode, precision, s.head_dims[-1], s.masks_seq_len)
  runs = list(itertools.product(s.memory_implementations, s.memory_seq_lens))
  for name, seq_len in tqdm(runs, desc="memory", unit="run"):
    yield [
      measure_memory(
        name,
        seq_len,
        heads=s.heads,
        head_dim=s.head_dims[0],
        precision=s.precisions[0],
        block_q=s.block_q,
        block_k=s.block_k,
      )
    ]
  if s.monitor_overhead:
    for source in monitor_overhead.SOURCES:
      row = monitor_overhead.measure(s.monitor, source=source)
      print(monitor_overhead.overhead_line(row))
      yield [row]
  if s.tile_search:
    for precision, head_dim, causal in itertools.product(
      s.precisions, s.head_dims, s.causal
    ):
      yield tile_search(s, precision, head_dim, causal, s.search_seq_len)
