"""The monitor's calibration: where each kernel starts missing the rules,
read off a sweep by the largest logit and stored as data."""

import pathlib

import pytest

from stableattn.auditing import thresholds

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _row(kernel, max_logit, failed=(), errors=0, share=0.0, tie_share=0.0):
  return {
    "kernel": kernel, "max_logit": max_logit, "failed": list(failed),
    "errors": errors, "near_tied_share": share, "tie_share": tie_share,
    "missed_rules": {t: ["flexattention"] for t in failed},
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


def test_the_map_is_the_fewest_corners_that_bound_every_miss():
  rows = [
    _row("a", 5.0),
    _row("a", 5.0, ["dq"], share=0.3, tie_share=0.3),
    _row("a", 5.0, ["dq"], share=0.9, tie_share=0.9),
    _row("a", 50.0, share=0.1, tie_share=0.1),
    _row("a", 500.0, ["dv"]),
    _row("a", 500.0, ["dq", "dv"], share=0.3, tie_share=0.3),
    _row("b", 500.0, share=0.9, tie_share=0.9),
  ]
  found = thresholds.regions(rows)
  corners = found["a"]["corners"]
  assert [(c["max_logit"], c["near_tied_share"]) for c in corners] == [
    (5.0, 0.3),
    (500.0, 0.0),
  ]
  # Ties from a logit of 5 on: every case there missed, dq (and dv at
  # 500); at 500 with no ties, dv, and the tied case above it too.
  assert corners[0]["missed_of_cases"] == [3, 3]
  assert corners[1]["missed"] == {
    "dq": ["flexattention"],
    "dv": ["flexattention"],
  }
  assert found["b"] == {"corners": [], "cases": 1, "missed": 0}
  data = {"regions": found, "thresholds": thresholds.thresholds(rows)}
  # Without ties only the 1-D threshold; with them the map.
  assert thresholds.kernels_missing_at(50.0, data) == []
  assert thresholds.kernels_missing_at(50.0, data, near_tied_share=0.5) == ["a"]
  assert thresholds.kernels_missing_at(50.0, data, near_tied_share=0.1) == []
  quoted = "| a | 5 | 0.30 | dq (flexattention); dv (flexattention) | 3 of 3 |"
  assert quoted in thresholds.regions_table(data)


def test_ties_are_made_in_about_the_share_of_rows_asked_for():
  for causal, share in ((False, 0.3), (False, 0.9), (True, 0.3)):
    case = thresholds._case(100.0, (1, 64, 2, 32), causal, share)
    measured = thresholds.case_statistics(case, "fp32")["near_tied_share"]
    assert share - 0.05 <= measured <= share + 0.1, (causal, share, measured)
  # Repeated tokens survive any rounding: the same share in BF16.
  bf16 = thresholds.case_statistics(case, "bf16-framework")["near_tied_share"]
  assert bf16 >= measured


def test_the_stored_calibration_is_its_rows_read_off_and_the_docs_quote_it():
  data = thresholds.load()
  assert data["rows"], "run python launch/monitor_thresholds.py"
  assert thresholds.thresholds(data["rows"]) == data["thresholds"]
  assert thresholds.regions(data["rows"]) == data["regions"]
  assert set(data["thresholds"]) == set(thresholds.KERNELS)
  assert sorted({r["tie_share"] for r in data["rows"]}) == list(
    thresholds.TIE_SHARES
  )
  docs = (ROOT / "docs" / "monitor.md").read_text()
  assert thresholds.table(data) in docs
  assert thresholds.regions_table(data) in docs


@pytest.mark.slow  # a model or a sweep end to end; CI's slow tier
def test_a_sweep_row_records_the_logit_and_what_missed():
  rows = thresholds.sweep(["xla fp32"], stds=(1.0,), tie_shares=(0.0, 0.9))
  assert len(rows) == len(thresholds.SHAPES) * 2 * 2  # causal and not
  assert all(r["failed"] == [] and r["errors"] == 0 for r in rows)
  assert all(0 < r["max_logit"] < 10 for r in rows)
  tied = [r["near_tied_share"] for r in rows if r["tie_share"]]
  untied = [r["near_tied_share"] for r in rows if not r["tie_share"]]
  assert min(tied) > 0.4 > max(untied)
