"""launch/gpu_session.sh runs on the CPU path before a GPU sees it, and its
Nsight Compute rows are read back as the levers ran."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from stableattn.experiments.benchmark import gpu_stages

ROOT = pathlib.Path(__file__).resolve().parent.parent
STAGES = ("tests", "price", "regimes", "levers", "drift")


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
    ]
  )
  rows = gpu_stages.parse_ncu_csv(text, ["default", "jax_mha"])
  assert [r["lever"] for r in rows] == ["default", "jax_mha"]
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


def test_price_points_measure_every_pair_at_the_first_length_first():
  points = list(gpu_stages.price_points(gpu_stages.GPU_SIZES))
  first = [p for p in points if p[2] == 8192]
  assert points[: len(first)] == first and len(first) == 12
  assert {(p[3], p[4]) for p in first} == set(gpu_stages.STABLE_PAIRS)


@pytest.mark.slow
def test_every_stage_of_the_session_runs_on_the_cpu_path(tmp_path):
  record = tmp_path / "record"
  env = {
    **os.environ,
    "GPU_SESSION_SMALL": "1",
    "TEST_WORKERS": "1",
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
  for name in ("xla", "pallas_stable_fp32", "pallas_stable_bf16"):
    rows = (record / "audit" / f"{name}.jsonl").read_text().splitlines()
    regimes = {json.loads(r).get("regime") for r in rows}
    assert {"small_logits", "poisoned_padding"} <= regimes, name
  assert (record / "drift" / "metrics.jsonl").stat().st_size > 0
  assert (tmp_path / "p.tgz").stat().st_size > 0
