r"""The shared key component on a model's own tensors: for every captured
layer, its key and value offsets, each BF16 kernel's dQ against
FlexAttention's rule as captured and with keys, values or both centred
(exact changes), and the share of the dQ error Qiu & Yao's Eq. 1 gives.

  python launch/offset_mechanism.py --captures=runs/drift_smoke/captures \
      --out=results/cpu/key-offset-2026-11-28

Writes rows.jsonl, table.md (docs/results.md quotes it) and
dq_vs_key_offset.png under --out, and prints the table.
"""

import json
import pathlib

from absl import app, flags

from stableattn.auditing import captures, offset_mechanism

flags.DEFINE_list("captures", None, "Captured tensors (runs' captures/).")
flags.DEFINE_string("out", None, "Where the rows, table and figure go.")


def main(argv):
  del argv
  f = flags.FLAGS
  missing = [p for p in f.captures if not pathlib.Path(p).exists()]
  if missing:
    print(f"error: no captures at {missing}")
    return 2
  out = pathlib.Path(f.out)
  out.mkdir(parents=True, exist_ok=True)
  rows = []
  for path in f.captures:
    for layer in captures.load(path):
      found = offset_mechanism.layer_rows(layer)
      source = pathlib.Path(path).as_posix()
      rows += [{"captures": source, **r} for r in found]
      print(f"{layer.label}: {len(found)} rows")
  (out / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = offset_mechanism.table(rows)
  (out / "table.md").write_text(text + "\n")
  offset_mechanism.plot(rows, out / "dq_vs_key_offset.png")
  print(text)
  return 0


if __name__ == "__main__":
  flags.mark_flags_as_required(["captures", "out"])
  app.run(main)
