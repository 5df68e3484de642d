r"""`stableattn compare OLD NEW`: two audits' run directories key by key
(format | regime | features | rule | tensor, whatever the kernels are
named): another kernel version, commit or jax version.

  stableattn compare runs/audit_v1 runs/audit_v2 [--fail_on=regressions]

Prints each key whose ratio to its rule's limit regressed or improved,
and exits 1 when a `--fail_on` condition holds (2 on a folder that holds
no audit):
  regressions  a ratio crossed its limit, or grew more than --growth
               times past it (the default);
  growth       a ratio grew more than --growth times, under its limit too;
  missing      a key the old audit judged is absent from the new one.
"""

from __future__ import annotations

import json
import pathlib
import sys

from stableattn.auditing import ci_reports
from stableattn.harness.rundir import RunDir

FAIL_ON = ("regressions", "growth", "missing")


def audit_ratios(folder: str) -> dict[str, float]:
  """The worst ratio per key of the audit in run directory `folder`."""
  path = pathlib.Path(folder)
  if not (path / "metrics.jsonl").exists():
    raise ValueError(f"{folder} holds no audit (metrics.jsonl missing).")
  gate = json.loads((path / "headline.json").read_text())["gate"]
  kept = [r for r in RunDir(path).read_metrics() if "policy" in r]
  return ci_reports.ratios(kept, gate, with_kernel=False)


def report(found: dict) -> list[str]:
  lines = []
  for name in ("regressions", "growth", "improvements"):
    lines.append(f"{name}: {len(found[name])}")
    for k, a, b in found[name]:
      lines.append(f"  {k}: {a:.3g} -> {b:.3g} of its limit")
  for name in ("only_old", "only_new"):
    if found[name]:
      lines.append(f"{name}: {len(found[name])} keys")
      lines += [f"  {k}" for k in found[name][:10]]
  return lines


def main(argv: list[str]) -> int:
  """Flags: OLD NEW (run directories), --growth, --fail_on (comma list)."""
  from absl import app, flags

  flags.DEFINE_float("growth", ci_reports.WORSE_MARGIN, "Growth that fails.")
  flags.DEFINE_list(
    "fail_on", ["regressions"], f"Exit 1 on any of {', '.join(FAIL_ON)}."
  )
  codes = []
  sys.modules["__main__"].__doc__ = __doc__  # what --help prints
  for name in ("growth", "fail_on"):
    flags.FLAGS.register_flag_by_module(argv[0], flags.FLAGS[name])

  def run(args):
    codes.append(compare_folders(args[1:], flags.FLAGS))
    return codes[-1]

  app.run(run, argv=argv)
  return codes[-1]  # not reached: app.run exits with run's code


def compare_folders(folders: list[str], settings) -> int:
  if len(folders) != 2:
    print("error: compare takes two audit run directories, OLD and NEW")
    return 2
  unknown = set(settings.fail_on) - set(FAIL_ON)
  if unknown:
    print(f"error: unknown --fail_on {sorted(unknown)}; valid: {FAIL_ON}")
    return 2
  try:
    old, new = (audit_ratios(f) for f in folders)
  except (ValueError, KeyError) as e:
    print(f"error: {e}")
    return 2
  found = ci_reports.compare(old, new, settings.growth)
  print("\n".join(report(found)))
  failing = {
    "regressions": found["regressions"],
    "growth": found["growth"],
    "missing": found["only_old"],
  }
  hit = [name for name in settings.fail_on if failing[name]]
  if hit:
    print(f"failed on: {', '.join(hit)}")
  return 1 if hit else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
