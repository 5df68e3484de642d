r"""Training-drift experiment launcher.

  python launch/training_drift.py --workdir=runs/drift \
      [--config=configs/training_drift.py[:paper|:smoke]] \
      [--config.train.precision=fp32]

Kept short so that Colab and tests call the same `run`.
"""

import jax

from stableattn.experiments import training_drift
from stableattn.experiments.cli import launch
from stableattn.training import distributed


def simulate_ring_devices(config) -> None:
  """A context-parallel run on a CPU: its ring's devices are simulated,
  and the other runs keep the one real CPU device unless told otherwise."""
  if distributed.simulate_cpu_devices(config.attention.context_parallel):
    if config.train.devices == 0 and jax.default_backend() == "cpu":
      config.train.devices = 1


if __name__ == "__main__":
  launch(
    __file__,
    training_drift.run,
    config="training_drift.py",
    workdir="runs/training_drift",
    workdir_holds="config.json, metrics.jsonl, checkpoints and the report",
    before_run=simulate_ring_devices,
  )
