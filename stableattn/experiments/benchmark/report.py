"""The benchmark report: one function per section, all from rows."""

from __future__ import annotations

import itertools
import json

import jax

from stableattn.experiments.benchmark import monitor_overhead
from stableattn.experiments.benchmark.settings import Settings
from stableattn.harness import environment
from stableattn.harness.plotting import Series, line_panels, line_plot
from stableattn.harness.reporting import num, table
from stableattn.harness.rundir import RunDir


def write_report(run_dir: RunDir, s: Settings, rows) -> dict:
  """report.md, summary.csv and the figures; returns the headline numbers."""
  timings = [r for r in rows if r["kind"] == "timing"]
  memory = [r for r in rows if r["kind"] == "memory"]
  searches = [r for r in rows if r["kind"] == "tile_search"]
  masks = [r for r in rows if r["kind"] == "masks"]
  run_dir.write_csv("summary.csv", timings + memory)
  device, jax_version = _measured_on(timings)
  env = environment.describe()
  parts = [header(s, device, jax_version), environment.summary_line(env)]
  panels = {}
  for point in itertools.product(s.modes, s.causal, s.precisions, s.head_dims):
    text, panel = timing_section(s, timings, *point)
    parts.append(text)
    panels.update(panel)
  headline = {"environment": env}
  finding = forward_finding(s, timings)
  if finding:
    parts.append(finding[0])
    headline["forward_time_ratio_vs_reference"] = finding[1]
  monitor = [r for r in rows if r["kind"] == "monitor"]
  if monitor:
    parts += [monitor_overhead.overhead_line(row) for row in monitor]
    headline["monitor_overhead_per_step"] = {
      row.get("source", "kernel"): row["overhead_per_step"] for row in monitor
    }
  if masks:
    text, savings = masks_section(masks)
    parts.append(text)
    headline["mask_time_vs_full"] = savings
  if memory:
    text, share = memory_section(s, memory)
    parts.append(text)
    if share is not None:
      headline["memory_ratio_vs_reference"] = share
    _memory_figure(run_dir, memory)
  if searches:
    parts.append(search_section(s, searches))
  line_panels(
    run_dir.path / "tflops.png",
    panels,
    title=f"Throughput on {device}",
    xlabel="length",
    ylabel="TFLOP/s",
  )
  parts.append("![tflops](tflops.png)")
  if memory:
    parts.append("![memory](memory.png)")
  run_dir.write_text("report.md", "\n\n".join(parts) + "\n")
  run_dir.write_text(
    "headline.json", json.dumps(headline, indent=2, default=str) + "\n"
  )
  return {"workdir": str(run_dir.path), **headline}


def _measured_on(timings) -> tuple[str, str]:
  """The device and jax version the rows were measured with."""
  measured = next((r for r in timings if "device" in r), {})
  return (
    measured.get("device", jax.devices()[0].device_kind),
    measured.get("jax", jax.__version__),
  )


def header(s: Settings, device: str, jax_version: str) -> str:
  return (
    "# Attention speed and memory\n\n"
    f"*Device:* {device}, jax {jax_version}; batch {s.batch}, {s.heads} "
    f"heads, tiles {s.block_q}x{s.block_k} for ours; median of "
    f"{s.repeats} runs after {s.warmup} warm-up, implementations "
    "alternating; TFLOP/s by the FlashAttention FLOP count."
  )


def timing_section(s: Settings, timings, mode, causal, precision, head_dim):
  """The table of one (mode, masking, policy, head dim) and its panel."""
  group = [
    r
    for r in timings
    if (r["mode"], r["causal"], r["precision"], r["head_dim"])
    == (mode, causal, precision, head_dim)
  ]
  others = [i for i in s.implementations if i != "pallas"]
  header = ["length"] + [f"{i} ms (TFLOP/s)" for i in s.implementations]
  header += [f"time ours / {o}" for o in others]
  body = []
  for seq_len in s.seq_lens:
    by = {r["implementation"]: r for r in group if r["seq_len"] == seq_len}
    cells = [seq_len] + [time_cell(by.get(i)) for i in s.implementations]
    ours = by.get("pallas", {})
    body.append(cells + [num(ours.get(f"time_ratio_vs_{o}")) for o in others])
  masking = "causal" if causal else "non-causal"
  text = f"## {mode}, {masking}, {precision}, head dim {head_dim}\n\n" + table(
    header, body
  )
  name = f"{mode.replace('_', '+')}, {masking}, d={head_dim}, {precision}"
  series = [
    Series.from_points(
      impl,
      [
        (r["seq_len"], r["tflops"])
        for r in group
        if r["implementation"] == impl and "tflops" in r
      ],
    )
    for impl in s.implementations
  ]
  return text, {name: series}


def time_cell(row: dict | None) -> str:
  if row is None:
    return "-"
  if "error" in row:
    return "failed: " + short_error(row["error"])
  return f"{num(row['median_ms'])} ({num(row['tflops'])})"


def short_error(message: str) -> str:
  if "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower():
    return "out of memory"
  if "All configs failed during profiling" in message:
    return "no GEMM config ran (autotuning)"
  return message[:60]


def forward_finding(s: Settings, timings) -> tuple[str, float] | None:
  """Ours against the reference, forward, at length 2048 (or the longest)."""
  target_len = 2048 if 2048 in s.seq_lens else max(s.seq_lens)
  fwd = {
    r["implementation"]: r
    for r in timings
    if r["mode"] == "forward"
    and not r["causal"]
    and r["seq_len"] == target_len
    and r["head_dim"] == s.head_dims[0]
    and r["precision"] == s.precisions[0]
    and "median_ms" in r
  }
  if "pallas" not in fwd or "reference" not in fwd:
    return None
  ours, ref = fwd["pallas"]["median_ms"], fwd["reference"]["median_ms"]
  ratio = ours / ref
  return (
    f"**Finding.** Forward, non-causal, {s.precisions[0]}, head dim "
    f"{s.head_dims[0]}, length {target_len}: ours {num(ours)} ms vs "
    f"reference {num(ref)} ms ({ratio:.2f}x the reference's time).",
    ratio,
  )


# Targets for skipping the key blocks a mask empties, at length 4096
# (forward time vs full attention).
MASK_TARGETS = {"causal": 0.6, "window_256": 0.2}


def masks_section(masks) -> tuple[str, dict]:
  """Time of our kernel under each mask vs full attention."""
  body, savings = [], {}
  for r in masks:
    if "error" in r:
      body.append([r["mode"], r["precision"], r["mask"], "failed", "-", "-"])
      continue
    ratio = r.get("time_vs_full")
    target = MASK_TARGETS.get(r["mask"]) if r["mode"] == "forward" else None
    met = "-"
    if target is not None and ratio is not None:
      met = f"<= {target}: " + ("yes" if ratio <= target else "no")
    body.append(
      [
        r["mode"],
        r["precision"],
        r["mask"],
        num(r["median_ms"]),
        num(ratio),
        met,
      ]
    )
    savings[f"{r['mode']}/{r['precision']}/{r['mask']}"] = ratio
  first = masks[0]
  text = (
    f"## Skipping key blocks a mask empties (ours, length "
    f"{first['seq_len']}, head dim {first['head_dim']})\n\n"
    + table(["mode", "precision", "mask", "ms", "time / full", "target"], body)
    + "\n\nwindow_w is causal with a (w, 0) window (Mistral-style)."
  )
  return text, savings


def memory_section(s: Settings, memory) -> tuple[str, float | None]:
  """Peak memory per implementation and length; ours / reference."""
  names = sorted({r["implementation"] for r in memory})
  body = []
  for seq_len in s.memory_seq_lens:
    by = {r["implementation"]: r for r in memory if r["seq_len"] == seq_len}
    body.append(
      [seq_len] + [f"{by[n]['peak_bytes'] / 2**20:.1f}" for n in names]
    )
  text = (
    f"## Peak memory of one forward pass (MiB; {memory[0]['source']}; "
    f"batch 1, {s.heads} heads, head dim {memory[0]['head_dim']})\n\n"
    + table(["length"] + names, body)
  )
  longest = max(s.memory_seq_lens)
  by = {r["implementation"]: r for r in memory if r["seq_len"] == longest}
  if not (
    "pallas" in by and "reference" in by and by["reference"]["peak_bytes"]
  ):
    return text, None
  ours, ref = by["pallas"]["peak_bytes"], by["reference"]["peak_bytes"]
  share = ours / ref
  text += (
    f"\n\n**Finding.** At length {longest}, our kernel's peak is "
    f"{ours / 2**20:.1f} MiB vs the reference's {ref / 2**20:.1f} MiB "
    f"({share:.3f}x): flash attention never stores the length x length "
    "score matrix."
  )
  return text, share


def _memory_figure(run_dir: RunDir, memory) -> None:
  names = sorted({r["implementation"] for r in memory})
  line_plot(
    run_dir.path / "memory.png",
    [
      Series.from_points(
        n,
        [
          (r["seq_len"], r["peak_bytes"] / 2**20)
          for r in memory
          if r["implementation"] == n
        ],
      )
      for n in names
    ],
    title="Peak memory of one forward pass",
    xlabel="length",
    ylabel="MiB",
  )


def search_section(s: Settings, searches) -> str:
  return (
    "## Best tiles (GPU search)\n\n"
    f"Length {s.search_seq_len}; forward: every tile x warps x stages "
    "candidate; forward+backward: the forward's best tiles, every "
    "backward tile x warps x stages.\n\n"
    + table(
      ["mode", "precision", "head dim", "causal", "tiles", "backward tiles"]
      + ["warps", "stages", "ms", "ran / tried"],
      [search_cells(r) for r in searches],
    )
  )


def search_cells(r: dict) -> list:
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
