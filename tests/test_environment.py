"""What a run records of its machine, and the machine one step down."""

import json

import numpy as np
import pytest

from stableattn.harness import environment


@pytest.fixture
def avx2_host(monkeypatch):
  monkeypatch.setattr(
    environment,
    "_cpuinfo",
    lambda: "model name\t: Test CPU\nflags\t\t: fpu sse4_2 avx avx2 fma\n",
  )
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  # Every instruction set compiles another program (the probe's digest).
  monkeypatch.setattr(environment, "program_digest", environment.compiled_isa)


def test_the_other_machine_skips_instruction_sets_that_compile_the_same(
  avx2_host, monkeypatch
):
  same_as_avx2 = {"AVX2": "x", "AVX": "x", "SSE4_2": "y"}
  monkeypatch.setattr(
    environment,
    "program_digest",
    lambda flags: same_as_avx2[environment.compiled_isa(flags)],
  )
  assert environment.other_machine_flags() == (
    "--xla_cpu_max_isa=SSE4_2",
    "SSE4_2",
  )
  monkeypatch.setattr(environment, "program_digest", lambda flags: "x")
  flags, reason = environment.other_machine_flags()
  assert flags is None
  assert "identical on this host" in reason and "AVX, SSE4_2" in reason


@pytest.mark.slow
def test_the_probe_is_deterministic_and_sees_a_lower_instruction_set():
  isa = environment.host_isa()
  if isa in (None, "SSE4_2"):
    pytest.skip(f"no lower instruction set than {isa} here")
  here = environment.program_digest("")
  assert environment._run_probe("") == here  # a fresh process, not a store
  assert environment.program_digest("--xla_cpu_max_isa=SSE4_2") != here


def test_a_probe_is_run_once_per_flags_and_kept_beside_the_cache(
  tmp_path, monkeypatch
):
  runs = []

  def probe(flags):
    runs.append(flags)
    return f"digest of {flags or 'host'}"

  monkeypatch.setattr(environment, "_run_probe", probe)
  store = tmp_path / "machine_probe.json"
  monkeypatch.setattr(environment, "_probe_file", lambda: store)
  digest = environment.program_digest.__wrapped__
  assert digest("") == digest("") == "digest of host"
  assert digest("--xla_cpu_max_isa=AVX") == "digest of --xla_cpu_max_isa=AVX"
  assert runs == ["", "--xla_cpu_max_isa=AVX"]
  assert len(json.loads(store.read_text())) == 2
  # Another CPU is another key: probed again.
  monkeypatch.setattr(environment, "cpu_model", lambda: "Another CPU")
  digest("")
  assert runs[-1] == "" and len(runs) == 3


def test_the_instruction_set_is_the_hosts_capped_by_the_flag(avx2_host):
  assert environment.cpu_model() == "Test CPU"
  assert environment.host_isa() == "AVX2"
  assert environment.compiled_isa() == "AVX2"
  assert environment.compiled_isa("--xla_cpu_max_isa=AVX") == "AVX"
  # A cap above the host changes nothing; the last flag wins, as in XLA.
  assert environment.compiled_isa("--xla_cpu_max_isa=AVX512") == "AVX2"
  assert (
    environment.compiled_isa("--xla_cpu_max_isa=AVX --xla_cpu_max_isa=SSE4_2")
    == "SSE4_2"
  )


def test_the_other_machine_is_one_step_down_and_keeps_other_flags(
  avx2_host, monkeypatch
):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  flags, label = environment.other_machine_flags()
  assert label == "AVX"
  assert flags == (
    "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX"
  )
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX")
  assert environment.other_machine_flags() == (
    "--xla_cpu_max_isa=SSE4_2",
    "SSE4_2",
  )
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=SSE4_2")
  flags, reason = environment.other_machine_flags()
  assert flags is None and "lowest instruction set" in reason


def test_a_cpu_xla_cannot_order_has_no_other_machine(monkeypatch):
  monkeypatch.setattr(environment, "_cpuinfo", lambda: "")
  monkeypatch.setattr(environment.platform, "machine", lambda: "arm64")
  flags, reason = environment.other_machine_flags()
  assert flags is None and "arm64" in reason


def test_the_record_names_versions_flags_and_the_corpus(avx2_host):
  digest = environment.corpus_digest(np.arange(5, dtype=np.uint8))
  assert digest != environment.corpus_digest(np.arange(6, dtype=np.uint8))
  env = environment.describe(corpus=digest)
  for key in ("python", "jax", "jaxlib", "flax", "optax", "numpy"):
    assert env[key], key
  assert env["xla_cpu_isa"] == "AVX2" and env["device_count"] >= 1
  assert env["corpus_sha256"] == digest
  line = environment.summary_line(env)
  assert "Test CPU (XLA compiles for AVX2)" in line
  assert f"jax {env['jax']}" in line and digest[:16] in line


def test_compiled_code_is_released_only_near_the_map_limit():
  import jax
  import jax.numpy as jnp

  from stableattn.harness import memory_maps

  found = memory_maps.map_count_and_limit()
  if found is None:
    pytest.skip("no /proc: the limit is Linux's")
  count, limit = found
  assert 0 < count < limit
  double = jax.jit(lambda x: 2 * x)
  double(jnp.ones(3))
  assert double._cache_size() == 1
  assert not memory_maps.release_if_near_limit(share=1.0)
  assert double._cache_size() == 1
  assert memory_maps.release_if_near_limit(share=0.0)
  assert double._cache_size() == 0
