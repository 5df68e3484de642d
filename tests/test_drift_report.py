"""The drift report's sections on synthetic rows with known answers."""

import gzip
import json
import math

import pytest
from helpers import results_page, stored_headline, stored_run

from stableattn.experiments.training_drift import analysis, ratio_report, report
from stableattn.experiments.training_drift.analysis import ratio_summary
from stableattn.experiments.training_drift.ratio_report import runs_table
from stableattn.training import compute_format

STEPS = (0, 10, 20)


def _drift(pair, replicate, step, wasserstein, max_abs=None):
  return {
    "kind": "drift",
    "pair": pair,
    "scope": "model",
    "replicate": replicate,
    "step": step,
    "wasserstein": wasserstein,
    "max_abs": wasserstein * 100 if max_abs is None else max_abs,
    "rel_l2": wasserstein / 10,
  }


def _rows(subject_over_reference, reference="bf16_vs_fp32", replicates=3):
  """Subject drift = ratio x the reference's, at every step after 0;
  replicate r's ratio is scaled by (1 + 0.1 r) so intervals have width."""
  rows = []
  for r in range(replicates):
    for step in STEPS:
      ref = 1e-4 * (step + 1) * (1 + r)
      sub = ref * subject_over_reference * (1 + 0.1 * r) if step else 0.0
      rows += [
        _drift(reference, r, step, ref),
        _drift("flash_vs_baseline", r, step, sub),
        _drift("identical_rerun", r, step, 0.0),
      ]
  return rows


def test_every_subject_is_divided_by_every_reference_with_verdicts():
  rows = _rows(0.25)  # 4x below: inside the paper's 2-5x band
  pairs = ("flash_vs_baseline", "bf16_vs_fp32", "identical_rerun")
  headline = {}
  lines, findings = ratio_report.ratio_section(rows, pairs, headline)
  summary = ratio_summary(rows, "flash_vs_baseline", "bf16_vs_fp32")
  geo = math.exp(sum(math.log(0.25 * (1 + 0.1 * r)) for r in range(3)) / 3)
  assert summary.over_replicates.mean == pytest.approx(geo)
  assert headline["paper_verdicts"] == {
    "flash_vs_baseline": {"bf16_vs_fp32": "holds"}
  }
  ratios = headline["ratios"]["flash_vs_baseline"]["bf16_vs_fp32"]
  assert set(ratios) == {
    "wasserstein",
    "max_abs",
    "wasserstein_slope",
    "max_abs_slope",
  }
  table = "\n".join(lines)
  assert "| flash_vs_baseline | bf16_vs_fp32 | wasserstein |" in table
  assert "2-5x below | holds |" in table
  (finding,) = findings
  assert "`flash_vs_baseline` against `bf16_vs_fp32`" in finding


def test_a_subject_drifting_as_far_as_the_reference_fails_the_band():
  headline = {}
  ratio_report.ratio_section(
    _rows(1.0), ("flash_vs_baseline", "bf16_vs_fp32"), headline
  )
  assert headline["paper_verdicts"]["flash_vs_baseline"] == {
    "bf16_vs_fp32": "fails"
  }


def test_no_subject_or_no_reference_gives_no_ratio_section():
  headline = {}
  lines, findings = ratio_report.ratio_section(
    _rows(0.25), ("bf16_vs_fp32", "identical_rerun"), headline
  )
  assert lines == [] and findings == []


def test_control_must_be_zero_at_every_logged_step():
  rows = _rows(0.25)
  headline = {}
  text = report.control_finding(rows, "identical_rerun", list(STEPS), headline)
  assert "exactly 0" in text and headline["identical_rerun_max_abs"] == 0
  rows.append(
    {
      **_drift("identical_rerun", 1, 20, 1e-6, max_abs=3e-3),
      "scope": "tensor",
      "name": "blocks.0.mlp_in.kernel",
    }
  )
  rows.append(_drift("identical_rerun", 2, 20, 1e-6, max_abs=3e-3))
  rows.remove(_drift("identical_rerun", 2, 20, 0.0))
  text = report.control_finding(rows, "identical_rerun", list(STEPS), headline)
  assert "NOT 0" in text and "blocks.0.mlp_in.kernel" in text
  with pytest.raises(ValueError, match="no verdict on the control"):
    report.control_finding(rows, "identical_rerun", [*STEPS, 30], headline)


def test_growth_slope_of_a_linear_drift_is_one():
  rows = [
    _drift("bf16_vs_fp32", 0, step, 1e-5 * step) for step in (0, 10, 20, 40)
  ]
  headline = {}
  (finding,) = report.growth_findings(rows, ("bf16_vs_fp32",), headline)
  assert headline["growth_slopes"]["bf16_vs_fp32"] == pytest.approx(1.0)
  assert "bf16_vs_fp32 1.00" in finding


def test_final_drift_table_reports_the_median_over_replicates():
  rows = _rows(0.25)
  summary = report.summary_rows(rows, ("bf16_vs_fp32",), list(STEPS))
  assert len(summary) == 3 * len(STEPS)
  lines = report.final_drift_section(summary, ("bf16_vs_fp32",), 20)
  # Wasserstein at step 20: 2.1e-3 x (1, 2, 3): median 4.2e-3.
  text = "\n".join(lines).splitlines()
  row = next(line for line in text if line.startswith("| bf16_vs_fp32"))
  assert "4.20e-03 (2.10e-03-6.30e-03)" in row


def test_fix_finding_says_whether_the_fix_changed_anything():
  rows = [_drift("flash_fix_vs_flash", 0, s, 0.0) for s in STEPS]
  headline = {}
  assert "never changed a computation" in report.fix_finding(rows, headline)
  rows = _rows(0.25) + [
    _drift("flash_fix_vs_flash", r, s, 5e-5 * s)
    for r in range(3)
    for s in STEPS
  ]
  text = report.fix_finding(rows, headline)
  assert "the fix changed what was computed" in text
  assert "over the flash_vs_baseline pair's" in text


def test_grad_error_section_calls_aligned_low_rank_errors_so():
  rows = [
    {
      "kind": "grad_error",
      "run": "flash",
      "step": step,
      "weight": "layer0.query",
      "shape": [16, 16],
      "rel_error": 0.01,
      "cos_previous": None if step == 0 else 0.9,
      "top_singular_share": 0.95,
    }
    for step in STEPS
  ]
  headline = {}
  lines = report.grad_error_section(rows, headline)
  text = "\n".join(lines)
  assert "point the same way" in text and "(low-rank)" in text
  assert headline["grad_error_cosine_flash"] == pytest.approx(0.9)
  assert report.grad_error_section([], {}) == []


def test_a_reference_identical_in_some_replicates_gives_no_ratio():
  """A reference whose runs compute the same bits in 2 of 3 replicates
  makes the ratio unbounded there: the report says so and gives no ratio
  or verdict from the one replicate left."""
  rows = _rows(0.25, reference="other_machine")
  for row in rows:
    if row["pair"] == "other_machine" and row["replicate"] in (0, 2):
      row["wasserstein"] = row["max_abs"] = 0.0
  pairs = ("flash_vs_baseline", "other_machine", "identical_rerun")
  headline = {}
  lines, findings = ratio_report.ratio_section(rows, pairs, headline)
  summary = ratio_summary(rows, "flash_vs_baseline", "other_machine")
  assert not summary.bounded and summary.over_replicates is None
  assert (summary.unbounded_replicates, summary.replicates) == (2, 3)
  ratios = headline["ratios"]["flash_vs_baseline"]["other_machine"]
  assert ratios["wasserstein"] == {"unbounded_replicates": 2, "replicates": 3}
  assert headline["paper_verdicts"] == {}
  table = "\n".join(lines)
  assert "unbounded: identical in 2 of 3 replicates" in table
  (finding,) = findings
  assert "identical (drift exactly 0 at every logged step) in 2 of 3" in finding
  # With the reference drifting in every replicate the ratio is back.
  assert ratio_summary(_rows(0.25), "flash_vs_baseline", "bf16_vs_fp32").bounded


def test_growth_rates_are_fitted_slopes_and_their_ratio_has_an_interval():
  rows = []
  for r, (sub, ref) in enumerate([(1.0, 4.0), (2.0, 4.0), (-1.0, 2.0)]):
    for step in STEPS:
      rows += [
        _drift("flash_vs_baseline", r, step, sub * step),
        _drift("bf16_vs_fp32", r, step, ref * step + 7.0),
      ]
  assert analysis.growth_rate(rows, "bf16_vs_fp32", replicate=0) == (
    pytest.approx(4.0)
  )
  slope, left_out = analysis.slope_ratio_summary(
    rows, "flash_vs_baseline", "bf16_vs_fp32"
  )
  # Replicate 2's subject shrinks: no ratio of growth rates, and said so.
  assert left_out == 1 and slope.count == 2
  assert slope.mean == pytest.approx(math.sqrt(0.25 * 0.5))
  headline = {}
  lines, _ = ratio_report.ratio_section(
    rows, ("flash_vs_baseline", "bf16_vs_fp32"), headline
  )
  got = headline["ratios"]["flash_vs_baseline"]["bf16_vs_fp32"]
  assert got["wasserstein_slope"]["replicates_left_out"] == 1
  assert "1 left out" in "\n".join(lines)


def test_the_docs_quote_the_stored_drift_runs_as_their_rows_give_them():
  runs = {
    convention: stored_headline(f"training-drift-{convention}-2026-11-27")
    for convention in ("activations", "autocast")
  }
  docs = results_page(folded=False)
  for metric in ("wasserstein", "max_abs"):
    assert runs_table(runs, metric=metric) in docs, metric


def test_the_docs_quote_the_stable_pairs_of_the_stored_runs():
  docs = results_page(folded=True)
  for convention in ("activations", "autocast"):
    stored = stored_run(f"training-drift-{convention}-2026-11-27")
    with gzip.open(stored / "metrics.jsonl.gz", "rt") as lines:
      rows = [json.loads(line) for line in lines]
    for pair in ("stable_vs_baseline", "stable_vs_flash"):
      summary = ratio_summary(rows, pair, "flash_vs_baseline")
      text = summary.over_replicates.text("x").removesuffix(" (n=5)")
      assert text in docs, (convention, pair, text)


def test_the_docs_quote_the_stored_ring_run_as_its_rows_give_it():
  quoted = runs_table(
    {"ring, 2 devices": stored_headline("drift-context-parallel-2026-11-27")},
    subject="context_parallel_vs_single",
  )
  assert quoted in results_page(folded=False)


def test_the_docs_quote_the_stored_ablation_as_its_rows_give_it():
  headline = stored_headline("training-drift-ablation-2026-11-27")
  assert ratio_report.ablation_table(headline) in results_page(folded=False)
  # Every class kept in FP32 is the FP32 run itself: the control held.
  assert headline["bf16_all_in_fp32_vs_fp32_max_abs"] == 0.0
  alone = [
    headline["ratios"][f"bf16_only_{c}_vs_fp32"]["bf16_vs_fp32"]["wasserstein"]
    for c in compute_format.FP32_CLASSES
  ]
  total = sum(r["over_replicates"]["mean"] for r in alone)
  assert f"add up to {total:.1f}x the whole" in results_page(folded=True)
