"""implementation="mosaic_gpu": our flash kernel on Pallas Mosaic GPU, run
on a CPU in jax's GPU interpret mode (with its race detector) and lowered
for CUDA; the GPU-marked test compares the compiled kernel with interpret
mode. Shapes are ragged on purpose: no case is a multiple of the tiles."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mosaic_lowered_text, stored_run, with_races_found

import stableattn as sa
from stableattn.auditing.invariance import ulp_at
from stableattn.experiments import hopper_check
from stableattn.kernels import mosaic_attention
from stableattn.ops import registry

CASES = hopper_check.CASES
_inputs = hopper_check.inputs
_value_and_grads = hopper_check.value_and_grads


def _differences(case):
  """Per tensor: (entries that differ from the Triton path's interpret
  mode, the largest difference over the tensor's largest entry, and one
  unit of the output format at that entry, over it)."""
  ours = _value_and_grads("mosaic_gpu", case)
  triton = _value_and_grads("pallas", case)
  fmt = sa.Precision.from_name(case[0]).output

  def scaled(a, b):
    largest = np.abs(b).max()
    return float(np.abs(a - b).max() / largest), ulp_at(largest, fmt) / largest

  return [
    (int(np.sum(a != b)), *scaled(a, b)) for a, b in zip(ours, triton)
  ], ours


def _check_against_triton(case):
  differences, ours = _differences(case)
  assert all(np.isfinite(x).all() for x in ours)
  for tensor, (count, largest, unit) in zip(
    ("out", "dq", "dk", "dv"), differences
  ):
    # wgmma's products are summed in another order than XLA's dots (and
    # XLA:CPU may fuse a product into an add): a few entries round the
    # other way (FP16's 3 more bits see more of them: 1.1% of dq at head
    # dim 128), never by more than 2^-8 of the tensor's scale or one unit
    # of the format at its largest entry (BF16's is up to 2^-7 of it:
    # MLA 576/512's dK differs by that one unit on some CPUs).
    assert count <= max(1, ours[0].size // 50), (tensor, count)
    assert largest <= max(2.0**-8, unit), (tensor, largest, unit)


# The fast tier's cases: causal, GQA, lengths no tile divides; and the
# same with every stage 16-bit (a rounding left out moves 11-64% of a
# tensor's entries, docs/performance.md).
FAST_CASES = ("causal-gqa", "bf16-every-stage")


@pytest.mark.parametrize("name", FAST_CASES)
def test_forward_and_gradients_match_the_triton_path(name):
  """Values and gradients at the Triton path's, and no race: the
  interpreter's happens-before detector watches every shared-memory
  access (it can fail: its test is in test_mosaic_gpu_forms.py)."""
  _, raced = with_races_found(lambda: _check_against_triton(CASES[name]))
  assert raced is False


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in FAST_CASES])
def test_every_supported_case_matches_the_triton_path(name):
  _check_against_triton(CASES[name])


@pytest.mark.slow
def test_rows_no_key_attends_are_zero_with_zero_gradient():
  """Bottom-right causal with more queries than keys: the first 64 rows
  see no key; their output and dq are exactly 0."""
  out, dq, _, _ = _value_and_grads(
    "mosaic_gpu", CASES["bottom-right-empty-rows"]
  )
  assert np.all(out[:, :64] == 0) and np.all(dq[:, :64] == 0)
  assert np.any(out[:, 64:] != 0)


@pytest.mark.slow
def test_nan_in_keys_past_the_length_never_reaches_a_result():
  case = CASES["key-lengths-d48"]
  (q, k, v, d_out), features = _inputs(case)
  clean = _value_and_grads("mosaic_gpu", case)
  k = k.at[0, 50:].set(jnp.nan)
  v = v.at[0, 50:].set(jnp.nan)
  out = sa.attention(
    q, k, v, implementation="mosaic_gpu", precision=case[0], **features
  )
  np.testing.assert_array_equal(np.asarray(out, np.float64), clean[0])


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 130, 2, 96), (2, 77, 4, 64)], ids=str)
def test_the_audit_passes_at_shapes_it_was_not_tuned_at(shape):
  fn = registry.resolve("mosaic_gpu", precision="bf16-fa2")
  report = sa.audit(fn, precision="bf16-fa2", shapes=(shape,))
  assert report.passed, str(report)
  assert {r["tensor"] for r in report.rows} == {"out", "dq", "dk", "dv"}


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"precision": "fp32"}, r"inputs=fp32.*TF32"),
    (
      {"precision": "bf16-fa2+matmul_accum=fp22"},
      r"matmul_accum=fp22: this path's products are wgmma's own FP32",
    ),
    (
      {"precision": "fp8-fa3-hopper"},
      r"matmul_accum=fp22: .*emulates it\); mma_chunk=32: only \(0,\)",
    ),
    ({"precision": "fp4-nvfp4"}, r"matmul_operands=fp4_e2m1: .*FP4 have no"),
    (
      {"precision": "fp8-fa3", "hopper_form": "p_in_registers"},
      r"p_in_registers with FP8 operands: .*wgmma's 8-bit A layout",
    ),
    (
      {"precision": "bf16-fa2+grad_accum=fp64"},
      r"grad_accum=fp64: one of \['fp32', 'bf16', 'fp16'\]",
    ),
    (
      {"precision": "bf16-fa2+delta_source=probs"},
      r"delta_source='probs': one of \['output', 'hi_lo'\]",
    ),
    (
      {"precision": "bf16-fa2+key_order=reversed"},
      r"key_order=.reversed.*Triton",
    ),
    ({"scheme": "fa1"}, r"scheme=fa1: not built on this path"),
  ],
)
def test_what_the_path_cannot_honour_is_refused_in_one_line(changes, message):
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(
    ValueError, match=r"implementation='mosaic_gpu' cannot run.*" + message
  ):
    sa.attention(q, q, q, implementation="mosaic_gpu", **changes)


@pytest.mark.parametrize("path", ["pallas", "mosaic_gpu"])
def test_split_kv_with_stable_residuals_runs_forward_and_refuses_gradients(
  path,
):
  """Split-KV merges by lse alone, so a stable preset's residuals do not
  exist for a backward: both paths decode with it, and both refuse its
  gradient in the same words."""
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  kw = dict(implementation=path, precision="bf16-fa2-stable", num_splits=2)
  assert np.isfinite(np.asarray(sa.attention(q, q, q, **kw), np.float32)).all()

  def loss(q):
    return jnp.sum(sa.attention(q, q, q, **kw).astype(jnp.float32))

  with pytest.raises(ValueError, match="keeps residuals for a stable"):
    jax.grad(loss)(q)


def test_tiles_it_does_not_run_are_refused_not_ignored():
  q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
  for options, message in (
    ({"block_q": 32}, r"block_q=32: one warpgroup's 64 rows"),
    ({"block_k": 32, "num_warps": 8}, r"block_k=32.*num_warps=8: a Triton"),
  ):
    with pytest.raises(
      ValueError, match="cannot take these options: " + message
    ):
      sa.attention(q, q, q, implementation="mosaic_gpu", **options)
  # 128-key blocks run (a 64-key sequence's block is padded).
  sa.attention(
    q, q, q, implementation="mosaic_gpu", precision="bf16-fa2", block_k=128
  )


def test_forward_and_backward_lower_to_mosaic_gpu_for_cuda():
  """The three kernels (forward, dK dV, dQ) build their Mosaic GPU modules
  on the CPU, causal with key lengths; delta is a row sum in XLA, not a
  Pallas Triton kernel."""
  text = mosaic_lowered_text(
    causal=True, key_value_seq_lengths=np.array([150, 200])
  )
  assert text.count("custom_call @mosaic_gpu") == 3
  assert "triton" not in text


def test_a_window_a_softcap_a_sink_and_the_tie_fix_lower_for_cuda():
  # The tie fix in what Mosaic GPU lowers (`block_math.tie_safe_max`).
  text = mosaic_lowered_text(
    local_window_size=(40, 20),
    softcap=5.0,
    sink=np.zeros(4, np.float32),
    tie_beta=2.0,
  )
  assert text.count("custom_call @mosaic_gpu") == 3


def _refusals(precision):
  shape = (1, 64, 2, 64)
  cfg = sa.ops.dispatch.kernel_config(
    sa.Options(precision=precision),
    shape,
    shape,
    sa.Features().split(shape, shape)[0],
    64,
  )
  return mosaic_attention.refusals(cfg)


# A few presets in the fast tier (base, stable, FP8, one refused); each
# lowering takes a second or two.
@pytest.mark.parametrize(
  "precision",
  [
    p
    if p in ("bf16-fa2", "fp16-fa2-stable", "fp8-fa3", "fp32")
    else pytest.param(p, marks=pytest.mark.slow)
    for p in sa.preset_names()
  ],
)
def test_every_preset_lowers_for_sm90_or_is_refused_with_its_reason(precision):
  """A preset the Hopper path runs builds its Mosaic GPU kernels for CUDA
  on the CPU, and no other kernel (no Pallas Triton one, which jax
  deprecates): the forward, dK dV and dQ, and delta's diagonal under
  delta_product=matmul (an FP8 preset its forward: its gradient is
  refused); any other preset is refused, naming the policy's stages."""
  refused = _refusals(precision)
  if refused:
    stages = {f.name for f in dataclasses.fields(sa.Precision)}
    assert all(r.split("=")[0] in stages for r in refused), refused
    return
  policy = sa.Precision.from_name(precision)
  fp8 = policy.quantizes
  text = mosaic_lowered_text(precision, gradients=not fp8, causal=True)
  kernels = 1 if fp8 else 3 + (policy.delta_product == "matmul")
  assert text.count("custom_call @") == kernels
  assert text.count("custom_call @mosaic_gpu") == kernels


def test_the_hopper_path_runs_every_16_bit_and_fp32_accumulated_fp8_preset():
  """Every preset whose matmul operands are BF16 or FP16 (the FA2 and
  stable presets, those whose scores, statistics and accumulators are
  16-bit too, the FP8 KV cache) and every FP8 one whose products are
  FP32; the FP32, FP64, FP4 presets and the FP8 ones with Hopper's
  narrower accumulator are refused (docs/performance.md says why)."""
  runs = {p for p in sa.preset_names() if not _refusals(p)}

  def policy(p):
    return sa.Precision.from_name(p)

  expected = {
    p
    for p in sa.preset_names()
    if policy(p).matmul_operands in ("bf16", "fp16")
    or (policy(p).matmul_operands == "fp8_e4m3" and policy(p).mma_chunk == 0)
  }
  assert runs == expected
  assert {"bf16", "fp16", "bf16-framework", "fp16-framework"} <= runs
  assert {"bf16-fp8-kv-cache", "bf16-fa2-stable", "fp16-fa2-stable"} <= runs
  assert {"fp8-baseline", "fp8-fa3", "fp8-sage"} <= runs
  assert len(runs) == 12


def test_the_refusal_list_is_empty_for_the_base_presets():
  for precision in ("bf16-fa2", "fp16-fa2", "bf16-fa2+exp2=on"):
    cfg = sa.ops.dispatch.kernel_config(
      sa.Options(precision=precision),
      (1, 64, 2, 64),
      (1, 64, 2, 64),
      sa.Features().split((1, 64, 2, 64), (1, 64, 2, 64))[0],
      64,
    )
    assert mosaic_attention.refusals(cfg) == []


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_kernel_matches_interpret_mode(name):
  case = CASES[name]
  compiled = _value_and_grads("mosaic_gpu", case, interpret=False)
  interpreted = _value_and_grads("mosaic_gpu", case, interpret=True)
  # wgmma sums its FP32 products in another order than XLA:CPU's dot, and
  # the GPU's exp is not XLA:CPU's, so a value near a rounding boundary of
  # the output format may round to its neighbour: at most one unit in the
  # last place of the largest value. On an H200 (jax 0.11.2) every tensor
  # checked was within one unit; where they differed, as few as 57.6% of
  # the elements were bit-identical (dQ of the stable presets and of the
  # rounded sum). FP8 products are summed by wgmma's FP8 accumulator,
  # which keeps about 14 bits between promotions (DeepSeek-V3, section
  # 3.3.2; `fp8-fa3-hopper` models it): not yet measured on a GPU.
  fmt = sa.Precision.from_name(case[0]).output
  for tensor, a, b in zip(("o", "dq", "dk", "dv"), compiled, interpreted):
    ulp = ulp_at(np.abs(b).max(), fmt)
    assert np.abs(a - b).max() <= ulp, (
      f"{tensor}: {np.abs(a - b).max() / ulp:.2f} ulps apart at most, "
      f"{float(np.mean(a == b)):.4f} bit-identical"
    )


def test_jax_mgpu_is_a_registry_name_with_the_interpreters_reason():
  """Off a GPU, jax_mgpu is n/a with the message jax's GPU interpret mode
  gives. When a newer jax interprets attention_mgpu this test fails:
  audit it on the CPU then (the registry already runs it that way)."""
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU jax_mgpu runs compiled (launch/gpu_session.sh)")
  assert "jax_mgpu" in registry.PEERS
  reason = registry.unavailable("jax_mgpu")
  assert reason is not None, "jax's GPU interpret mode now runs jax_mgpu"
  assert reason.startswith("it needs an NVIDIA GPU: jax ")
  assert "GPU interpret mode fails on it (" in reason and "\n" not in reason


def test_jax_mgpu_refuses_what_it_cannot_take_in_one_line():
  fn = registry.resolve("jax_mgpu")
  q = jnp.zeros((1, 100, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"q_len by 128.*not 100 and 100"):
    fn(q, q, q)
  q = jnp.zeros((1, 128, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="FP16 or BF16 inputs only"):
    fn(q, q, q)


def _stored_rows(name: str) -> list[dict]:
  text = (stored_run(name) / "rows.jsonl").read_text()
  return [json.loads(line) for line in text.splitlines()]


def test_docs_quote_the_stored_interpret_mode_comparison():
  rows = _stored_rows("hopper-interpret-2026-11-28")
  assert [r["case"] for r in rows] == list(CASES)
  docs = pathlib.Path(__file__).parent.parent / "docs" / "performance.md"
  assert hopper_check.table(rows) in docs.read_text()
  # Where the policy fixes the arithmetic the two paths' errors against
  # FP64 agree to the stored precision: a summation order, not a policy.
  for r in rows:
    tensors = [t for t in hopper_check.TENSORS if t in r]
    assert len(tensors) == (
      4 if hopper_check.differentiable(CASES[r["case"]]) else 1
    )
    for tensor in tensors:
      t = r[tensor]
      assert t["finite"] and t["largest_difference"] <= 2.0**-8
      assert abs(t["error_hopper"] / t["error_triton"] - 1) < 0.05


def test_docs_quote_the_stable_presets_regimes_on_both_paths():
  rows = _stored_rows("hopper-regimes-2026-11-29")
  docs = pathlib.Path(__file__).parent.parent / "docs" / "audit.md"
  assert hopper_check.regime_table(rows) in docs.read_text()
  # Every regime of both presets on both paths, and no verdict over zero
  # judged cases reads "passes".
  from stableattn.auditing.regimes import REGIMES

  regimes = list(REGIMES)
  assert {r["regime"] for r in rows} == set(regimes)
  keys = {(r["policy"], r["regime"], r["implementation"]) for r in rows}
  assert len(keys) == len(rows) == 2 * 2 * len(regimes)
  assert "passes (0 cases" not in hopper_check.regime_table(rows)


@pytest.mark.slow
def test_the_sinks_gradient_is_the_triton_paths():
  """d(sink) from the Hopper path's lse and delta, against the Triton
  path's: the same formula on rows that agree to a rounding."""
  case = CASES["sink"]
  (q, k, v, d_out), features = _inputs(case)
  sink = jnp.asarray(features["sink"])
  rest = {n: x for n, x in features.items() if n != "sink"}

  def d_sink(implementation):
    def loss(sink):
      out = sa.attention(
        q, k, v, implementation=implementation, precision=case[0],
        sink=sink, **rest,
      )  # fmt: skip
      return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))

    return np.asarray(jax.grad(loss)(sink), np.float64)

  ours, triton = d_sink("mosaic_gpu"), d_sink("pallas")
  assert np.all(ours != 0) and np.all(np.isfinite(ours))
  np.testing.assert_allclose(ours, triton, rtol=2e-2)


def test_flash_is_the_triton_path_in_interpret_mode_bit_for_bit():
  case = CASES["causal-gqa"]
  ours = _value_and_grads("flash", case)
  triton = _value_and_grads("pallas", case)
  for a, b in zip(ours, triton):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "request_, path",
  [
    ({}, "mosaic_gpu"),
    ({"causal": True, "local_window_size": (32, 0)}, "mosaic_gpu"),
    ({"precision": "fp32"}, "pallas"),  # wgmma takes 16-bit operands here
    ({"bias": np.zeros((1, 1, 128, 128), np.float32)}, "mosaic_gpu"),
    ({"precision": "bf16", "num_splits": 2}, "mosaic_gpu"),  # every stage
    ({"precision": "bf16-fa2+key_order=reversed"}, "pallas"),
    ({"block_q": 128}, "pallas"),  # not one warpgroup's rows
    ({"precision": "fp8-fa3"}, "pallas"),  # the gradient: Triton's only
  ],
  ids=str,
)
def test_flash_takes_the_hopper_path_on_hopper_where_it_runs_the_request(
  request_, path, monkeypatch
):
  from stableattn.ops import dispatch, flash_choice

  options, features = dispatch.split_keywords(
    None, None, {"precision": "bf16-fa2", "interpret": False, **request_}
  )
  shape = (1, 128, 2, 64)
  spec, _ = features.split(shape, shape)
  cfg = dispatch.kernel_config(options, shape, shape, spec)
  monkeypatch.setattr(flash_choice, "hopper_or_later", lambda: True)
  assert flash_choice.flash_path(cfg, options) == path
  monkeypatch.setattr(flash_choice, "hopper_or_later", lambda: False)
  assert flash_choice.flash_path(cfg, options) == "pallas"
