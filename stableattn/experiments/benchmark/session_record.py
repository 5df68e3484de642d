"""The record of a GPU session run by `launch/gpu_session.sh`, and the
tables docs/performance.md quotes from it, regenerated on any machine.

A record folder (`results/gpu/<device>-<date>/`) holds what the session's
stages wrote:

  session.json          device, versions, date; the calls with their
                        stages (or stages.jsonl, as the script writes it)
                        and what was not reached
  gpu_tests*.txt        the tests stage's PASSED/FAILED lines
  hopper*.jsonl         the Hopper path against cuDNN and the peers
  price*.jsonl          stable presets against their base presets
  levers.jsonl          one forward per lever, and jax's mha
  nsight*.jsonl         Nsight Compute counters of those forwards
  audit/<name>.jsonl    the regimes audit's rows, one file per audit
  offsets/<name>.jsonl  the key_offset regime and key_shift, per kernel
  drift/metrics.jsonl   the drift point's rows

`python launch/gpu_report.py --record=results/gpu/h100-2026-11-26` writes
report.md; a test checks that the docs quote its tables unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from stableattn.experiments.benchmark.hopper_record import (
  hopper_sections,
)
from stableattn.experiments.benchmark.offsets_record import offsets_table
from stableattn.experiments.benchmark.session_goals import (
  goal_lines,
  lever,
  price_points,
  stable_of,
)
from stableattn.harness.reporting import num, table


@dataclasses.dataclass(frozen=True)
class SessionRecord:
  session: dict
  stages: list  # one row per stage per call
  tests: dict  # file name -> (passed names, failed names, error lines)
  price: list
  levers: list
  nsight: list
  audits: dict  # audit name -> rows
  drift: list
  hopper: list = ()  # the Hopper path's timings (sessions since 2026-11-27)
  offsets: dict = dataclasses.field(default_factory=dict)  # name -> rows


def _jsonl(path: pathlib.Path) -> list:
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def _globbed(folder: pathlib.Path, pattern: str) -> list:
  return [row for p in sorted(folder.glob(pattern)) for row in _jsonl(p)]


def is_session_record(folder) -> bool:
  folder = pathlib.Path(folder)
  return (folder / "price.jsonl").exists() or (folder / "stages.jsonl").exists()


def _tests(path: pathlib.Path):
  passed, failed, errors = [], [], []
  for line in path.read_text().splitlines():
    word, _, rest = line.strip().partition(" ")
    name = rest.split("::")[-1].strip()
    if word == "PASSED":
      passed.append(name)
    elif word == "FAILED":
      failed.append(name)
    elif "error:" in line:
      errors.append(line.split("error:", 1)[1].strip())
  return passed, failed, errors


def load(folder) -> SessionRecord:
  folder = pathlib.Path(folder)
  if not (folder / "session.json").exists():
    raise ValueError(
      f"{folder} is not a GPU session record: session.json missing "
      "(launch/gpu_session.sh writes it first)."
    )
  session = json.loads((folder / "session.json").read_text())
  if (folder / "stages.jsonl").exists():
    stages = [{**s, "call": 1} for s in _jsonl(folder / "stages.jsonl")]
  else:
    stages = [
      {**s, "call": i}
      for i, call in enumerate(session.get("calls", []), 1)
      for s in call["stages"]
    ]
  audit, offsets = folder / "audit", folder / "offsets"
  return SessionRecord(
    session=session,
    stages=stages,
    tests={p.name: _tests(p) for p in sorted(folder.glob("gpu_tests*.txt"))},
    price=_globbed(folder, "price*.jsonl"),
    levers=_globbed(folder, "levers*.jsonl"),
    nsight=_globbed(folder, "nsight*.jsonl"),
    audits={p.stem: _jsonl(p) for p in sorted(audit.glob("*.jsonl"))}
    if audit.exists()
    else {},
    drift=_globbed(folder, "drift/metrics.jsonl"),
    hopper=_globbed(folder, "hopper*.jsonl"),
    offsets={p.stem: _jsonl(p) for p in sorted(offsets.glob("*.jsonl"))},
  )


def stages_table(r: SessionRecord) -> str:
  body = []
  for s in r.stages:
    if s.get("skipped"):
      continue
    ended = "cut off" if s["cut_off"] else ("ok" if s["rc"] == 0 else "failed")
    body.append(
      [s["call"], s["stage"], f"{s['seconds']} of {s['limit']}", s["rc"], ended]
    )
  text = table(["call", "stage", "seconds", "exit", "ended"], body)
  missing = r.session.get("not_reached", [])
  if missing:
    text += "\n\nNot reached:\n" + "\n".join(f"- {m}" for m in missing)
  return text


def tests_lines(r: SessionRecord) -> str:
  lines = []
  for name, (passed, failed, errors) in r.tests.items():
    line = f"- `{name}`: {len(passed)} passed, {len(failed)} failed"
    if failed:
      line += " (" + ", ".join(f"`{f}`" for f in sorted(set(failed))) + ")"
    if errors:
      line += "; Triton: " + "; ".join(f"`{e}`" for e in sorted(set(errors)))
    lines.append(line + ".")
  return "\n".join(lines)


def _ms(row) -> str:
  if row is None:
    return "-"
  return num(row["median_ms"]) if "median_ms" in row else "fails"


def _mb(row) -> str:
  if row is None or "program_bytes" not in row:
    return "-"
  return f"{row['program_bytes'] / 2**20:.0f}"


def price_table(r: SessionRecord) -> str:
  """Each point: ours under the base and the stable preset (time, program
  memory), and the peers where timed in the same alternation."""
  body = []
  for (mode, causal, length, base), rows in sorted(
    price_points(r).items(),
    key=lambda kv: (kv[0][0] != "forward", kv[0][2], kv[0][1], kv[0][3]),
  ):
    stable = stable_of(base)
    b, s = rows.get(base), rows.get(stable)
    ratio = (
      f"{s['median_ms'] / b['median_ms']:.3f}x"
      if b and s and "median_ms" in b and "median_ms" in s
      else "-"
    )
    body.append(
      [
        mode.replace("_", "+"),
        "yes" if causal else "no",
        length,
        base,
        _ms(b),
        _ms(s),
        ratio,
        _mb(b),
        _mb(s),
        _ms(rows.get("jax_mha")),
        _ms(rows.get("cudnn")),
      ]
    )
  header = [
    "mode", "causal", "length", "base preset", "base ms", "stable ms",
    "stable / base", "base MiB", "stable MiB", "jax_mha ms", "cudnn ms",
  ]  # fmt: skip
  return table(header, body)


def levers_table(r: SessionRecord) -> str:
  """Each lever's forward time, against the default and jax's mha, with
  its Nsight Compute counters."""
  counters = {x["lever"]: x for x in r.nsight}
  mha = lever(r, "jax_mha")
  body = []
  for row in r.levers:
    c = counters.get(row["lever"], {})
    timed = "median_ms" in row
    body.append(
      [
        row["lever"],
        row.get("moves", "-"),
        _ms(row),
        f"{row['time_vs_default']:.2f}x" if "time_vs_default" in row else "-",
        f"{mha['median_ms'] / row['median_ms']:.2f}x" if mha and timed else "-",
        num(c["gpu_time_ns"] / 1e6) if "gpu_time_ns" in c else "-",
        int(c["registers_per_thread"]) if "registers_per_thread" in c else "-",
        f"{c['instructions'] / 1e9:.2f}" if "instructions" in c else "-",
        f"{c['shared_memory_wavefronts'] / 1e6:.0f}" if c else "-",
        f"{c['local_loads']:.0f}" if "local_loads" in c else "-",
        f"{c['tensor_pipe_active_pct']:.0f}%"
        if "tensor_pipe_active_pct" in c
        else "-",
      ]
    )
  header = [
    "lever", "what it moves", "ms", "vs default", "speed vs mha", "ncu ms",
    "registers", "instructions (G)", "shared wavefronts (M)", "local loads",
    "tensor pipe busy",
  ]  # fmt: skip
  return table(header, body)


def fp32_lines(r: SessionRecord) -> str:
  """The FP32 presets' compiled kernel: its time and counters."""
  lines = []
  for row in r.nsight:
    if row.get("precision") != "fp32":
      continue
    lines.append(
      f"- one `fp32` forward at batch {row['batch']}, length "
      f"{row['seq_len']}, {row['heads']} heads, head dim {row['head_dim']}, "
      f"{row['block_q']}x{row['block_k']} tiles: "
      f"{row['gpu_time_ns'] / 1e6:.0f} ms, "
      f"{int(row['registers_per_thread'])} registers per thread, "
      f"{row['local_loads'] / 1e9:.2f} G local-memory loads, "
      f"{row['fma_instructions'] / 1e9:.2f} G FMA-pipe of "
      f"{row['instructions'] / 1e9:.2f} G instructions."
    )
  return "\n".join(lines)


def _failing(rows) -> list:
  return [
    x
    for x in rows
    if x.get("nonfinite")
    or (x.get("flashattention_applies") and not x.get("flashattention_passed"))
  ]


def regimes_table(r: SessionRecord) -> str:
  """Per audit and regime: rows, those missing FlashAttention's rule or
  non-finite, and the worst (value / limit) among them."""
  body = []
  for name, rows in r.audits.items():
    for regime in sorted({x["regime"] for x in rows}):
      mine = [x for x in rows if x["regime"] == regime]
      bad = _failing(mine)
      nonfinite = [x for x in bad if x.get("nonfinite")]
      ratios = [
        x["flashattention_value"] / x["flashattention_limit"]
        for x in bad
        if not x.get("nonfinite")
      ]
      tensors: dict = {}
      for x in bad:
        tensors.setdefault(x["detail"], []).append(x["tensor"])
      where = sorted(f"{d}: {', '.join(t)}" for d, t in tensors.items())
      body.append(
        [
          f"`{name}`",
          regime,
          len(mine),
          len(bad),
          len(nonfinite),
          f"{max(ratios):.1f}" if ratios else "-",
          "; ".join(where) if where else "-",
        ]
      )
  header = [
    "audit", "regime", "rows", "fail", "non-finite", "worst / limit", "where",
  ]  # fmt: skip
  return table(header, body)


def drift_table(r: SessionRecord) -> str:
  """Whole-model weight drift (relative L2) of each pair by step, and
  Flash's over BF16-vs-FP32's."""
  model = {
    (x["pair"], x["step"]): x["rel_l2"]
    for x in r.drift
    if x["kind"] == "drift" and x.get("scope") == "model"
  }
  if not model:
    return ""
  body = []
  for step in sorted({s for _, s in model}):
    flash = model.get(("flash_vs_baseline", step))
    bf16 = model.get(("bf16_vs_fp32", step))
    ratio = f"{flash / bf16:.2f}x" if flash is not None and bf16 else "-"
    body.append([step, num(flash), num(bf16), ratio])
  return table(
    ["step", "Flash vs Baseline", "BF16 vs FP32", "Flash / BF16-vs-FP32"],
    body,
  )


def sections(r: SessionRecord) -> dict[str, str]:
  return {
    "stages": stages_table(r),
    "tests": tests_lines(r),
    "goals": goal_lines(r),
    "price": price_table(r),
    "levers": levers_table(r),
    "fp32": fp32_lines(r),
    "regimes": regimes_table(r),
    "drift": drift_table(r),
    **hopper_sections(r.hopper),
    "offsets": offsets_table(r.offsets) if r.offsets else "",
  }


def write(folder, workdir) -> dict:
  record = load(folder)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  s = record.session
  head = (
    f"# GPU session: {s['device']}, {s['date']}\n\n"
    f"jax {s['jax']}, driver {s.get('driver', '-')}; "
    f"script {s.get('script', '-')}."
  )
  parts = [head] + [
    f"## {name}\n\n{text}" for name, text in sections(record).items() if text
  ]
  (workdir / "report.md").write_text("\n\n".join(parts) + "\n")
  return {"workdir": str(workdir), "sections": list(sections(record))}
