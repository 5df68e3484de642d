r"""Compares two audits' run directories key by key (format | regime |
features | rule | tensor, whatever the kernels are named): another kernel
version, commit or jax version. Exits 1 when a ratio crossed its limit or
grew more than `--growth` times past it.

  python launch/audit_compare.py --old=runs/audit_v1 --new=runs/audit_v2
"""

import json
import pathlib

from absl import app, flags

from stableattn.auditing import ci_reports

flags.DEFINE_string("old", None, "The earlier audit's run directory.")
flags.DEFINE_string("new", None, "The later audit's run directory.")
flags.DEFINE_float("growth", ci_reports.WORSE_MARGIN, "Growth that fails.")
flags.mark_flags_as_required(["old", "new"])


def _ratios(folder: str) -> dict:
  path = pathlib.Path(folder)
  if not (path / "metrics.jsonl").exists():
    raise ValueError(f"{folder} holds no audit (metrics.jsonl missing).")
  gate = json.loads((path / "headline.json").read_text())["gate"]
  rows = [json.loads(x) for x in (path / "metrics.jsonl").open() if x.strip()]
  kept = [r for r in rows if "policy" in r]
  return ci_reports.ratios(kept, gate, with_kernel=False)


def main(argv):
  del argv
  try:
    old, new = _ratios(flags.FLAGS.old), _ratios(flags.FLAGS.new)
  except (ValueError, KeyError) as e:
    print(f"error: {e}")
    return 2
  found = ci_reports.compare(old, new, flags.FLAGS.growth)
  for name in ("regressions", "improvements"):
    print(f"{name}: {len(found[name])}")
    for k, a, b in found[name]:
      print(f"  {k}: {a:.3g} -> {b:.3g} of its limit")
  for name in ("only_old", "only_new"):
    if found[name]:
      print(f"{name}: {len(found[name])} keys")
  return 1 if found["regressions"] else 0


if __name__ == "__main__":
  app.run(main)
