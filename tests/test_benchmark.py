"""The benchmark harness on its :smoke config (CPU)."""

import json

import pytest

from configs import benchmark as benchmark_config
from stableattn.experiments import benchmark


def test_smoke_writes_timings_ratios_and_memory(tmp_path):
  config = benchmark_config.get_config("smoke")
  config.modes = "forward"
  config.causal = (False,)
  result = benchmark.run(config, tmp_path)
  rows = [
    json.loads(line)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  timings = [r for r in rows if r["kind"] == "timing"]
  assert {r["implementation"] for r in timings} == {
    "pallas",
    "reference",
    "xla",
  }
  for r in timings:
    assert r["median_ms"] > 0 and r["tflops"] > 0
    assert r["min_ms"] <= r["median_ms"]
  ours = next(r for r in timings if r["implementation"] == "pallas")
  ref = next(
    r
    for r in timings
    if r["implementation"] == "reference" and r["seq_len"] == ours["seq_len"]
  )
  assert ours["time_ratio_vs_reference"] == pytest.approx(
    ours["median_ms"] / ref["median_ms"]
  )
  memory = {
    (r["implementation"], r["seq_len"]): r["peak_bytes"]
    for r in rows
    if r["kind"] == "memory"
  }
  # The materialized score matrix makes the reference's peak grow faster.
  assert memory[("reference", 1024)] > memory[("pallas", 1024)]
  assert result["memory_ratio_vs_reference"] < 1
  for name in ("report.md", "summary.csv", "tflops.png", "memory.png"):
    assert (tmp_path / name).stat().st_size > 0


def test_flop_count():
  assert benchmark.flops(1, 1, 2, 4, False, "forward") == 64
  assert benchmark.flops(1, 1, 2, 4, True, "forward") == 32
  assert benchmark.flops(1, 1, 2, 4, False, "forward_backward") == 224


def test_gpu_only_implementation_rejected_on_cpu():
  config = benchmark_config.get_config("smoke")
  config.implementations = "pallas,cudnn"
  with pytest.raises(ValueError, match="needs a GPU"):
    benchmark.run(config, "/nonexistent/never/written")
