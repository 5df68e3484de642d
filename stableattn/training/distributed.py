"""Several processes, one per host, on JAX's own distributed runtime.

`initialize` starts `jax.distributed` before anything touches a device:
with no arguments it detects the cluster (SLURM, Open MPI, Cloud TPU, as
`jax.distributed.initialize()` does); or it takes the coordinator's
address, the process count and this process's id. On CPU it selects gloo
collectives, so a test can run two processes on one machine. Every
process then runs the same program; only process 0 writes files
(`is_writer`).
"""

from __future__ import annotations

import jax


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> None:
  given = [
    x is not None for x in (coordinator_address, num_processes, process_id)
  ]
  if any(given) and not all(given):
    raise ValueError(
      "Give coordinator_address, num_processes and process_id together, "
      "or none of them (to detect the cluster)."
    )
  # Used by CPU devices only; GPUs bring their own collectives (NCCL).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
  )


def is_writer() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def simulate_cpu_devices(devices: int) -> bool:
  """Gives the CPU backend `devices` simulated devices (XLA host devices)
  for a context-parallel ring on a machine whose CPU is one device.

  Only before JAX starts, and only where neither XLA_FLAGS
  (--xla_force_host_platform_device_count) nor `jax_num_cpu_devices`
  already sets a count; an accelerator backend is unaffected. Returns
  whether it did.
  """
  import os

  from jax._src import xla_bridge

  if devices < 2 or xla_bridge.backends_are_initialized():
    return False
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return False
  if jax.config.jax_num_cpu_devices > 0:
    return False
  jax.config.update("jax_num_cpu_devices", devices)
  return True
