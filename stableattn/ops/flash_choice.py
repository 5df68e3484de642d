"""Which of our flash kernels `implementation="flash"` runs."""

from __future__ import annotations

import jax

from stableattn.contract.options import Options
from stableattn.kernels.kernel_config import KernelConfig

# Compute capability from which "flash" takes the Mosaic GPU path (Hopper).
HOPPER_CAPABILITY = 9.0


def flash_path(cfg: KernelConfig, options: Options) -> str:
  """The kernel implementation="flash" runs for `cfg`: the Hopper path
  ("mosaic_gpu") when compiling for a GPU of compute capability 9.0 or
  later where that path runs the request as asked (its policy, features
  and the caller's tiles), else the Triton path ("pallas"), which runs
  everything; interpret mode takes the Triton path."""
  if cfg.interpret or not hopper_or_later():
    return "pallas"
  from stableattn.kernels import mosaic_attention as mosaic  # heavy: on use

  if mosaic.refusals(cfg) or mosaic.tile_refusals(options):
    return "pallas"
  return "mosaic_gpu"


def hopper_or_later() -> bool:
  if jax.default_backend() != "gpu":
    return False
  capability = getattr(jax.devices()[0], "compute_capability", "0")
  return float(capability) >= HOPPER_CAPABILITY
