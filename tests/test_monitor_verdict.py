"""The monitor's verdict: heads placed on the calibrated 2-D map over
logged steps, when each entered a kernel's miss region and whether it
left, with remedies marked measured or not."""

import numpy as np
import pytest

from stableattn.auditing import monitor_verdict

# A calibration with one kernel that misses from a largest logit of 100
# without ties, and from 10 where 30% of rows tie.
DATA = {
  "command": "python launch/monitor_thresholds.py",
  "regions": {
    "kernel a": {
      "corners": [
        {
          "max_logit": 10.0,
          "near_tied_share": 0.3,
          "missed": {"dq": ["flexattention"]},
          "missed_of_cases": [3, 4],
        },
        {
          "max_logit": 100.0,
          "near_tied_share": 0.0,
          "missed": {"dv": ["flashattention"]},
          "missed_of_cases": [2, 8],
        },
      ],
      "cases": 20,
      "missed": 5,
    },
    "kernel b": {"corners": [], "cases": 20, "missed": 0},
  },
}


def _record(step, logits, ties, layer=0):
  return {
    "step": step,
    "layer": layer,
    "max_logit_per_head": logits,
    "near_tied_share_per_head": ties,
  }


def test_a_head_that_enters_and_leaves_is_named_with_its_steps():
  records = [
    _record(0, [5.0, 5.0], [0.0, 0.0]),
    _record(10, [5.0, 20.0], [0.0, 0.5]),  # head 1 ties at logit 20
    _record(20, [5.0, 20.0], [0.0, 0.1]),  # ... and its ties go
    _record(30, [150.0, 5.0], [0.0, 0.0]),  # head 0: large logits
  ]
  found = monitor_verdict.verdict(records, DATA)
  assert found["entries"] == [
    {
      "layer": 0,
      "head": 0,
      "kernels": ("kernel a",),
      "entered": 30,
      "left": None,
      "max_logit": 150.0,
      "near_tied_share": 0.0,
      "key_offset_ratio": None,  # the records have no key offsets
    },
    {
      "layer": 0,
      "head": 1,
      "kernels": ("kernel a",),
      "entered": 10,
      "left": 20,
      "max_logit": 20.0,
      "near_tied_share": 0.5,
      "key_offset_ratio": None,
    },
  ]
  assert found["kernels"] == ["kernel a"] and found["heads"] == [2, 2]
  text = "\n".join(found["lines"])
  assert "layer 0 head 1: from step 10" in text and "left at step 20" in text
  assert "still there at the last log" in text
  assert {r["evidence"] for r in found["recommendations"]} == {"not measured"}


def test_remedies_are_marked_measured_only_where_a_study_measured_them():
  records = [_record(0, [500.0], [0.0])]
  found = monitor_verdict.verdict(
    records, DATA, measured={"stable preset": "measured in this run"}
  )
  evidence = {r["remedy"]: r["evidence"] for r in found["recommendations"]}
  assert evidence["stable preset"] == "measured in this run"
  assert evidence["qk-norm"] == "not measured"


def test_a_quiet_run_has_no_entries_and_says_so():
  found = monitor_verdict.verdict([_record(0, [3.0, 4.0], [0.0, 0.2])], DATA)
  assert found["entries"] == [] and found["recommendations"] == []
  assert found["lines"][0].startswith("No head of 2 entered")


def test_records_from_metrics_rows_take_the_worst_replicate():
  rows = [
    {"kind": "attention", "run": "flash", "replicate": r, "step": 5,
     "layer": 1, "max_logit_per_head": [1.0 + r, 9.0],
     "near_tied_share_per_head": [0.5 - r / 10, 0.0]}
    for r in range(3)
  ]  # fmt: skip
  rows.append(_record(5, [99.0], [0.0], layer=1) | {"run": "base"})
  (record,) = monitor_verdict.head_records(rows, "flash")
  np.testing.assert_array_equal(record["max_logit_per_head"], [3.0, 9.0])
  np.testing.assert_array_equal(record["near_tied_share_per_head"], [0.5, 0.0])


def test_a_calibration_without_a_map_is_a_clear_error():
  with pytest.raises(ValueError, match="no 2-D map.*monitor_thresholds"):
    monitor_verdict.verdict([_record(0, [1.0], [0.0])], {"thresholds": {}})


def test_the_timeline_figure_is_drawn(tmp_path):
  records = {"flash": [_record(0, [5.0, 150.0], [0.0, 0.0])]}
  monitor_verdict.plot_timeline(records, DATA, tmp_path / "heads.png")
  assert (tmp_path / "heads.png").stat().st_size > 0


def test_a_report_section_names_the_runs_that_entered_and_draws_them(
  tmp_path,
):
  from stableattn.experiments.monitor_report import verdict_section

  records = {
    "quiet": [_record(0, [5.0], [0.0])],
    "loud": [_record(0, [5.0], [0.0]), _record(10, [500.0], [0.0])],
  }
  lines, entered = verdict_section(records, tmp_path, {}, DATA)
  text = "\n".join(lines)
  assert entered == ["loud"]
  assert "Heads of 1 of 2 runs entered" in text and "**loud.**" in text
  assert "**quiet.**" not in text
  assert (tmp_path / "monitor_heads.png").stat().st_size > 0
  assert verdict_section(records, tmp_path, {}, {"thresholds": {}}) == ([], [])
