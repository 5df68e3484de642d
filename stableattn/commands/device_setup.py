"""What a command sets up before its experiment runs: the CPU devices a
ring (context-parallel) study simulates."""

from __future__ import annotations

import jax

from stableattn.training import distributed


def forward_ring_devices(config) -> None:
  """The ring study's devices, simulated on a CPU (single-device studies
  run on the first)."""
  if "context_parallel" in str(config.studies).split(","):
    block = config.context_parallel
    distributed.simulate_cpu_devices(max((*block.device_counts, block.vary_at)))


def drift_ring_devices(config) -> None:
  """A context-parallel run on a CPU: its ring's devices are simulated,
  and the other runs keep the one real CPU device unless told otherwise."""
  if distributed.simulate_cpu_devices(config.attention.context_parallel):
    if config.train.devices == 0 and jax.default_backend() == "cpu":
      config.train.devices = 1


def stability_ring_devices(config) -> None:
  distributed.simulate_cpu_devices(int(config.context_parallel or 0))
