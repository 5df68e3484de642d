"""The JAX ecosystem's kernels in the registry: each runs as its project's
CPU tests run it, takes the features it has, and is judged by the audit
(decode kernels on their output, at the shapes they take)."""

import os

import jax
import numpy as np
import pytest
from helpers import smoke_audit_config

import stableattn as sa
from stableattn.auditing import grid as audit_grid
from stableattn.ops import registry


@pytest.fixture(autouse=True)
def without_64_bit_mode():
  """These kernels trace int32 index arithmetic that 64-bit mode (on in
  the tests' process, off in the launcher's) breaks; the audit itself
  needs no FP64 in JAX."""
  with jax.enable_x64(False):
    yield


def _audit(name, **settings):
  return sa.audit(registry.resolve(name), repeats=2, **settings)


@pytest.mark.slow
def test_splash_takes_its_masks_soft_cap_and_sinks():
  report = _audit(
    "jax_splash",
    precision="fp32",
    shapes=[(1, 128, 256, 4, 2, 32)],  # GQA: its MQA kernel per KV head
    features="causal,window,segments,softcap,sink",
  )
  assert report.passed, str(report)
  assert [r["tensor"] for r in report.rows] == [
    "out",
    "dq",
    "dk",
    "dv",
    "dsink",
  ]


@pytest.mark.slow
def test_splash_misses_flashattentions_rule_on_dq_at_tied_maxima_in_bf16(
  tmp_path,
):
  config = smoke_audit_config(
    "jax_splash",
    precisions="bf16-framework",
    shapes=((1, 128, 2, 64),),
    regimes="tied_maxima",
  )
  result = audit_grid.run(config, tmp_path)
  assert not result["passed"]
  # delta = rowsum(dO * O) from the BF16-rounded O, then dS rounded once:
  # FlashAttention's rule misses on dQ alone.
  misses = [f for f in result["failures"] if f.startswith("flashattention")]
  assert misses and all("rule fails on dq" in f for f in misses), misses
  assert all("regime tied_maxima" in f for f in misses)
  worst = result["worst_ratio"]["flashattention"]
  assert worst["dq"] > 2 and max(worst["out"], worst["dv"]) < 1


@pytest.mark.slow
def test_tpu_flash_runs_forward_and_backward_in_tpu_interpret_mode():
  report = _audit(
    "jax_tpu_flash",
    precision="bf16-framework",
    shapes=[(2, 128, 4, 32), (1, 128, 128, 4, 2, 32)],
    features="causal,segments",
  )
  assert report.passed, str(report)
  assert {r["tensor"] for r in report.rows} == {"out", "dq", "dk", "dv"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax_decode", "jax_paged"])
def test_decode_kernels_are_judged_on_their_output_at_decode_shapes(name):
  report = _audit(
    name,
    precision="bf16-framework",
    shapes=[(4, 1, 200, 8, 2, 64)],  # 200 keys: neither blocks nor pages
    features="lengths",
    invariances="batch,padded_cache,mixed_batch",
  )
  assert report.passed, str(report)
  assert [r["tensor"] for r in report.rows] == ["out"]
  assert "no VJP" in report.rows[0]["gradients"]
  judged = [r for r in report.invariance_rows if r["invariant"] is not None]
  assert {r["invariance"] for r in judged} == {
    "batch", "padded_cache", "mixed_batch"
  }  # fmt: skip
  # A query per sequence is all they take: a prefill case is an error row.
  prefill = _audit(name, precision="fp32", shapes=[(1, 64, 2, 32)])
  (error,) = prefill.errors
  assert "takes one query per sequence" in error["error"]
  assert registry.forward_only(name) == f"jax's {name[4:]} kernel has no VJP"


@pytest.mark.slow
def test_ragged_paged_attention_off_a_tpu_is_refused_in_one_line(tmp_path):
  if jax.default_backend() == "tpu":
    pytest.skip("runs on a TPU")
  config = smoke_audit_config("jax_ragged_paged")
  with pytest.raises(ValueError, match="cannot run here: it needs a TPU") as e:
    audit_grid.run(config, tmp_path)
  assert "\n" not in str(e.value)


@pytest.mark.slow
def test_keras_is_audited_and_its_refusals_are_error_rows(tmp_path):
  os.environ.setdefault("KERAS_BACKEND", "jax")  # as keras_dpa sets it
  pytest.importorskip("keras", reason="pip install -e '.[peers]'")
  config = smoke_audit_config(
    "keras_dpa",
    precisions="bf16-framework",
    shapes=((1, 64, 128, 4, 2, 32),),
    features="causal;softcap",
  )
  result = audit_grid.run(config, tmp_path)
  assert result["failures"] == [] and result["verdict"] == "ERRORS"
  (error,) = result["errors"]
  assert error["features"] == "softcap"
  assert (
    "attn_logits_soft_cap is only supported for JAX on TPU" in error["error"]
  )
  assert "--config.features=softcap" in error["command"]


def test_the_ecosystems_names_resolve_without_importing_their_kernels():
  for name in ("jax_splash", "jax_tpu_flash", "jax_decode", "jax_paged",
               "jax_ragged_paged", "keras_dpa"):  # fmt: skip
    assert callable(registry.resolve(name)) and name in registry.PEERS
  q = np.zeros((1, 4, 2, 8), np.float32)
  with pytest.raises(ValueError, match="takes one query per sequence"):
    registry.resolve("jax_decode")(q, q, q)


@pytest.mark.slow
def test_jax_mha_reads_each_query_heads_own_kv_head_under_gqa():
  """docs/findings.md: 16 query heads over 2 KV heads, heads 1-7 read KV
  head 1 (its index map takes the query head, clamped by the
  interpreter), so their output is wrong; heads 0 and 8-15 are right."""
  from jax.experimental.pallas.ops.gpu import attention as jax_attention

  rng = np.random.default_rng(0)
  q = rng.standard_normal((1, 64, 16, 32)).astype(np.float32)
  k, v = (rng.standard_normal((1, 64, 2, 32)).astype(np.float32)
          for _ in range(2))  # fmt: skip
  out = jax_attention.mha(q, k, v, None, sm_scale=32**-0.5, interpret=True)
  error = np.abs(np.asarray(out) - sa.golden_attention(q, k, v)).max((0, 1, 3))
  assert np.all(error[1:8] > 0.1) and np.all(error[[0, *range(8, 16)]] < 1e-5)
  report = _audit("jax_mha", precision="fp32", shapes=[(1, 64, 2, 32)],
                  regimes="gqa_groups")  # fmt: skip
  assert any("regime gqa_groups" in f for f in report.failures)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jax_decode", "jax_paged"])
def test_jax_decode_kernels_let_nan_in_unused_cache_slots_through(name):
  report = _audit(name, precision="fp32", shapes=[(4, 1, 256, 8, 2, 64)],
                  regimes="poisoned_padding")  # fmt: skip
  leaks = [f for f in report.failures if "NaN/Inf values in out" in f]
  assert leaks and all("regime poisoned_padding" in f for f in leaks)
