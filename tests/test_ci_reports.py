"""The audit in a kernel project's CI: JUnit XML, a GitHub step summary,
and known findings as a baseline."""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from stableattn.auditing import ci_reports

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent


def _row(tensor="dq", passed=True, value=1.0, limit=2.0, **more):
  return {
    "kernel": "k", "policy": "bf16-framework", "regime": "none",
    "features": "causal", "shape": "B1 T64", "tensor": tensor,
    "flashattention_applies": True, "flashattention_passed": passed,
    "flashattention_value": value, "flashattention_limit": limit,
    "nonfinite": 0, "deterministic": True, **more,
  }  # fmt: skip


def test_failures_are_keyed_stably_with_their_worst_ratio():
  rows = [_row(), _row(passed=False, value=6.0), _row(passed=False, value=8.0)]
  found = ci_reports.failing(rows, ["flashattention"])
  assert found == {
    "k | bf16-framework | none | causal | flashattention | dq": 4.0
  }
  nan = ci_reports.failing([_row("out", nonfinite=3)], ["flashattention"])
  assert nan == {"k | bf16-framework | none | causal | finite | out": None}


def test_a_baseline_passes_known_findings_and_names_new_worse_and_fixed():
  baseline = {"a": 4.0, "b": 10.0, "c": 2.0, "d": None}
  judged = ci_reports.judge(
    {"a": 4.9, "b": 13.0, "d": None, "e": 1.5}, baseline
  )
  assert judged == {
    "new": ["e"], "worse": ["b"], "fixed": ["c"], "known": ["a", "d"]
  }  # fmt: skip


def test_junit_has_one_testcase_per_row_and_rule_and_a_reader_parses_it():
  rows = [_row(), _row("dk", passed=False, value=9.0)]
  notes = [
    {"policy": "fp32", "regime": "head_dims", "detail": "MLA", "reason": "x"}
  ]
  errors = [
    {"policy": "fp32", "shape": "B1", "features": "none", "error": "boom"}
  ]
  root = ET.fromstring(
    ci_reports.junit_xml("k", rows, ["flashattention"], errors, notes)
  )
  cases = root.findall("testcase")
  # Per row: the gated rule, the NaN scan and determinism; plus the error
  # and the n/a case.
  assert len(cases) == 2 * 3 + 2
  assert root.attrib["failures"] == "1" and root.attrib["errors"] == "1"
  assert root.attrib["skipped"] == "1"
  failed = [c for c in cases if c.find("failure") is not None]
  assert "dk flashattention" in failed[0].attrib["name"]
  ratio = failed[0].find("properties/property[@name='ratio']").attrib["value"]
  assert float(ratio) == 4.5


def _audit(tmp_path, name, kernel, *flags, env=None):
  return subprocess.run(
    [
      sys.executable, str(REPO / "launch" / "audit.py"),
      f"--workdir={tmp_path / name}",
      "--config=smoke",
      f"--config.kernel=audit_kernels:{kernel}", "--config.precisions=fp32",
      *flags,
    ],
    capture_output=True, text=True, cwd=REPO, timeout=300,
    env={**os.environ, "PYTHONPATH": str(REPO / "tests"), **(env or {})},
  )  # fmt: skip


@pytest.mark.slow
def test_a_recorded_finding_passes_and_a_new_or_worse_one_fails(tmp_path):
  baseline = tmp_path / "baseline.json"
  recorded = _audit(
    tmp_path, "a", "wrong_scale", f"--config.baseline={baseline}",
    "--config.update_baseline=True",
  )  # fmt: skip
  assert recorded.returncode == 0, recorded.stdout[-1500:]
  summary = tmp_path / "summary.md"
  again = _audit(
    tmp_path, "b", "wrong_scale", f"--config.baseline={baseline}",
    f"--config.junit={tmp_path / 'junit.xml'}",
    env={"GITHUB_STEP_SUMMARY": str(summary)},
  )  # fmt: skip
  assert again.returncode == 0, again.stdout[-1500:]
  assert "0 new, 0 worse, 0 fixed, 8 known" in again.stdout
  assert "passed" in summary.read_text()
  assert ET.parse(tmp_path / "junit.xml").getroot().attrib["failures"] == "8"
  # One finding forgotten (new) and one recorded as milder (worse).
  data = json.loads(baseline.read_text())
  keys = sorted(data["failures"])
  del data["failures"][keys[0]]
  data["failures"][keys[1]] /= 10
  baseline.write_text(json.dumps(data))
  worse = _audit(
    tmp_path, "c", "wrong_scale", f"--config.baseline={baseline}",
    env={"GITHUB_STEP_SUMMARY": str(summary)},
  )  # fmt: skip
  assert worse.returncode == 1
  assert (
    f"new: {keys[0]}" in worse.stdout and f"worse: {keys[1]}" in worse.stdout
  )
  assert f"::error title=stableattn audit::{keys[0]}" in worse.stdout


def test_compare_names_regressions_across_versions_whatever_the_kernel_name():
  old = ci_reports.ratios(
    [_row("dq", value=1.0), _row("dk", value=6.0), _row("dv", value=1.0)],
    ["flashattention"],
    with_kernel=False,
  )
  new = ci_reports.ratios(
    [
      _row("dq", value=3.0, kernel="k2"),  # 0.5 -> 1.5: crosses its limit
      _row("dk", value=6.6, kernel="k2"),  # 3.0 -> 3.3: within the margin
      _row("out", value=1.0, kernel="k2"),
    ],
    ["flashattention"],
    with_kernel=False,
  )
  found = ci_reports.compare(old, new)
  assert [k.split(" | ")[-1] for k, _, _ in found["regressions"]] == ["dq"]
  assert found["improvements"] == []
  assert [k.split(" | ")[-1] for k in found["only_old"]] == ["dv"]
  assert [k.split(" | ")[-1] for k in found["only_new"]] == ["out"]


def test_the_compare_launcher_exits_1_on_a_regression(tmp_path):
  for name, value in (("old", 1.0), ("new", 5.0)):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "headline.json").write_text(
      json.dumps({"gate": ["flashattention"]})
    )
    (folder / "metrics.jsonl").write_text(json.dumps(_row(value=value)) + "\n")
  done = subprocess.run(
    [
      sys.executable, "-m", "stableattn", "compare",
      str(tmp_path / "old"), str(tmp_path / "new"),
    ],
    capture_output=True, text=True, cwd=REPO, timeout=120,
  )  # fmt: skip
  assert done.returncode == 1, done.stdout + done.stderr
  assert "regressions: 1" in done.stdout and "0.5 -> 2.5" in done.stdout


def test_gated_invariance_probes_are_failures_and_testcases():
  probes = [
    {"kernel": "k", "policy": "fp32", "invariance": "batch", "detail": "4 rows",
     "invariant": False, "diff_ulps": 3.0},
    {"kernel": "k", "policy": "fp32", "invariance": "decode", "detail": "q=1",
     "invariant": True, "diff_ulps": 0.0},
    {"kernel": "k", "policy": "fp32", "invariance": "splits", "detail": "2",
     "invariant": None, "error": "ValueError: no splits"},
  ]  # fmt: skip
  gate = ["flashattention", "invariance"]
  found = ci_reports.failing([_row()], gate, probes=probes)
  assert found == {
    "k | fp32 | invariance | 4 rows | batch | out": None,
    "k | fp32 | invariance | 2 | splits | out": None,
  }
  assert ci_reports.failing([_row()], ["flashattention"], probes=probes) == {}
  root = ET.fromstring(ci_reports.junit_xml("k", [_row()], gate, probes=probes))
  assert root.attrib["tests"] == str(3 + 3)  # the row's three checks
  assert root.attrib["failures"] == "2"
  (batch,) = [
    c for c in root.iter("testcase") if c.attrib["name"] == "batch 4 rows"
  ]
  assert "3 ulps" in batch.find("failure").attrib["message"]
