r"""Does the monitor's calibrated 2-D map predict where kernels miss on a
model's own tensors? Places every captured layer on the map and sets the
prediction beside each kernel's audit on the same tensors.

  python launch/monitor_map_check.py --captures=runs/study_stab/captures \
      --audits=runs/study_audit_pallas,runs/study_audit_jax_mha

Prints the confusion table per kernel (docs/results.md quotes it) and,
with --out, writes every layer's point, prediction and outcome as JSON.
"""

import json
import pathlib

from absl import app, flags

from stableattn.auditing import map_check, thresholds

flags.DEFINE_string("captures", None, "Captured tensors (a run's captures/).")
flags.DEFINE_list("audits", None, "Audit run directories on those captures.")
flags.DEFINE_string("out", "", "Where the JSON goes; none if empty.")


def main(argv):
  del argv
  f = flags.FLAGS
  missing = [
    str(p)
    for p in [pathlib.Path(f.captures), *map(pathlib.Path, f.audits)]
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
  points = map_check.layer_points(f.captures)
  misses = {}
  for audit in f.audits:
    misses.update(map_check.audit_misses(audit))
  found = map_check.confusion(points, misses, data)
  print(map_check.confusion_table(found))
  if f.out:
    pathlib.Path(f.out).write_text(json.dumps(found, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  flags.mark_flags_as_required(["captures", "audits"])
  app.run(main)
