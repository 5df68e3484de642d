"""The shared report library, on numbers small enough to check by hand."""

import math

import pytest

from stableattn.harness.reporting import (
  Interval,
  band_verdict,
  finding_lines,
  mean_interval,
  num,
  one,
  section,
  select,
  spread,
  table,
)


def test_num_formats_for_tables():
  assert num(None) == "-"
  assert num(0.0) == "0"
  assert num(1.23456) == "1.23"
  assert num(1.5e-5) == "1.50e-05"
  assert num(float("nan")) == "nan"


def test_table_escapes_pipes_inside_cells():
  text = table(["a", "|x|"], [[1, "|y - z|"]])
  assert text.splitlines() == [
    "| a | \\|x\\| |",
    "|---|---|",
    "| 1 | \\|y - z\\| |",
  ]


def test_select_and_one():
  rows = [{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 2}]
  assert select(rows, a=1) == rows[:2]
  assert one(rows, b=3) == rows[1]
  assert one(rows, a=9) is None


def test_spread_is_median_and_range():
  assert spread([3.0, 1.0, 2.0, None]) == "2 (1-3)"
  assert spread([]) == "-"


def test_mean_interval_is_student_t():
  # mean 2, sample std 1, t(0.975, 2 dof) = 4.3027: half-width 2.484.
  interval = mean_interval([1.0, 2.0, 3.0])
  assert interval.mean == pytest.approx(2.0)
  assert interval.low == pytest.approx(2 - 4.302653 / math.sqrt(3), rel=1e-6)
  assert interval.high == pytest.approx(2 + 4.302653 / math.sqrt(3), rel=1e-6)
  assert interval.count == 3


def test_geometric_interval_averages_ratios_on_a_log_scale():
  interval = mean_interval([0.5, 2.0], geometric=True)
  assert interval.mean == pytest.approx(1.0)
  assert interval.low * interval.high == pytest.approx(1.0)
  with pytest.raises(ValueError, match="positive values"):
    mean_interval([1.0, 0.0], geometric=True)
  with pytest.raises(ValueError, match="at least one value"):
    mean_interval([])


def test_one_value_has_no_interval():
  interval = mean_interval([4.0])
  assert (interval.low, interval.high) == (None, None)
  assert "no interval" in interval.text()
  assert band_verdict(interval, 2, 5) == "cannot be told apart"


def test_inverted_interval_swaps_the_ends():
  inverted = Interval(0.25, 0.2, 0.5, 3).inverted()
  assert inverted == Interval(4.0, 2.0, 5.0, 3)


@pytest.mark.parametrize(
  "low, high, verdict",
  [
    (2.5, 4.0, "holds"),
    (0.5, 1.5, "fails"),
    (6.0, 9.0, "fails"),
    (1.5, 3.0, "cannot be told apart"),
    (4.0, 7.0, "cannot be told apart"),
    (1.0, 9.0, "cannot be told apart"),
  ],
)
def test_band_verdict(low, high, verdict):
  interval = Interval((low + high) / 2, low, high, 3)
  assert band_verdict(interval, 2.0, 5.0) == verdict


def test_section_and_findings_are_separate_paragraphs():
  text = section("Title", "what ran", "body", ["one", "two"], ["fig.png"])
  assert text.startswith("## Title\n\n*What ran:* what ran\n\nbody\n")
  assert "**Finding.** one\n\n**Finding.** two" in text
  assert text.rstrip().endswith("![fig](fig.png)")
  assert finding_lines([]) == []
