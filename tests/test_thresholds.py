"""The monitor's calibration: where each kernel starts missing the rules,
read off a sweep by the largest logit and stored as data."""

import pathlib

import pytest

from stableattn.auditing import thresholds

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _row(kernel, max_logit, failed=(), errors=0):
  return {
    "kernel": kernel, "max_logit": max_logit, "failed": list(failed),
    "errors": errors,
  }  # fmt: skip


def test_the_threshold_is_the_smallest_logit_that_missed():
  rows = [
    _row("a", 500.0, ["dv"]),
    _row("a", 5.0),
    _row("a", 50.0, ["dq"]),
    _row("a", 20.0),
    _row("b", 5.0),
    _row("b", 500.0),
  ]
  found = thresholds.thresholds(rows)
  assert found["a"] == {
    "misses_from": 50.0,
    "passes_up_to": 20.0,
    "tensors": ["dq"],
    "missed_at_or_above": [2, 2],
  }
  assert (
    found["b"]["misses_from"] is None and found["b"]["passes_up_to"] == 500.0
  )
  data = {"thresholds": found, "command": "x"}
  assert thresholds.kernels_missing_at(49.0, data) == []
  assert thresholds.kernels_missing_at(60.0, data) == ["a"]
  assert "| a | 20 | 50 | dq | 2 of 2 |" in thresholds.table(data)
  refused = [{**_row("c", 1e4, ["dq"]), "refused": ["shape"]}, _row("c", 5.0)]
  assert thresholds.thresholds(refused)["c"]["misses_from"] is None


def test_the_stored_calibration_is_its_rows_read_off_and_the_docs_quote_it():
  data = thresholds.load()
  assert data["rows"], "run python launch/monitor_thresholds.py"
  assert thresholds.thresholds(data["rows"]) == data["thresholds"]
  assert set(data["thresholds"]) == set(thresholds.KERNELS)
  docs = (ROOT / "docs" / "monitor.md").read_text()
  assert thresholds.table(data) in docs


@pytest.mark.slow  # a model or a sweep end to end; CI's slow tier
def test_a_sweep_row_records_the_logit_and_what_missed():
  rows = thresholds.sweep(["xla fp32"], stds=(1.0,))
  assert len(rows) == len(thresholds.SHAPES) * 2  # causal and not
  assert all(r["failed"] == [] and r["errors"] == 0 for r in rows)
  assert all(0 < r["max_logit"] < 10 for r in rows)
