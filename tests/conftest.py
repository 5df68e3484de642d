"""Test setup: FP64 on, eight CPU devices, a persistent compilation cache,
GPU marker."""

import os
import pathlib

import jax
import pytest
from hypothesis import HealthCheck, settings

# Golden comparisons at FP64 need JAX's 64-bit mode; the library raises a
# clear error without it (tested in test_precision.py).
jax.config.update("jax_enable_x64", True)
# Ring attention shards a sequence over 2, 4 and 8 devices; on the CPU they
# are simulated (XLA host devices). Single-device code runs on the first.
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  jax.config.update("jax_num_cpu_devices", 8)
# Compile once per configuration across test processes and reruns. The
# environment carries the cache to the launchers, notebook kernels and
# workers the tests start as subprocesses, which would otherwise compile
# every program again from nothing.
_CACHE = os.environ.get(
  "STABLEATTN_JAX_CACHE",
  str(pathlib.Path(__file__).resolve().parent.parent / ".jax_cache"),
)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

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


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
