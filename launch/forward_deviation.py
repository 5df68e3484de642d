r"""Forward-deviation experiment launcher.

  python launch/forward_deviation.py --workdir=runs/forward \
      [--config=configs/forward_deviation.py[:paper|:smoke]] \
      [--config.seq_len.lengths=256,1024]

Kept short so that Colab and tests call the same `run`.
"""

from stableattn.experiments import forward
from stableattn.experiments.cli import launch
from stableattn.training import distributed


def simulate_ring_devices(config) -> None:
  """The ring study's devices, simulated on a CPU (single-device studies
  run on the first)."""
  if "context_parallel" in str(config.studies).split(","):
    block = config.context_parallel
    distributed.simulate_cpu_devices(max((*block.device_counts, block.vary_at)))


if __name__ == "__main__":
  launch(
    __file__,
    forward.run,
    config="forward_deviation.py",
    workdir="runs/forward_deviation",
    workdir_holds="config.json, metrics.jsonl and the report",
    before_run=simulate_ring_devices,
  )
