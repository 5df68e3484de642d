r"""The Hopper path (implementation="mosaic_gpu") against the Triton path,
both in interpret mode on a CPU, and both against FP64, case by case.

  python launch/hopper_check.py --out=results/cpu/hopper-interpret-2026-11-28
  python launch/hopper_check.py --regimes \
      --out=results/cpu/hopper-regimes-2026-11-29

Writes rows.jsonl (one row per case, as it finishes) and table.md, the
table docs/performance.md quotes; with --regimes, the stable presets'
audit at every edge regime on both paths (docs/audit.md quotes it).
"""

import json
import pathlib

import jax
from absl import app, flags

from stableattn.experiments import hopper_check

flags.DEFINE_string("out", None, "Where rows.jsonl and table.md go.")
flags.DEFINE_list("cases", None, "Case names; default every one.")
flags.DEFINE_bool("regimes", False, "The stable presets at every regime.")
flags.mark_flag_as_required("out")


def main(argv):
  del argv
  jax.config.update("jax_enable_x64", True)  # the FP64 golden
  f = flags.FLAGS
  names = f.cases or list(hopper_check.CASES)
  unknown = sorted(set(names) - set(hopper_check.CASES))
  if unknown:
    print(f"error: unknown cases {unknown}; valid: {list(hopper_check.CASES)}")
    return 2
  out = pathlib.Path(f.out)
  out.mkdir(parents=True, exist_ok=True)
  if f.regimes:
    return _regimes(out)
  rows = []
  with (out / "rows.jsonl").open("w") as sink:
    for name in names:
      rows.append(hopper_check.case_row(name))
      sink.write(json.dumps(rows[-1], sort_keys=True) + "\n")
      sink.flush()
      print(name, f"{rows[-1]['hopper_seconds']:.1f} s")
  (out / "table.md").write_text(hopper_check.table(rows) + "\n")
  print(hopper_check.table(rows))
  return 0


def _regimes(out: pathlib.Path) -> int:
  from stableattn.auditing.regimes import REGIMES

  rows = []
  with (out / "rows.jsonl").open("w") as sink:
    for policy, audited in hopper_check.STABLE_AUDITS:
      for regime in REGIMES:
        found = hopper_check.regime_rows(policy, audited, regime)
        rows += found
        for row in found:
          sink.write(json.dumps(row, sort_keys=True) + "\n")
        sink.flush()
        print(policy, regime, [len(r["failures"]) for r in found])
  (out / "table.md").write_text(hopper_check.regime_table(rows) + "\n")
  print(hopper_check.regime_table(rows))
  return 0


if __name__ == "__main__":
  app.run(main)
