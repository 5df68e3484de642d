"""A GPU session's measurements kept in the repository, and every table and
figure the docs quote from them, regenerated on any machine.

A record folder (`results/gpu/<device>-<date>/`) holds rows only:

  session.json            device, driver, versions, date, the commands, and
                          the GPU tests' count
  benchmark/              `launch/benchmark.py`'s config.json and
                          metrics.jsonl (timings, block skipping)
  tile_search/            metrics.jsonl of a run with the tile search
  nsight.jsonl            Nsight Compute counters of one forward per variant
  audit/<kernel>.jsonl    `launch/audit.py`'s rows, one file per kernel

`python launch/gpu_report.py --record=results/gpu/h100-2026-11-24` writes
report.md (the tables of docs/performance.md, verbatim) and the throughput
figure; a test checks that the docs quote them unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from stableattn.experiments.benchmark.report import masks_section, search_cells
from stableattn.harness.plotting import Series, line_panels
from stableattn.harness.reporting import num, table

OURS = "bf16-fa2"  # the preset whose speed the goals are about
LEVER = "bf16-fa2+exp2=on"  # the same with the softmax in base 2
PEERS = ("jax_mha", "cudnn", "xla")
# Speed goals: (mode, head dim, length, peer, least speed vs the peer).
GOALS = (
  ("forward", 128, 8192, "jax_mha", 1.0),
  ("forward", 128, 8192, "cudnn", 0.6),
  ("forward_backward", 128, 8192, "cudnn", 0.6),
)


@dataclasses.dataclass(frozen=True)
class Record:
  session: dict
  timings: list  # benchmark timing rows
  masks: list
  search: list  # the tile-search run's rows (timings and best tiles)
  nsight: list
  audits: dict  # kernel -> rows


def _jsonl(path: pathlib.Path) -> list:
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def load(folder) -> Record:
  """The rows of a record folder; a missing part is named."""
  folder = pathlib.Path(folder)
  needed = ("session.json", "benchmark/metrics.jsonl")
  missing = [name for name in needed if not (folder / name).exists()]
  if missing:
    raise ValueError(
      f"{folder} is not a GPU record: {missing} missing (a record holds "
      "session.json, benchmark/, tile_search/, nsight.jsonl, audit/)."
    )
  rows = _jsonl(folder / "benchmark" / "metrics.jsonl")
  optional = lambda name: (  # noqa: E731
    _jsonl(folder / name) if (folder / name).exists() else []
  )
  audit_dir = folder / "audit"
  audits = (
    {p.stem: _jsonl(p) for p in sorted(audit_dir.glob("*.jsonl"))}
    if audit_dir.exists()
    else {}
  )
  return Record(
    session=json.loads((folder / "session.json").read_text()),
    timings=[r for r in rows if r["kind"] == "timing"],
    masks=[r for r in rows if r["kind"] == "masks"],
    search=optional("tile_search/metrics.jsonl"),
    nsight=optional("nsight.jsonl"),
    audits=audits,
  )


def _timing(rows, precision, mode, causal, head_dim, seq_len) -> dict:
  """name -> row of one point of one run (that precision's alternation)."""
  return {
    r["implementation"]: r
    for r in rows
    if r.get("kind", "timing") == "timing"
    and (r["precision"], r["mode"], r["causal"], r["head_dim"], r["seq_len"])
    == (precision, mode, causal, head_dim, seq_len)
  }


def speed(point: dict, peer: str) -> float | None:
  """Our speed relative to `peer` in one run: its time over ours."""
  ours, other = point.get("pallas", {}), point.get(peer, {})
  if "median_ms" not in ours or "median_ms" not in other:
    return None
  return other["median_ms"] / ours["median_ms"]


def _ms(row: dict | None) -> str:
  if row is None:
    return "-"
  return num(row["median_ms"]) if "median_ms" in row else "fails"


def speed_table(record: Record) -> str:
  """Every point: ms of ours (with and without exp2) and the peers, and
  speeds relative to them ("x": their time over ours, >1 is faster). The
  peers' ms are from the exp2 run's alternation."""
  header = [
    "mode",
    "causal",
    "head dim",
    "length",
    "ours",
    "ours, exp2",
    "jax_mha",
    "cudnn",
    "xla",
    "ours vs jax_mha",
    "exp2 vs jax_mha",
    "exp2 vs cudnn",
  ]
  points = sorted(
    {
      (r["mode"], r["causal"], r["head_dim"], r["seq_len"])
      for r in record.timings
    },
    key=lambda p: (p[0] != "forward", p[1], p[2], p[3]),
  )
  body = []
  for mode, causal, head_dim, seq_len in points:
    plain = _timing(record.timings, OURS, mode, causal, head_dim, seq_len)
    lever = _timing(record.timings, LEVER, mode, causal, head_dim, seq_len)
    ratios = (
      speed(plain, "jax_mha"),
      speed(lever, "jax_mha"),
      speed(lever, "cudnn"),
    )
    body.append(
      [
        mode.replace("_", "+"),
        "yes" if causal else "no",
        head_dim,
        seq_len,
        _ms(plain.get("pallas")),
        _ms(lever.get("pallas")),
      ]
      + [_ms(lever.get(p)) for p in PEERS]
      + [f"{x:.2f}x" if x is not None else "-" for x in ratios]
    )
  return table(header, body)


def _best(record: Record, mode: str, head_dim: int, causal: bool):
  return next(
    (
      r
      for r in record.search
      if r["kind"] == "tile_search"
      and (r["mode"], r["head_dim"], r["causal"]) == (mode, head_dim, causal)
      and "median_ms" in r
    ),
    None,
  )


def goal_lines(record: Record) -> str:
  """Each speed goal met or missed, with the ratio at the default tiles and
  at the best tiles the search found (against the peers of its run)."""
  lines = []
  for mode, head_dim, seq_len, peer, least in GOALS:
    found = []
    for precision in (OURS, LEVER):
      point = _timing(record.timings, precision, mode, False, head_dim, seq_len)
      x = speed(point, peer)
      if x is not None:
        found.append((x, f"{precision}, 64x64 tiles"))
    best = _best(record, mode, head_dim, False)
    if best is not None:
      point = _timing(
        record.search, best["precision"], mode, False, head_dim, seq_len
      )
      if peer in point and "median_ms" in point[peer]:
        x = point[peer]["median_ms"] / best["median_ms"]
        tiles = f"{best['block_q']}x{best['block_k']}"
        if mode == "forward_backward":
          tiles += f", backward {best['bwd_block_q']}x{best['bwd_block_k']}"
        found.append((x, f"{best['precision']}, best tiles {tiles}"))
    if not found:
      lines.append(f"- {mode} vs {peer} >= {least}x: no rows")
      continue
    top = max(found)[0]
    verdict = "met" if top >= least else "missed"
    measured = "; ".join(f"{x:.2f}x ({label})" for x, label in found)
    lines.append(
      f"- {mode.replace('_', '+')}, head dim {head_dim}, length {seq_len}, "
      f">= {least}x {peer}: **{verdict}** ({measured})."
    )
  return "\n".join(lines)


def masks_table(record: Record) -> str:
  """Block skipping: our time under each mask against full attention (the
  benchmark report's table, without its heading)."""
  if not record.masks:
    return ""
  text = masks_section(record.masks)[0]
  return text.split("\n\n", 1)[1]


def search_table(record: Record) -> str:
  rows = [r for r in record.search if r["kind"] == "tile_search"]
  return table(
    ["mode", "precision", "head dim", "causal", "tiles", "backward tiles"]
    + ["warps", "stages", "ms", "ran / tried"],
    [search_cells(r) for r in rows],
  )


def nsight_table(record: Record) -> str:
  """Counters of one forward per variant, instructions relative to mha."""
  mha = next(
    (r for r in record.nsight if r["implementation"] == "jax_mha"), None
  )
  body = []
  for r in record.nsight:
    rel = (
      "-" if mha is None else f"{r['instructions'] / mha['instructions']:.2f}"
    )
    body.append(
      [
        r["implementation"],
        r["precision"],
        f"{r['block_q']}x{r['block_k']}",
        r["num_warps"],
        num(r["gpu_time_ns"] / 1e6),
        f"{r['instructions'] / 1e9:.2f}",
        rel,
        f"{r['xu_pipe_instructions'] / 1e6:.0f}",
        r["registers_per_thread"],
        f"{r['shared_memory_wavefronts'] / 1e6:.0f}",
      ]
    )
  return table(
    [
      "kernel",
      "precision",
      "tiles",
      "warps",
      "ms",
      "instructions (G)",
      "vs mha",
      "MUFU/XU (M)",
      "registers",
      "shared wavefronts (M)",
    ],
    body,
  )


def audit_table(record: Record) -> str:
  """Per kernel: worst error / limit under the FA and Flex rules (output,
  gradients), and the tensors that differed between identical runs."""
  body = []
  for kernel, rows in record.audits.items():
    cells = [f"`{kernel}`"]
    for rule in ("flashattention", "flexattention"):
      for grads in (False, True):
        mine = [
          r
          for r in rows
          if (r["tensor"] != "out") == grads and r.get(f"{rule}_applies")
        ]
        passed = sum(r[f"{rule}_passed"] for r in mine)
        worst = max(
          (r[f"{rule}_value"] / r[f"{rule}_limit"] for r in mine), default=0
        )
        cells.append(f"{passed}/{len(mine)} ({worst:.2f})")
    moved = sorted(
      {
        (r["tensor"], r["shape"].split()[1], r["features"])
        for r in rows
        if not r["deterministic"]
      }
    )
    cells.append(
      "yes"
      if not moved
      else "no: " + ", ".join(f"{t} at {s} ({f})" for t, s, f in moved)
    )
    body.append(cells)
  return table(
    [
      "kernel",
      "FA rule, output",
      "FA rule, gradients",
      "Flex rule, output",
      "Flex rule, gradients",
      "bitwise equal over 5 runs",
    ],
    body,
  )


def sections(record: Record) -> dict[str, str]:
  """Each table the docs quote, by name."""
  return {
    "speed": speed_table(record),
    "goals": goal_lines(record),
    "masks": masks_table(record),
    "tile_search": search_table(record),
    "nsight": nsight_table(record),
    "audit": audit_table(record),
  }


def throughput_figure(record: Record, path) -> None:
  panels = {}
  for mode in ("forward", "forward_backward"):
    for head_dim in sorted({r["head_dim"] for r in record.timings}):
      series = []
      for precision, name in ((OURS, "ours"), (LEVER, "ours, exp2")):
        series.append(
          _series(record, mode, head_dim, precision, "pallas", name)
        )
      for peer in PEERS:
        series.append(_series(record, mode, head_dim, LEVER, peer, peer))
      panels[f"{mode.replace('_', '+')}, non-causal, d={head_dim}"] = series
  line_panels(
    path,
    panels,
    title=f"Throughput on {record.session['device']} (bf16)",
    xlabel="length",
    ylabel="TFLOP/s",
  )


def _series(record, mode, head_dim, precision, implementation, name):
  return Series.from_points(
    name,
    [
      (r["seq_len"], r["tflops"])
      for r in record.timings
      if (r["mode"], r["head_dim"], r["precision"], r["implementation"])
      == (mode, head_dim, precision, implementation)
      and not r["causal"]
      and "tflops" in r
    ],
  )


def write(folder, workdir) -> dict:
  """report.md and throughput.png from a record folder."""
  record = load(folder)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  s = record.session
  head = (
    f"# GPU record: {s['device']}, {s['date']}\n\n"
    f"jax {s['jax']}, driver {s['driver']}; commit {s['commit']}. GPU "
    f"tests: {s['gpu_tests']['passed']} passed, {s['gpu_tests']['failed']} "
    f"failed (`{s['gpu_tests']['command']}`)."
  )
  extra = s.get("gpu_tests_accumulator")
  if extra:
    head += (
      f" The MMA accumulator presets compiled against interpret mode: "
      f"{extra['passed']} passed, {extra['failed']} failed."
    )
  parts = [head] + [
    f"## {name}\n\n{text}" for name, text in sections(record).items() if text
  ]
  (workdir / "report.md").write_text("\n\n".join(parts) + "\n")
  throughput_figure(record, workdir / "throughput.png")
  return {"workdir": str(workdir), "sections": list(sections(record))}
