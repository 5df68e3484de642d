"""Which of our flash kernels `implementation="flash"` runs."""

from __future__ import annotations

import collections

import jax

from stableattn.contract.options import Options
from stableattn.kernels.kernel_config import KernelConfig

# Compute capability from which "flash" takes the Mosaic GPU path (Hopper).
HOPPER_CAPABILITY = 9.0

# The path each "flash" call of this process took, counted as it is traced
# (a report's environment record says which ran: `paths_taken`).
_TAKEN: collections.Counter = collections.Counter()


def flash_path(cfg: KernelConfig, options: Options) -> str:
  """The kernel implementation="flash" runs for `cfg`: the Hopper path
  ("mosaic_gpu") when compiling for a GPU of compute capability 9.0 or
  later where that path runs the request as asked (its policy, features
  and the caller's tiles), else the Triton path ("pallas"), which runs
  everything; interpret mode takes the Triton path. FP8 operands take
  the Triton path too: the Hopper path runs their forward only, and
  whether a gradient follows is not known here."""
  if cfg.interpret or not hopper_or_later() or cfg.policy.quantizes:
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


def record_taken(path: str) -> str:
  """Counts one "flash" call on `path` and returns it."""
  _TAKEN[path] += 1
  return path


def paths_taken() -> dict[str, int]:
  """How many traced "flash" calls of this process took each path."""
  return dict(sorted(_TAKEN.items()))


def always_triton() -> bool:
  """Whether "flash" takes the Triton path for every request on this
  backend (no Hopper or later GPU), so that it computes what "pallas"
  does, bit for bit."""
  return not hopper_or_later()
