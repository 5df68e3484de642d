"""launch/gpu_session.sh runs on the CPU path before a GPU sees it, and its
Nsight Compute rows are read back as the levers ran."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from stableattn.contract.options import HOPPER_SWITCHES, hopper_switches
from stableattn.experiments.benchmark import gpu_stages, hopper_stage
from stableattn.kernels import mosaic_attention

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = (
  "tests", "hopper", "offsets", "price", "regimes", "levers", "drift",
)  # fmt: skip


def _ncu_csv(kernels):
  header = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context",'
    '"Stream","Block Size","Grid Size","Device","CC","Section Name",'
    '"Metric Name","Metric Unit","Metric Value"'
  )
  lines = ["==PROF== Connected to process 1", header]
  for i, (name, ns, registers) in enumerate(kernels):
    for metric, value in (
      ("gpu__time_duration.sum", ns),
      ("launch__registers_per_thread", registers),
    ):
      lines.append(
        f'"{i}","1","python3","host","{name}","1","7","(128, 1, 1)",'
        f'"(128, 64, 1)","0","9.0","Command line profiler metrics",'
        f'"{metric}","","{value}"'
      )
  return "\n".join(lines) + "\n"


def test_nsight_rows_follow_the_order_the_levers_ran():
  text = _ncu_csv(
    [
      ("stableattn_flash_forward_fa2", "8,316,096", 210),
      ("mha_forward", "5,040,928", 196),
      ("stableattn_mosaic_forward", "4,000,000", 168),
    ]
  )
  rows = gpu_stages.parse_ncu_csv(text, ["default", "jax_mha", "mosaic_gpu"])
  assert [r["lever"] for r in rows] == ["default", "jax_mha", "mosaic_gpu"]
  assert rows[2]["registers_per_thread"] == 168
  # A build whose Hopper kernel the filter missed keeps the other rows.
  missed = gpu_stages.parse_ncu_csv(
    _ncu_csv([("stableattn_flash_forward_fa2", "1", 1)]),
    ["default", "mosaic_gpu"],
  )
  assert [r["lever"] for r in missed] == ["default"]
  assert (
    rows[0]["gpu_time_ns"] == 8316096 and rows[1]["registers_per_thread"] == 196
  )
  assert rows[1]["kernel"] == "mha_forward"


def test_nsight_rows_refuse_a_count_that_does_not_match():
  text = _ncu_csv([("stableattn_flash_forward_fa2", "1", 1)])
  with pytest.raises(ValueError, match="1 kernels profiled for 2 variants"):
    gpu_stages.parse_ncu_csv(text, ["default", "causal"])
  with pytest.raises(ValueError, match="no Nsight Compute CSV"):
    gpu_stages.parse_ncu_csv("==PROF== nothing profiled\n", ["default"])


def test_hopper_points_measure_every_length_mode_and_masking():
  points = list(hopper_stage.hopper_points(gpu_stages.GPU_SIZES))
  assert len(points) == 12 and {p[2] for p in points[:4]} == {8192}
  assert {p[:2] for p in points[:4]} == {
    (m, c) for m in gpu_stages.MODES for c in (False, True)
  }


def test_price_points_measure_the_16_bit_pairs_by_length_then_fp32():
  points = list(gpu_stages.price_points(gpu_stages.GPU_SIZES))
  first = [p for p in points if p[2] == 8192]
  assert points[: len(first)] == first and len(first) == 8
  assert {p[3] for p in first} == {"bf16-fa2", "fp16-fa2"}
  assert [p[2:4] for p in points[-4:]] == [(2048, "fp32")] * 4


def _check_hopper_rows(path):
  """The hopper stage's rows off a GPU: our path timed in both modes, the
  GPU-only peers as error rows, every FlashAttention-3 form and every
  feature accounted for."""
  hopper = [json.loads(x) for x in path.read_text().splitlines()]
  timed = {(r["implementation"], r["mode"]) for r in hopper if "median_ms" in r}
  assert {("mosaic_gpu", m) for m in gpu_stages.MODES} <= timed
  # Off a GPU these cannot run: each is an error row, not a missing one.
  failed = {r["implementation"] for r in hopper if "error" in r}
  assert {"cudnn", "jax_mgpu"} <= failed
  # FlashAttention-3's forms: interpret mode refuses those its
  # interpreter cannot run, naming what it lacks, and times the others.
  forms = [r for r in hopper if r["implementation"].startswith("mosaic_gpu ")]
  assert {r["implementation"] for r in forms} == {
    f"mosaic_gpu {f}" for f in ("fa3", *HOPPER_SWITCHES)
  }
  lacks = mosaic_attention.interpreter_lacks()
  for r in forms:
    form = r["implementation"].split(" ", 1)[1]
    if set(hopper_switches(form)) & set(lacks):
      assert "GPU interpreter" in r["error"], r
    else:  # the warp-specialized forward runs in interpret mode
      assert "median_ms" in r, r
  # Every feature on both of our paths, in both modes.
  featured = {
    (r["feature"], r["implementation"], r["mode"])
    for r in hopper
    if "feature" in r and "median_ms" in r
  }
  assert featured == {
    (f, name, m)
    for f in hopper_stage.HOPPER_FEATURES
    for name in ("mosaic_gpu", "pallas")
    for m in hopper_stage.feature_modes(f)
  }
  assert hopper_stage.feature_modes("fp8-fa3") == ("forward",)


@pytest.mark.slow
def test_every_stage_of_the_session_runs_on_the_cpu_path(tmp_path):
  record = tmp_path / "record"
  env = {
    **os.environ,
    "GPU_SESSION_SMALL": "1",
    "TEST_WORKERS": "1",
    # Six audits compile cold on 2 cores: 67 s alone, over the GPU's 75 s
    # limit beside another test worker.
    "REGIMES_S": "180",
    "PYTHON": sys.executable,
  }
  done = subprocess.run(
    ["bash", "launch/gpu_session.sh", str(record), str(tmp_path / "p.tgz")],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  stages = [
    json.loads(line)
    for line in (record / "stages.jsonl").read_text().splitlines()
  ]
  assert [s["stage"] for s in stages] == list(STAGES), done.stdout
  for s in stages:
    assert s["rc"] == 0 and not s["cut_off"], (s, done.stdout[-2000:])
  price = [
    json.loads(x) for x in (record / "price.jsonl").read_text().splitlines()
  ]
  stable = {r["precision"] for r in price if "median_ms" in r}
  assert {"bf16-fa2-stable", "fp16-fa2-stable", "fp32-stable"} <= stable
  assert all("program_bytes" in r for r in price if "median_ms" in r)
  levers = [
    json.loads(x) for x in (record / "levers.jsonl").read_text().splitlines()
  ]
  assert {r["lever"] for r in levers} >= {"default", "causal", "jax_mha"}
  _check_hopper_rows(record / "hopper.jsonl")
  for name in ("xla", "mosaic_gpu", "pallas_stable_fp32", "pallas_stable_bf16"):
    rows = (record / "audit" / f"{name}.jsonl").read_text().splitlines()
    regimes = {json.loads(r).get("regime") for r in rows}
    assert {"small_logits", "poisoned_padding"} <= regimes, name
  for name in ("xla", "pallas", "pallas_center_kv"):
    rows = [
      json.loads(r)
      for r in (record / "offsets" / f"{name}.jsonl").read_text().splitlines()
    ]
    assert {"key_offset", "key_shift"} <= {r["regime"] for r in rows}, name
  center_kv = [r for r in price if r["implementation"] == "center_kv"]
  assert {r["pair"] for r in center_kv} == {"bf16-fa2", "fp16-fa2"}
  mosaic = {r["implementation"] for r in price if "median_ms" in r}
  assert {"mosaic_gpu", "mosaic_gpu stable", "mosaic_gpu center_kv"} <= mosaic
  assert (record / "drift" / "metrics.jsonl").stat().st_size > 0
  assert (tmp_path / "p.tgz").stat().st_size > 0


@pytest.mark.parametrize("record", ["h100-2026-11-26", "h200-2026-11-28"])
def test_docs_quote_every_table_of_the_session_record_unchanged(record):
  from stableattn.experiments.benchmark import session_record

  loaded = session_record.load(ROOT / "results" / "gpu" / record)
  docs = (ROOT / "docs" / "performance.md").read_text()
  sections = session_record.sections(loaded)
  for name in ("stages", "tests", "goals", "price", "levers", "regimes"):
    assert sections[name], f"{record}: section {name} is empty"
  for name, text in sections.items():
    assert text in docs, (
      f"docs/performance.md does not quote {record}'s {name} as rows give it"
    )


def test_session_goals_read_met_or_missed_from_rows():
  from stableattn.experiments.benchmark import session_goals, session_record

  def timing(kind, implementation, precision, ms, **labels):
    return {
      "kind": kind,
      "implementation": implementation,
      "precision": precision,
      "mode": "forward",
      "causal": False,
      "seq_len": 8192,
      "pair": "bf16-fa2",
      "median_ms": ms,
      **labels,
    }

  price = [
    timing("price", "pallas", "bf16-fa2", 10.0),
    timing("price", "jax_mha", "bf16-fa2", 11.0),
    timing("price", "cudnn", "bf16-fa2", 5.0),
    timing("price", "pallas", "bf16-fa2", 20.0, mode="forward_backward"),
    timing("price", "pallas", "bf16-fa2-stable", 23.0, mode="forward_backward"),
  ]
  levers = [
    timing("lever", "pallas", "bf16-fa2", 10.0, lever="default"),
    timing("lever", "pallas", "bf16-fa2", 5.0, lever="causal", causal=True),
  ]
  record = session_record.SessionRecord({}, [], {}, price, levers, [], {}, [])
  lines = session_goals.goal_lines(record).splitlines()
  assert "**met**" in lines[0] and "1.10x" in lines[0]  # 11 / 10
  assert "**missed**" in lines[1] and "0.50x" in lines[1]  # 5 / 10
  assert lines[2].endswith("no rows")  # no cuDNN forward+backward row
  assert "**missed**" in lines[3] and "1.150x" in lines[3]  # 23 / 20
  assert "**met**" in lines[4] and "0.50x" in lines[4]  # causal 5 / 10
  assert [line.rsplit(": ", 1)[-1] for line in lines[5:]] == [
    "no rows",
    "no rows",
    "not run",
  ]
  price += [
    timing("price", "center_kv", "bf16-fa2", 21.0, mode="forward_backward"),
    timing("price", "pallas", "fp32", 1.0, seq_len=2048, pair="fp32", tflops=8),
  ]
  split_kv = f"{session_goals.SPLIT_KV_TESTS[0]}[lengths]"
  tests = {"gpu_tests.txt": ([split_kv], [], [])}
  record = session_record.SessionRecord(
    {}, [], tests, price, levers, [], {}, []
  )
  lines = session_goals.goal_lines(record).splitlines()
  assert "**met**" in lines[5] and "1.050x" in lines[5]  # center_kv 21 / 20
  assert (
    "**met**" in lines[6] and "8.0 TFLOP/s; spills not measured" in lines[6]
  )
  assert "**met**" in lines[7] and "1 passed, 0 failed" in lines[7]
  failing = {"gpu_tests.txt": ([], [split_kv], [])}
  record = dataclasses.replace(record, tests=failing)
  assert "**missed**" in session_goals.goal_lines(record).splitlines()[7]


def test_the_offsets_table_reads_each_kernels_worst_ratios():
  from stableattn.experiments.benchmark import offsets_record

  def row(regime, tensor, fa, flex, **more):
    return {
      "regime": regime, "tensor": tensor, "shape": "B1 T8 S8 H2/1 D4",
      "flashattention_applies": True, "flashattention_limit": 1.0,
      "flashattention_value": fa, "flashattention_passed": fa <= 1,
      "flexattention_applies": True, "flexattention_limit": 2.0,
      "flexattention_value": flex, "flexattention_passed": flex <= 2,
      **more,
    }  # fmt: skip

  missing = [
    row("none", "out", 0.1, 0.5),
    row("key_offset", "dq", 20.0, 80.0),
    row("key_offset", "dk", 0.5, 1.0),
    row("key_shift", "dq", 0.5, 3.0, deterministic=False),
  ]
  text = offsets_record.offsets_table(
    {"theirs": missing, "ours": [row("key_offset", "dq", 0.2, 1.0)]}
  )
  theirs = next(line for line in text.splitlines() if "`theirs`" in line)
  cells = [c.strip() for c in theirs.split("|")[1:-1]]
  assert cells[2:] == [
    "20x (dq)", "40x (dq)", "1.5x (dq)", "0.5x (dk)", "0.25x (out)",
    "**no**", "**fails**",
  ]  # fmt: skip
  ours = next(line for line in text.splitlines() if "`ours`" in line)
  assert ours.endswith("| yes | passes |")


def test_the_hopper_goals_read_met_or_missed_from_rows():
  from stableattn.experiments.benchmark import hopper_record

  def row(name, mode, ms, speed=None):
    found = {
      "implementation": name, "mode": mode, "causal": False,
      "seq_len": 8192, "median_ms": ms,
    }  # fmt: skip
    return found if speed is None else {**found, "speed_vs_cudnn": speed}

  rows = [
    row("cudnn", "forward", 1.6),
    row("mosaic_gpu", "forward", 1.8, 1.6 / 1.8),
    row("cudnn", "forward_backward", 5.0),
    row("mosaic_gpu", "forward_backward", 8.0, 5.0 / 8.0),
    {
      "implementation": "jax_mgpu",
      "mode": "forward",
      "causal": False,
      "seq_len": 8192,
      "error": "Mixed input dtypes",
    },  # fmt: skip
  ]
  lines = hopper_record.hopper_goal_lines(rows).splitlines()
  assert lines[0].endswith("**met** (0.89x)")
  assert lines[1].endswith("**missed** (0.62x)")
  text = hopper_record.hopper_table(rows)
  assert "fails" in text and "0.89x" in text
  assert hopper_record.hopper_sections([]) == {}
  # The forms against the interpreter's form, and the feature rows on
  # their own table (not mixed into the core comparison's).
  forms = hopper_record.hopper_form_table(
    [*rows, row("mosaic_gpu fa3", "forward", 1.2)]
  )
  assert "| fa3 | 1.2 | 1.8 | 1.50x |" in forms
  feature = {"feature": "bias", "causal": False, "seq_len": 8192}
  featured = [
    {
      **feature,
      "implementation": "mosaic_gpu",
      "mode": "forward",
      "median_ms": 2.0,
    },
    {
      **feature,
      "implementation": "pallas",
      "mode": "forward",
      "median_ms": 3.0,
    },
  ]
  assert "| bias | forward | False | 8192 | 2 | 3 | fails | 1.50x |" in (
    hopper_record.hopper_feature_table(featured)
  )
  assert hopper_record.hopper_table(rows + featured) == text


def test_the_gpu_offset_findings_read_from_the_stored_rows():
  """docs/findings.md's GPU claims on shared key components (H200)."""
  from stableattn.auditing.measure import rule_ratio
  from stableattn.experiments.benchmark import offsets_record, session_record

  record = session_record.load(ROOT / "results" / "gpu" / "h200-2026-11-28")

  def worst_dq(name):
    rows = [
      r for r in record.offsets[name]
      if r["regime"] == "key_offset" and r["tensor"] == "dq"
    ]  # fmt: skip
    return max(rule_ratio(r, "flexattention") for r in rows)

  fa2_style = ("cudnn", "torch_sdpa_cudnn", "torch_sdpa_flash",
               "torch_sdpa_efficient", "pallas", "mosaic_gpu")  # fmt: skip
  assert all(80.5 <= worst_dq(n) <= 82.5 for n in fa2_style)
  assert round(worst_dq("jax_mha_mha")) == 151
  assert all(
    90 <= worst_dq(n) <= 92 for n in ("pallas_mha", "torch_sdpa_flash_mha")
  )
  fixed = [
    f"{p}_{fix}"
    for p in ("pallas", "mosaic_gpu")
    for fix in ("stable", "center_kv")
  ]
  assert all(0.65 <= worst_dq(n) <= 0.74 for n in fixed)
  assert not all(r["deterministic"] for r in record.offsets["jax_mha_gqa"])
  table = offsets_record.offsets_table(record.offsets)
  assert sum("**fails**" in line for line in table.splitlines()) == 10
