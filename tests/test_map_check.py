"""The 2-D map's predictions against audits on captured tensors."""

import json
import pathlib
import subprocess
import sys

import pytest

from stableattn.auditing import map_check

REPO = pathlib.Path(__file__).resolve().parent.parent

DATA = {
  "regions": {
    "pallas bf16-fa2": {
      "corners": [
        {"max_logit": 10.0, "near_tied_share": 0.3, "missed": {},
         "missed_of_cases": [1, 1]},
      ],
      "cases": 4,
      "missed": 1,
    }
  }
}  # fmt: skip


def test_each_layer_lands_in_one_cell_of_the_confusion_table():
  points = {
    "a": {"max_logit": 500.0, "near_tied_share": 0.9},  # in, missed: hit
    "b": {"max_logit": 500.0, "near_tied_share": 0.5},  # in, passed
    "c": {"max_logit": 5.0, "near_tied_share": 0.9},  # out, missed
    "d": {"max_logit": 900.0, "near_tied_share": 0.0},  # out, passed
  }
  misses = {"pallas bf16-fa2": {"a": True, "b": False, "c": True, "d": False}}
  found = map_check.confusion({"bfloat16": points}, misses, DATA)
  found = found["pallas bf16-fa2"]
  assert (
    found["hit"],
    found["false_alarm"],
    found["missed"],
    found["quiet"],
  ) == (
    1,
    1,
    1,
    1,
  )
  assert found["false_alarm_rate"] == 0.5
  assert map_check.input_format("pallas fp32") == "float32"
  assert (
    found["layers"]["b"]["predicted"] and not found["layers"]["b"]["measured"]
  )
  table = map_check.confusion_table({"pallas bf16-fa2": found})
  assert "| pallas bf16-fa2 | 1 | 1 | 1 | 1 | 0.50 |" in table


@pytest.mark.slow  # a sweep, an audit and the check end to end
def test_captures_on_the_map_are_audited_and_tabled(tmp_path):
  """A smoke stability sweep captures at its first logging step and where
  the heads move on the map, in every replicate; an audit of those
  tensors and the map's predictions make one confusion table."""
  runs = {
    "stability": [
      "--config=smoke",
      "--config.variants=flash",
      "--config.mitigations=none",
      "--config.train.machine_pair=False",
      "--config.train.replicates=2",
      "--config.train.capture_map=2",
    ],
    "audit": [
      "--config.kernel=xla",
      "--config.precisions=bf16-framework",
      "--config.shapes=((1,16,2,16),)",
      "--config.features=causal",
      "--config.seeds=1",
      "--config.repeats=2",
      f"--config.inputs={tmp_path / 'stability' / 'captures'}",
    ],
  }
  for name, args in runs.items():
    subprocess.run(
      [sys.executable, str(REPO / "launch" / f"{name}.py"),
       f"--workdir={tmp_path / name}", *args],
      check=True, cwd=REPO, timeout=600,
    )  # fmt: skip
  report = (tmp_path / "stability" / "report.md").read_text()
  assert "## The monitor's verdict, per head" in report
  cells = sorted(
    p.name for p in (tmp_path / "stability" / "captures").iterdir()
  )
  assert {c.rsplit("-", 1)[1] for c in cells} == {"r0", "r1"}
  out = tmp_path / "map.json"
  printed = subprocess.run(
    [sys.executable, str(REPO / "launch" / "monitor_map_check.py"),
     f"--captures={tmp_path / 'stability' / 'captures'}",
     f"--audits={tmp_path / 'audit'}", f"--out={out}"],
    check=True, cwd=REPO, timeout=600, capture_output=True, text=True,
  ).stdout  # fmt: skip
  found = json.loads(out.read_text())["drawn map"]["xla bf16"]
  layers = sum(found[k] for k in ("hit", "false_alarm", "missed", "quiet"))
  assert layers == len(found["layers"]) > 0
  assert "| xla bf16 |" in printed


def test_the_docs_quote_the_stored_map_check_as_its_rows_give_it():
  """The confusion table is recomputed from the stored audits' rows, the
  stored layer points and the calibration regions the check used."""
  from helpers import results_page, stored_run

  root = stored_run("map-check-2026-11-27")
  stored = json.loads((root / "map_check.json").read_text())
  regions = json.loads((root / "calibration_regions.json").read_text())
  points: dict = {}
  for kernel, found in stored.items():
    fmt = map_check.input_format(kernel)
    for label, layer in found["layers"].items():
      points.setdefault(fmt, {})[label] = {
        k: layer[k] for k in ("max_logit", "near_tied_share")
      }
  misses = {}
  for audit in sorted(root.glob("audit_*")):
    misses.update(map_check.audit_misses(audit))
  again = map_check.confusion(points, misses, regions)
  assert again == stored
  docs = results_page(folded=False)
  assert map_check.confusion_table(again) in docs
  held = map_check.held_out_tie_threshold(again["pallas bf16-fa2"]["layers"])
  total = held["total"]
  assert (total["hit"], total["false_alarm"]) == (42, 2)
  assert (
    f"finds {total['hit']} of the {total['hit'] + total['missed']} misses "
    f"with {total['false_alarm']} false alarms in "
    f"{total['false_alarm'] + total['quiet']} passes"
  ) in results_page(folded=True)
