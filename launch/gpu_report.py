r"""Tables and figures of a GPU record, regenerated on any machine.

  python launch/gpu_report.py --record=results/gpu/h100-2026-11-24 \
      [--workdir=runs/gpu_report]

Reads the rows a GPU session stored and writes report.md, whose tables
docs/performance.md quotes: a record of `launch/gpu_session.sh` (see
`stableattn/experiments/benchmark/session_record.py`), or an earlier one
(`gpu_record.py`, with throughput.png).
"""

import json

from absl import app, flags

from stableattn.experiments.benchmark import gpu_record, session_record

flags.DEFINE_string("record", None, "A record folder under results/gpu/.")
flags.DEFINE_string("workdir", "runs/gpu_report", "Where the report goes.")
flags.mark_flag_as_required("record")


def main(argv):
  del argv
  try:
    writer = (
      session_record
      if session_record.is_session_record(flags.FLAGS.record)
      else gpu_record
    )
    result = writer.write(flags.FLAGS.record, flags.FLAGS.workdir)
  except ValueError as e:
    print(f"error: {e}")
    return 2
  print(json.dumps(result, indent=2))
  return 0


if __name__ == "__main__":
  app.run(main)
