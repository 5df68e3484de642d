"""The benchmark harness on its :smoke config (CPU)."""

import json

import jax
import pytest

from stableattn.configs import benchmark as benchmark_config
from stableattn.experiments import benchmark
from stableattn.experiments.benchmark import report


@pytest.mark.slow  # the smoke benchmark end to end
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
  headline = json.loads((tmp_path / "headline.json").read_text())
  assert headline["environment"]["backend"] == jax.default_backend()
  # Block skipping: every mask timed against full attention.
  savings = result["mask_time_vs_full"]
  assert savings["forward/fp32/full"] == 1.0
  assert 0 < savings["forward/fp32/window_256"] < 10
  assert "Skipping key blocks" in (tmp_path / "report.md").read_text()


def test_masks_section_checks_the_targets():
  from stableattn.experiments.benchmark.report import masks_section

  def row(mask, ratio):
    return {
      "kind": "masks",
      "mode": "forward",
      "precision": "bf16",
      "mask": mask,
      "seq_len": 4096,
      "head_dim": 128,
      "median_ms": 10.0 * ratio,
      "time_vs_full": ratio,
    }

  text, savings = masks_section(
    [row("full", 1.0), row("causal", 0.55), row("window_256", 0.3)]
  )
  assert "<= 0.6: yes" in text and "<= 0.2: no" in text
  assert savings == {
    "forward/bf16/full": 1.0,
    "forward/bf16/causal": 0.55,
    "forward/bf16/window_256": 0.3,
  }


def test_mask_settings_need_full():
  config = benchmark_config.get_config("smoke")
  config.mask_settings = "causal,window_256"
  with pytest.raises(ValueError, match="needs 'full'"):
    benchmark.run(config, "/nonexistent/never/written")


def test_flop_count():
  assert benchmark.flops(1, 1, 2, 4, False, "forward") == 64
  assert benchmark.flops(1, 1, 2, 4, True, "forward") == 32
  assert benchmark.flops(1, 1, 2, 4, False, "forward_backward") == 224


def test_gpu_only_implementation_rejected_on_cpu():
  config = benchmark_config.get_config("smoke")
  config.implementations = "pallas,cudnn"
  with pytest.raises(ValueError, match="needs a GPU"):
    benchmark.run(config, "/nonexistent/never/written")


def _settings(**changes):
  import dataclasses

  base = benchmark.Settings(
    implementations=("pallas", "reference"),
    modes=("forward",),
    causal=(False,),
    precisions=("fp32",),
    head_dims=(64,),
    seq_lens=(256, 512),
    batch=1,
    heads=2,
    block_q=64,
    block_k=64,
    warmup=0,
    repeats=1,
    memory_seq_lens=(512,),
    memory_implementations=("pallas", "reference"),
    tile_search=False,
    search_seq_len=512,
    mask_settings=(),
    masks_seq_len=512,
  )
  return dataclasses.replace(base, **changes)


def _timing(impl, seq_len, ms, **extra):
  return {
    "kind": "timing",
    "implementation": impl,
    "mode": "forward",
    "causal": False,
    "precision": "fp32",
    "head_dim": 64,
    "seq_len": seq_len,
    "median_ms": ms,
    "tflops": 1.0 / ms,
    **extra,
  }


def test_timing_section_names_failures_and_ratios():
  rows = [
    _timing("pallas", 256, 2.0, time_ratio_vs_reference=0.5),
    _timing("reference", 256, 4.0, time_ratio_vs_pallas=2.0),
    _timing("pallas", 512, 3.0),
    {
      **_timing("reference", 512, 1.0),
      "error": "RESOURCE_EXHAUSTED: Out of memory while trying to allocate",
    },
  ]
  del rows[-1]["median_ms"], rows[-1]["tflops"]
  text, panel = report.timing_section(
    _settings(), rows, "forward", False, "fp32", 64
  )
  lines = text.splitlines()
  assert lines[0] == "## forward, non-causal, fp32, head dim 64"
  assert "| 256 | 2 (0.5) | 4 (0.25) | 0.5 |" in lines
  assert "| 512 | 3 (0.333) | failed: out of memory | - |" in lines
  (series,) = panel.values()
  assert [s.label for s in series] == ["pallas", "reference"]
  assert series[1].x == [256]  # the failed point has no throughput


def test_forward_finding_and_memory_section_from_rows():
  s = _settings(seq_lens=(256, 2048))
  rows = [_timing("pallas", 2048, 3.0), _timing("reference", 2048, 6.0)]
  text, ratio = report.forward_finding(s, rows)
  assert ratio == 0.5 and "length 2048" in text
  assert report.forward_finding(s, rows[:1]) is None
  memory = [
    {
      "implementation": name,
      "seq_len": 512,
      "peak_bytes": peak,
      "source": "probe",
      "head_dim": 64,
    }
    for name, peak in (("pallas", 2**20), ("reference", 4 * 2**20))
  ]
  text, share = report.memory_section(s, memory)
  assert share == 0.25
  assert "| 512 | 1.0 | 4.0 |" in text
  assert "(0.250x)" in text


def test_search_section_lists_best_and_failures():
  rows = [
    {
      "mode": "forward",
      "precision": "bf16-fa2",
      "head_dim": 128,
      "causal": True,
      "block_q": 64,
      "block_k": 128,
      "bwd_block_q": 64,
      "bwd_block_k": 128,
      "num_warps": 4,
      "num_stages": 1,
      "median_ms": 3.98,
      "candidates_ran": 36,
      "candidates": 36,
    },
    {
      "mode": "forward_backward",
      "precision": "bf16-fa2",
      "head_dim": 128,
      "causal": True,
      "error": "no candidate compiled and ran",
    },
  ]
  text = report.search_section(_settings(search_seq_len=8192), rows)
  assert "Length 8192" in text
  assert "| forward | bf16-fa2 | 128 | True | 64x128 | 64x128 | 4 | 1 |" in text
  assert "no candidate compiled and ran" in text
