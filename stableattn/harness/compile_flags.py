"""XLA:CPU settings for processes that compile hundreds of small programs
and run each a few times: the experiments' commands and the tests.

Two settings, each applied only where XLA_FLAGS does not set it already:

- XLA:CPU's legacy elemental emitters instead of its fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`), which generate code in about
  half the time (the fast tier's test time, cold: 431 s to 236 s);
- LLVM's optimization `level`: 0 where programs run a few times on small
  tensors (the tests, training a small model), 1 for the forward report,
  whose interpret-mode kernels run long at 0.

Like another instruction set, they can move the bits of plain float
arithmetic (a small model's training, a Baseline's sums) but not a
precision policy's roundings, which are explicit: the default forward
run's 1,844 summary rows are bit for bit those at XLA's defaults, the
smoke drift's verdicts the same. CI runs the rounding tests again at
XLA's defaults.

jaxlib 0.11 has no legacy emitters, and XLA stops at a flag it does not
know, so from 0.11 on only the level is set. The legacy emitters of
jaxlib 0.10 convert FP32 to FP4 (e2m1) through a wider format, rounding
twice (1.7499 to 2.0, not 1.5); on the CPU our code rounds to FP4
explicitly (`numerics.rounding.round_to`), never with a bare cast.
"""

from __future__ import annotations

import importlib.metadata
import re

LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# The first jaxlib without the legacy emitters' flag.
NO_LEGACY_EMITTERS_FROM = (0, 11)


def _release(version: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def has_legacy_emitters(jaxlib_version: str | None = None) -> bool:
  """Whether this jaxlib's XLA knows `LEGACY_EMITTERS`."""
  version = jaxlib_version or importlib.metadata.version("jaxlib")
  return _release(version) < NO_LEGACY_EMITTERS_FROM


def quick_cpu_compiles(
  flags: str, level: int, jaxlib_version: str | None = None
) -> str:
  """XLA_FLAGS `flags` with the legacy emitters (where this jaxlib has
  them) and the backend optimization `level`, each unless `flags` names
  that setting already."""
  added = []
  if "xla_cpu_use_fusion_emitters" not in flags and has_legacy_emitters(
    jaxlib_version
  ):
    added.append(LEGACY_EMITTERS)
  if "xla_backend_optimization_level" not in flags:
    added.append(f"--xla_backend_optimization_level={level}")
  return " ".join([flags.strip(), *added]).strip()


def default_emitters() -> dict | None:
  """jit's `compiler_options` for XLA's default (fusion) emitters in a
  process whose XLA_FLAGS chose the legacy ones; None where this jaxlib
  has only the default."""
  if not has_legacy_emitters():
    return None
  return {"xla_cpu_use_fusion_emitters": True}
