r"""Calibrates the attention monitor: where each kernel starts missing the
audit's rules, by the largest logit and the near-tie share (about 16
minutes on 2 CPU cores).

  python launch/monitor_thresholds.py [--kernels="pallas bf16-fa2,xla fp32"]

Writes stableattn/auditing/monitor_thresholds.json (read by the training
reports' verdicts), draws the 2-D map (launch/figures/monitor_regions.png,
one panel per kernel) and prints the tables that docs/monitor.md quotes.
"""

import json
import pathlib

from absl import app, flags

from stableattn.auditing import thresholds

flags.DEFINE_list("kernels", None, "Names of thresholds.KERNELS; all if unset.")
flags.DEFINE_string("out", str(thresholds.DATA), "Where the data goes.")
flags.DEFINE_string(
  "figure",
  str(pathlib.Path(__file__).with_name("figures") / "monitor_regions.png"),
  "Where the 2-D map's figure goes.",
)


def main(argv):
  del argv
  names = flags.FLAGS.kernels
  unknown = [n for n in names or () if n not in thresholds.KERNELS]
  if unknown:
    print(
      f"error: unknown kernels {unknown}; valid: {list(thresholds.KERNELS)}"
    )
    return 2
  data = thresholds.write(thresholds.sweep(names), flags.FLAGS.out)
  thresholds.plot_regions(data, flags.FLAGS.figure)
  print(thresholds.table(data))
  print()
  print(thresholds.regions_table(data))
  print(json.dumps(data["thresholds"], indent=2))
  return 0


if __name__ == "__main__":
  app.run(main)
