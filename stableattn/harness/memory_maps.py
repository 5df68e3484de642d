"""Compiled code against the kernel's limit on memory mappings.

Each executable XLA:CPU compiles holds about 150 memory mappings (its
code and data pages, measured with jax 0.10.2), and Linux refuses a
process more than `vm.max_map_count` of them (65,530 by default). An
audit over hundreds of shapes, or a long test session in one process,
compiles past that: LLVM then fails ("Cannot allocate memory") and the
process segfaults. Long loops call `release_if_near_limit` between units
of work; it clears JAX's caches (compiled functions recompile, or load
from a persistent compilation cache, when next called) only when the
process holds half the limit or more.
"""

from __future__ import annotations

import gc
import pathlib

import jax

_MAPS = pathlib.Path("/proc/self/maps")
_LIMIT = pathlib.Path("/proc/sys/vm/max_map_count")


def map_count_and_limit() -> tuple[int, int] | None:
  """(mappings this process holds, the most it may), or None where the
  system does not say (not Linux)."""
  try:
    limit = int(_LIMIT.read_text().strip())
    with _MAPS.open("rb") as maps:
      count = sum(1 for _ in maps)
  except (OSError, ValueError):
    return None
  return count, limit


def release_if_near_limit(share: float = 0.5) -> bool:
  """Clears JAX's caches if this process holds `share` of its mapping
  limit or more; True if it did."""
  found = map_count_and_limit()
  if found is None or found[0] < share * found[1]:
    return False
  jax.clear_caches()
  gc.collect()
  return True
