"""The GPU numbers in docs/performance.md regenerate from the rows stored
under results/gpu/, on a CPU."""

import json
import pathlib

import pytest

from stableattn.experiments.benchmark import gpu_record

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORD = ROOT / "results" / "gpu" / "h100-2026-11-24"


def test_docs_quote_every_table_of_the_record_unchanged():
  docs = (ROOT / "docs" / "performance.md").read_text()
  record = gpu_record.load(RECORD)
  for name, text in gpu_record.sections(record).items():
    assert text, f"section {name} is empty"
    assert text in docs, (
      f"docs/performance.md does not quote {name} as rows give it"
    )


def test_report_and_figure_are_written(tmp_path):
  result = gpu_record.write(RECORD, tmp_path)
  assert "speed" in result["sections"]
  assert (tmp_path / "throughput.png").stat().st_size > 0
  assert "46 passed" in (tmp_path / "report.md").read_text()


def _row(implementation, precision, ms, **labels):
  return {
    "kind": "timing",
    "implementation": implementation,
    "precision": precision,
    "mode": "forward",
    "causal": False,
    "head_dim": 128,
    "seq_len": 8192,
    "median_ms": ms,
    **labels,
  }


def test_goal_is_met_only_where_a_measured_speed_reaches_it():
  timings = [
    _row("pallas", "bf16-fa2", 10.0),
    _row("jax_mha", "bf16-fa2", 9.0),
    _row("cudnn", "bf16-fa2", 3.0),
    _row("pallas", "bf16-fa2+exp2=on", 8.0),
    _row("jax_mha", "bf16-fa2+exp2=on", 8.8),
    _row("cudnn", "bf16-fa2+exp2=on", 3.0),
  ]
  record = gpu_record.Record({}, timings, [], [], [], {})
  lines = gpu_record.goal_lines(record).splitlines()
  assert "**met**" in lines[0] and "1.10x" in lines[0]  # 8.8 / 8
  assert "**missed**" in lines[1] and "0.38x" in lines[1]  # 3 / 8
  assert lines[2].endswith("no rows")  # no forward+backward rows


def test_a_folder_without_rows_is_refused_naming_what_is_missing(tmp_path):
  (tmp_path / "session.json").write_text(json.dumps({}))
  with pytest.raises(ValueError, match="benchmark/metrics.jsonl"):
    gpu_record.load(tmp_path)
