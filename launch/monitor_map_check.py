r"""Does the monitor's calibration predict where kernels miss on a model's
own tensors? Places every captured layer on the drawn 2-D map and on the
captured calibration (key offset, near-tie share) and sets each
prediction beside the kernel's audit on the same tensors.

  python launch/monitor_map_check.py --captures=runs/study_stab/captures \
      --audits=runs/study_audit_pallas,runs/study_audit_jax_mha

Prints the confusion table per kernel for each calibration (docs/results.md
quotes them) and, with --out, writes every layer's point, prediction and
outcome as JSON. With --fit, the captured calibration is fitted on these
layers instead (each kernel's key-offset and near-tie thresholds with the
fewest errors) and written into the monitor's data
(stableattn/auditing/monitor_thresholds.json), which the verdict reads;
judge it on other captures without --fit.
"""

import json
import pathlib

from absl import app, flags

from stableattn.auditing import map_check, thresholds

flags.DEFINE_list("captures", None, "Captured tensors (runs' captures/).")
flags.DEFINE_list("audits", None, "Audit run directories on those captures.")
flags.DEFINE_string("out", "", "Where the JSON goes; none if empty.")
flags.DEFINE_bool("fit", False, "Fit the captured calibration and store it.")


def main(argv):
  del argv
  f = flags.FLAGS
  missing = [
    str(p)
    for p in map(pathlib.Path, [*f.captures, *f.audits])
    if not p.exists()
  ]
  if missing:
    print(f"error: not found: {missing}")
    return 2
  data = thresholds.load()
  if not data.get("regions"):
    print("error: the calibration has no 2-D map; run "
          "python launch/monitor_thresholds.py")  # fmt: skip
    return 2
  points = {}
  for path in f.captures:
    for fmt, found in map_check.layer_points(path).items():
      points.setdefault(fmt, {}).update(found)
  misses = {}
  for audit in f.audits:
    for name, layers in map_check.audit_misses(audit).items():
      misses.setdefault(name, {}).update(layers)
  if f.fit:
    fitted = map_check.fit_captured(points, misses)
    map_check.write_captured(fitted, f.captures, f.audits)
    data = thresholds.load()
    print(json.dumps(fitted, indent=2))
  found = {"drawn map": map_check.confusion(points, misses, data)}
  calibration = map_check.captured_entries(data)
  if calibration:
    found["captured calibration"] = map_check.captured_confusion(
      points, misses, calibration
    )
  for name, confusion in found.items():
    print(f"{name}:\n{map_check.confusion_table(confusion)}\n")
  if f.out:
    pathlib.Path(f.out).write_text(json.dumps(found, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  flags.mark_flags_as_required(["captures", "audits"])
  app.run(main)
