r"""Training-stability experiment launcher (learning-rate sensitivity).

  python launch/stability.py --workdir=runs/stability \
      [--config=configs/stability.py[:smoke|:paper|:gpu]]

A stopped sweep resumes: rerun the same command.
"""

from stableattn.experiments import stability
from stableattn.experiments.cli import launch
from stableattn.training import distributed


def simulate_ring_devices(config) -> None:
  distributed.simulate_cpu_devices(int(config.context_parallel or 0))


if __name__ == "__main__":
  launch(
    __file__,
    stability.run,
    config="stability.py",
    workdir="runs/stability",
    workdir_holds="config.json, metrics.jsonl, the report and figures",
    before_run=simulate_ring_devices,
  )
