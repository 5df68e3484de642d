"""Test setup: FP64 on, eight CPU devices, XLA at optimization level 0, a
persistent compilation cache, GPU marker."""

import collections
import os
import pathlib

import jax
import pytest
import shares
from hypothesis import HealthCheck, settings

from stableattn.contract.options import (
  SEQUENTIAL_SCHEDULE_FLAG,
  sequential_schedule_set,
)
from stableattn.harness.compile_flags import quick_cpu_compiles
from stableattn.harness.memory_maps import release_if_near_limit

# Golden comparisons at FP64 need JAX's 64-bit mode; the library raises a
# clear error without it (tested in test_precision.py).
jax.config.update("jax_enable_x64", True)
# Ring attention shards a sequence over 2, 4 and 8 devices; on the CPU they
# are simulated (XLA host devices). Single-device code runs on the first.
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  jax.config.update("jax_num_cpu_devices", 8)
# XLA's CPU backend at optimization level 0, with its legacy emitters
# (`compile_flags`). The tiers compile hundreds of small programs and run
# most of them a few times: LLVM's optimizations cost a third of the fast
# tier's time and save little, and the fusion emitters take twice as long
# as the legacy ones. Both can move the bits of plain float arithmetic, as
# another instruction set does, but not a policy's (CI runs the rounding
# tests again at XLA's defaults); a test about one machine's bits sets
# its own level. A setting in XLA_FLAGS wins. Set before JAX starts its
# backend, and inherited by the launchers and workers the tests start.
os.environ["XLA_FLAGS"] = quick_cpu_compiles(
  os.environ.get("XLA_FLAGS", ""), level=0
)
# The GPU interpreter runs FlashAttention-3's warpgroups only under a
# schedule that does not interleave independent work (the flag's
# comment: a deadlock otherwise); every result is the same either way.
if not sequential_schedule_set():
  os.environ["XLA_FLAGS"] += " " + SEQUENTIAL_SCHEDULE_FLAG
# Compile once per configuration across test processes and reruns. The
# environment carries the cache to the launchers, notebook kernels and
# workers the tests start as subprocesses, which would otherwise compile
# every program again from nothing. Every program is kept, however quick
# to compile: the two workers compile many of the same ones (the cold
# fast tier 0.97x the time of keeping those over 0.5 s alone, two pairs).
_CACHE = os.environ.get(
  "STABLEATTN_JAX_CACHE",
  str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"),
)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update(
  "jax_persistent_cache_min_compile_time_secs",
  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)

settings.register_profile(
  "ci",
  max_examples=6,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_addoption(parser):
  parser.addoption(
    "--share",
    help="i/n: run the i-th of n shares of the selected tests, whole files "
    "balanced by tests/slow_durations.json (CI's slow step)",
  )
  parser.addoption(
    "--store-durations",
    action="store_true",
    help="merge this run's seconds per test into tests/slow_durations.json",
  )


def pytest_configure(config):
  if config.getoption("share"):
    shares.parse(config.getoption("share"))  # a bad value fails at once


# Last, so that a share is taken from the tests `-m` kept.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  if config.getoption("share"):
    share = shares.parse(config.getoption("share"))
    items[:], dropped = shares.split(items, share, shares.stored())
    config.hook.pytest_deselected(items=dropped)
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


_SECONDS = collections.Counter()


def pytest_runtest_logreport(report):
  _SECONDS[report.nodeid] += report.duration


def pytest_sessionfinish(session):
  config = session.config
  if config.getoption("store_durations") and not hasattr(config, "workerinput"):
    shares.store(dict(_SECONDS))


@pytest.fixture(autouse=True, scope="module")
def _compiled_code_within_the_map_limit():
  """A worker runs hundreds of tests: between modules, JAX's caches go
  once the process holds half its memory-mapping limit, which the
  compiled executables would otherwise reach (a segfault in LLVM)."""
  yield
  release_if_near_limit()
