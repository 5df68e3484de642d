r"""Forward-deviation experiment launcher.

  python launch/forward_deviation.py --workdir=runs/forward \
      [--config=configs/forward_deviation.py[:paper|:smoke]] \
      [--config.seq_len.lengths=256,1024]

Kept short so that Colab and tests call the same `run`.
"""

import pathlib

from absl import app, flags
from ml_collections import config_flags

from stableattn import distributed
from stableattn.experiments import forward
from stableattn.experiments.cli import run_and_print

_CONFIG_PATH = pathlib.Path(__file__).resolve().parent.parent / "configs"
config_flags.DEFINE_config_file(
  "config",
  str(_CONFIG_PATH / "forward_deviation.py"),
  "Experiment configuration file (with an optional :variant).",
)
flags.DEFINE_string(
  "workdir",
  "runs/forward_deviation",
  "Directory for config.json, metrics.jsonl and the report.",
)

flags.DEFINE_bool(
  "restart",
  False,
  "Delete the results of an earlier run in --workdir before running.",
)


def main(argv):
  del argv
  config = flags.FLAGS.config
  if "context_parallel" in str(config.studies).split(","):
    # The ring's devices, simulated on a CPU (single-device studies run
    # on the first).
    block = config.context_parallel
    distributed.simulate_cpu_devices(max((*block.device_counts, block.vary_at)))
  return run_and_print(
    forward.run,
    config,
    flags.FLAGS.workdir,
    restart=flags.FLAGS.restart,
  )


if __name__ == "__main__":
  app.run(main)
