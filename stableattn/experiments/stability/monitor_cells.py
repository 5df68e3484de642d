"""The stability sweep's cells on the monitor's calibrated 2-D map: per
arm and learning rate, which heads entered a region where a kernel misses
a rule (`stableattn.auditing.monitor_verdict`)."""

from __future__ import annotations

from stableattn.auditing import monitor_verdict, thresholds
from stableattn.experiments.monitor_report import verdict_section
from stableattn.experiments.stability.settings import Settings


def verdict_lines(s: Settings, rows, out_dir, result) -> list[str]:
  """The monitor's verdict per cell (arm and learning rate, worst over
  replicates); remedies a mitigation arm of this sweep trained with are
  marked measured here."""
  cells: dict = {}
  kernels: dict = {}  # each cell's own attention, in the calibration's names
  by_name = {arm.name: arm for arm in s.arms}
  for r in rows:
    if r.get("kind") == "log" and "max_logit_per_head" in r:
      cell = f"{r['arm']} lr {r['lr']:g}"
      cells.setdefault(cell, []).extend(
        monitor_verdict.records_of_layers(
          r["step"], r["max_logit_per_head"], r["near_tied_share_per_head"]
        )
      )
      if r["arm"] in by_name:
        attention = s.runs[by_name[r["arm"]]][1].attention
        kernels[cell] = thresholds.calibration_name(attention)
  mitigations = {a.mitigation for a in s.arms}
  measured = {
    remedy: f"measured in this sweep: the {arm} arms"
    for remedy, arm in (("qk-norm", "qk_norm"), ("softcap", "softcap"))
    if arm in mitigations
  }
  lines, entered = verdict_section(cells, out_dir, measured, kernels=kernels)
  result["monitor_cells_entered"] = entered
  return lines
