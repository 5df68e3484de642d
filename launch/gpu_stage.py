r"""One stage of a GPU session (launch/gpu_session.sh runs them in order).

  python launch/gpu_stage.py --stage=price --out=OUT/price.jsonl
  python launch/gpu_stage.py --stage=hopper --out=OUT/hopper.jsonl
  python launch/gpu_stage.py --stage=levers --out=OUT/levers.jsonl
  ncu --csv ... python launch/gpu_stage.py --stage=ncu_pass \
      --out=OUT/ncu_order.json
  python launch/gpu_stage.py --stage=ncu_rows --ncu_csv=OUT/ncu.csv \
      --order=OUT/ncu_order.json --out=OUT/nsight.jsonl

`--small` runs the same code in interpret mode at a test's sizes. Rows
are appended as each point finishes (see
`stableattn/experiments/benchmark/gpu_stages.py`).
"""

import dataclasses
import json
import pathlib
import time

from absl import app, flags

from stableattn.experiments.benchmark import gpu_stages, hopper_stage

STAGES = ("price", "hopper", "levers", "ncu_pass", "ncu_rows")
flags.DEFINE_enum("stage", None, STAGES, "Which stage.")
flags.DEFINE_string("out", None, "Where the stage's rows go.")
flags.DEFINE_bool("small", False, "Interpret-mode sizes (a CPU test).")
flags.DEFINE_string("ncu_csv", None, "ncu_rows: Nsight Compute's --csv output.")
flags.DEFINE_string("order", None, "ncu_rows: the ncu_pass order file.")
flags.DEFINE_list("lengths", None, "price: lengths instead of the default.")
flags.DEFINE_list("bases", None, "price: base presets of the pairs to time.")
flags.DEFINE_list(
  "modes", None, "price, hopper: forward and/or forward_backward."
)
flags.mark_flags_as_required(["stage", "out"])


def _append_points(out, label: str, points, rows_of, sizes) -> None:
  """Measures each point's rows and appends them as they come, so that a
  stage cut off at its limit keeps what it measured."""
  for point in points:
    started = time.time()
    rows = rows_of(sizes, *point)
    gpu_stages.append_rows(out, rows)
    print(f"{label} {point}: {len(rows)} rows in {time.time() - started:.1f} s")


def main(argv):
  del argv
  f = flags.FLAGS
  out = pathlib.Path(f.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  sizes = gpu_stages.sizes(f.small)
  if f.lengths:
    sizes = dataclasses.replace(sizes, lengths=tuple(map(int, f.lengths)))
  if f.stage == "price":
    pairs = [
      p for p in gpu_stages.STABLE_PAIRS if not f.bases or p[0] in f.bases
    ]
    modes = tuple(f.modes or gpu_stages.MODES)
    points = gpu_stages.price_points(sizes, pairs, modes)
    _append_points(out, "price", points, gpu_stages.price_rows, sizes)
  elif f.stage == "hopper":
    modes = tuple(f.modes or gpu_stages.MODES)
    points = hopper_stage.hopper_points(sizes, modes)
    _append_points(out, "hopper", points, hopper_stage.hopper_rows, sizes)
    # Then each feature at the goals' length (after every length's core
    # comparison: a stage cut off keeps those).
    points = hopper_stage.hopper_feature_points(sizes, modes)
    rows_of = hopper_stage.hopper_feature_rows
    _append_points(out, "hopper feature", points, rows_of, sizes)
  elif f.stage == "levers":
    rows = gpu_stages.lever_rows(sizes, f.small)
    gpu_stages.append_rows(out, rows)
    for r in rows:
      print(r["lever"], r.get("median_ms", r.get("error")))
  elif f.stage == "ncu_pass":
    order = gpu_stages.ncu_pass(sizes, f.small)
    out.write_text(json.dumps(order) + "\n")
    print("ran once each:", order)
  else:
    if not (f.ncu_csv and f.order):
      print("error: --stage=ncu_rows needs --ncu_csv and --order")
      return 2
    order = json.loads(pathlib.Path(f.order).read_text())
    text = pathlib.Path(f.ncu_csv).read_text()
    try:
      rows = gpu_stages.parse_ncu_csv(text, order)
    except ValueError as e:
      print(f"error: {e}")
      return 1
    gpu_stages.append_rows(out, rows)
    print(f"{len(rows)} kernels' counters")
  return 0


if __name__ == "__main__":
  app.run(main)
