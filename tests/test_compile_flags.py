"""The XLA:CPU settings of the launchers and the tests (`compile_flags`)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stableattn.commands.main import use_quick_compiles
from stableattn.harness.compile_flags import (
  LEGACY_EMITTERS,
  default_emitters,
  has_legacy_emitters,
  quick_cpu_compiles,
)


@pytest.mark.parametrize(
  "given, version, want",
  [
    ("", "0.10.2", f"{LEGACY_EMITTERS} --xla_backend_optimization_level=1"),
    ("", "0.11.2", "--xla_backend_optimization_level=1"),
    (
      "--xla_backend_optimization_level=3",
      "0.10.0",
      f"--xla_backend_optimization_level=3 {LEGACY_EMITTERS}",
    ),
    (
      " --xla_cpu_use_fusion_emitters=true --xla_cpu_max_isa=AVX2",
      "0.10.2",
      "--xla_cpu_use_fusion_emitters=true --xla_cpu_max_isa=AVX2 "
      "--xla_backend_optimization_level=1",
    ),
  ],
)
def test_a_setting_in_xla_flags_wins_and_a_newer_jaxlib_gets_no_unknown_flag(
  given, version, want
):
  assert quick_cpu_compiles(given, level=1, jaxlib_version=version) == want


def test_the_tests_run_under_the_quick_settings():
  assert "--xla_backend_optimization_level=" in os.environ["XLA_FLAGS"]
  if has_legacy_emitters():
    assert "xla_cpu_use_fusion_emitters" in os.environ["XLA_FLAGS"]


@pytest.mark.skipif(
  not has_legacy_emitters() or LEGACY_EMITTERS not in os.environ["XLA_FLAGS"],
  reason="this jaxlib has no legacy emitters, or XLA_FLAGS chose others",
)
def test_the_legacy_emitters_round_an_fp32_to_fp4_convert_twice():
  """Why a test of bare FP4 casts compiles with `default_emitters()`: the
  legacy convert goes through a wider format, so a value just below a tie
  rounds up to the tie and then to even."""
  x = jnp.asarray(np.float32([1.7499, 1.74, 0.2499, 5.4]))

  def cast(x):
    return x.astype(jnp.float4_e2m1fn).astype(jnp.float32)

  legacy = np.asarray(jax.jit(cast)(x))
  default = np.asarray(jax.jit(cast, compiler_options=default_emitters())(x))
  np.testing.assert_array_equal(default, [1.5, 1.5, 0.0, 6.0])
  np.testing.assert_array_equal(legacy, [2.0, 1.5, 0.0, 6.0])


def test_a_command_leaves_xla_flags_alone_once_jax_has_started(monkeypatch):
  """Flags set after the backend started would not act, yet the run would
  record them as its own."""
  jax.devices()
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
  use_quick_compiles(1)
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
