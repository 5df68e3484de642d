"""The audit goes on past a kernel's errors: error rows with reproducing
commands, kernels with no VJP, kernels in torch's layout, the FP32 floor
that logits an ulp apart leave, and what the launchers print."""

import json

import audit_kernels
import numpy as np
import pytest
from helpers import smoke_audit_config

import stableattn as sa
from stableattn.auditing import grid as audit
from stableattn.auditing import report as audit_report
from stableattn.contract import golden as sa_golden

FAST = dict(precisions="fp32", features="causal")


def test_a_kernel_that_raises_on_some_cases_is_judged_on_the_rest(tmp_path):
  config = smoke_audit_config(
    "audit_kernels:raises_on_causal",
    precisions="fp32,bf16-framework",
    features="none;causal",
  )
  result = audit.run(config, tmp_path)
  assert result["passed"] is False and result["verdict"] == "ERRORS"
  assert result["failures"] == []  # the cases that ran are right
  assert {e["policy"] for e in result["errors"]} == {"fp32", "bf16-framework"}
  for e in result["errors"]:
    assert e["features"] == "causal"
    assert e["error"].startswith("NotImplementedError: causal masking")
    assert "--config.features=causal" in e["command"]
  rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").open()]
  assert {r["features"] for r in rows} == {"none"} and len(rows) == 8
  report = (tmp_path / "report.md").read_text()
  assert report.startswith(
    "# Audit of `audit_kernels:raises_on_causal`: **ERRORS**"
  )
  assert "## Errors: cases the kernel raised on" in report


def test_a_kernel_without_a_vjp_is_judged_on_its_output():
  report = sa.audit(
    audit_kernels.no_vjp, precision="fp32", shapes=[(1, 32, 1, 16)],
    repeats=2,
  )  # fmt: skip
  assert report.passed, str(report)
  assert [r["tensor"] for r in report.rows] == ["out"]
  assert report.rows[0]["gradients"].startswith("n/a: the kernel has no VJP")
  wrong = sa.audit(
    lambda q, k, v: audit_kernels.no_vjp(q * 2, k, v), precision="fp32",
    shapes=[(1, 32, 1, 16)], repeats=2,
  )  # fmt: skip
  assert not wrong.passed


def test_a_kernel_in_torch_layout_gives_the_transposed_kernels_report():
  audited = dict(precision="bf16-framework", shapes=[(1, 48, 2, 16)],
                 causal=True, repeats=2)  # fmt: skip
  ours = sa.audit(audit_kernels.correct, **audited)
  theirs = sa.audit(audit_kernels.bhsd_correct, layout="bhsd", **audited)
  assert theirs.rows == ours.rows and theirs.passed
  assert "layout bhsd" in str(theirs)
  with pytest.raises(ValueError, match="layout must be one of"):
    sa.audit(audit_kernels.correct, layout="bsdh", **audited)


def test_a_kernel_that_cannot_be_imported_is_one_line(tmp_path):
  with pytest.raises(ValueError, match="Cannot import module") as raised:
    audit.run(
      smoke_audit_config("no_such_module_xyz:attention", **FAST), tmp_path
    )
  assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
  "kernel, message",
  [
    (
      "audit_kernels:no_causal_argument",
      "does not accept the feature\\(s\\) \\['causal'\\]",
    ),
    ("audit_kernels:wrong_shape", "the kernel returned \\(1, 128, 2, 8\\)"),
    ("audit_kernels:integer_output", "the kernel returned dtype int32"),
  ],
)
def test_a_case_that_breaks_the_contract_is_an_error_row(
  kernel, message, tmp_path
):
  import re

  result = audit.run(
    smoke_audit_config(kernel, precisions="fp32", features="none;causal"),
    tmp_path,
  )
  assert result["verdict"] in ("ERRORS", "FAILED, ERRORS")
  assert all(re.search(message, e["error"]) for e in result["errors"])
  causal = [e for e in result["errors"] if e["features"] == "causal"]
  assert causal and "\n" not in causal[0]["error"]
  if kernel.endswith("no_causal_argument"):  # the other set is judged
    assert len(result["errors"]) == 1 and result["failures"] == []


def test_the_worst_ratio_keeps_a_nan_and_a_miss_of_a_zero_limit():
  def row(tensor, value, limit):
    return {"tensor": tensor, "r_applies": True, "r_value": value,
            "r_limit": limit}  # fmt: skip

  worst = audit_report.worst_ratios(
    [row("out", 3.0, 2.0), row("out", float("nan"), 1.0), row("out", 1, 2),
     row("dq", 1e-7, 0.0), row("dk", 0.0, 0.0)],
    ["r"],
  )["r"]  # fmt: skip
  assert np.isnan(worst["out"]) and worst["dq"] == np.inf
  assert worst["dk"] == 0.0


@pytest.mark.slow
def test_logits_an_ulp_apart_set_the_fp32_floor_at_large_logits():
  # Two keys tied at logit 4096 for every query, the rest far below: the
  # output moves by ulp(4096) |v1 - v2| / 2 when the logits move an ulp.
  q = np.zeros((1, 4, 1, 2))
  q[..., 0] = 64.0
  k = np.zeros((1, 8, 1, 2))
  k[0, :2, 0, 0] = 64.0 * np.sqrt(2.0)  # scale 1/sqrt(2): logit 4096
  v = np.random.default_rng(0).standard_normal((1, 8, 1, 2))
  bound = sa_golden.logit_sensitivity(q, k, v, np.float32)
  expected = np.spacing(np.float32(4096)) * np.abs(v[0, 0] - v[0, 1]) / 2
  np.testing.assert_allclose(bound[0, :, 0], np.broadcast_to(expected, (4, 2)))
  # Eager FP32 attention with the scale on q and k (PyTorch's math path)
  # misses 2x the Baseline's error by 1.28x at this shape without the
  # floor and passes with it; a wrong scale still fails.
  edges = dict(precision="fp32", shapes=[(1, 128, 2, 64)], repeats=2,
               regimes="large_logits")  # fmt: skip
  assert sa.audit(audit_kernels.scales_q_and_k, **edges).passed
  assert not sa.audit(audit_kernels.wrong_scale, **edges).passed
  # At (1, 200, 200, 2, 2, 64) the same kernel's gradients miss 3x the
  # Baseline's error by up to 1.6x (dQ) without the gradients' floor
  # (golden.gradient_logit_sensitivity) and pass with it; 1.5x gradients
  # still fail.
  edges["shapes"] = [(1, 200, 200, 2, 2, 64)]
  assert sa.audit(audit_kernels.scales_q_and_k, **edges).passed
  assert not sa.audit(audit_kernels.wrong_gradient, **edges).passed


def test_gradients_move_by_what_logits_an_ulp_apart_do():
  # Two keys at logits 4096 and 4095.75 hold every row (P about 0.56 and
  # 0.44): logit errors within u = ulp(4096) move each P by P_1 P_2
  # (e_1 - e_2), at most 2 u P_1 P_2, so dV at each of them by at most
  # that times sum_i |dO_i|; the other keys' P is exp(-4096) = 0, and
  # stays 0, so their dV cannot move.
  q = np.zeros((1, 4, 1, 2))
  q[..., 0] = 64.0
  k = np.zeros((1, 8, 1, 2))
  k[0, :2, 0, 0] = 64.0 * np.sqrt(2.0)  # scale 1/sqrt(2): logit 4096
  k[0, 1, 0, 0] -= 0.25 / 64.0 * np.sqrt(2.0)
  rng = np.random.default_rng(0)
  v = rng.standard_normal((1, 8, 1, 2))
  d_out = rng.standard_normal((1, 4, 1, 2))
  dq, dk, dv = sa_golden.gradient_logit_sensitivity(q, k, v, d_out, np.float32)
  u = np.spacing(np.float32(4096))
  p_1 = 1.0 / (1.0 + np.exp(-0.25))
  most = 2 * u * p_1 * (1 - p_1) * np.abs(d_out[0, :, 0]).sum(axis=0)
  assert np.all(dv[0, :2, 0] <= most * (1 + 1e-6))
  assert np.all(dv[0, :2, 0] >= most / 50)
  assert not np.any(dv[0, 2:]) and not np.any(dk[0, 2:])
  assert dq.shape == q.shape and np.all(dq[..., 0] > 0)
  # Equal logits round alike: with the two keys tied no P moves.
  k[0, 1] = k[0, 0]
  tied = sa_golden.gradient_logit_sensitivity(q, k, v, d_out, np.float32)
  assert not any(np.any(g) for g in tied)


def test_a_launchers_summary_puts_verdicts_first_and_points_to_json():
  from stableattn.commands.launcher import summary

  result = {
    "workdir": "runs/x",
    "seconds": 3.5,
    "environment": {"jax": "0"},
    "paper_verdicts": {"fig8": "reproduced"},
    "sizes": [1, 2],
  }
  lines = summary(result, most=1).splitlines()
  assert lines == [
    "  paper_verdicts.fig8: reproduced",
    "  ... 1 more (--json)",
    "  report: runs/x",
  ]


def test_the_errors_section_lists_the_first_twenty_with_their_commands():
  error = dict(shape="B1 T8 S8 H1/1 D4", distribution="normal", seed=0,
               policy="fp32", features="none", error="TypeError: no",
               command="python launch/audit.py --config.kernel=k")  # fmt: skip
  lines = audit_report.errors_section([error] * 22)
  assert lines[:2] == ["## Errors: cases the kernel raised on", ""]
  assert sum(line.startswith("- the kernel raised on") for line in lines) == 20
  assert "  `python launch/audit.py --config.kernel=k`" in lines
  assert lines[-2] == "- ... and 2 more (errors.csv)"


def test_a_tensor_that_is_exactly_zero_has_an_snr_not_an_error():
  from stableattn.auditing.measure import quality

  zero = np.zeros((2, 3))
  assert quality(zero, zero + 1e-7)["snr_db"] == -np.inf
  assert quality(zero, zero)["snr_db"] == np.inf


def test_a_fully_masked_decode_row_leaves_a_row_to_judge():
  from stableattn.auditing import regimes
  from stableattn.auditing.inputs import Shape

  cases = regimes.edge_cases("finite_mask", Shape(4, 1, 37, 2, 2, 32), "fp32")
  masked = [c for c in cases if "fully masked" in c.detail]
  assert masked
  for case in masked:
    rows = np.asarray(case.checks.unjudged_rows)
    assert rows.any() and not rows.all(), case.detail
    assert case.q.shape[0] == rows.shape[0] == 2


def _failing_mosaic_kernel():
  """A Mosaic GPU kernel whose interpretation raises: a TMA copy of FP64
  into an FP32 buffer (jax's interpreter asserts the types agree)."""
  import jax
  import jax.numpy as jnp
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def kernel(x_ref, o_ref):
    def body(smem, barrier):
      plgpu.copy_gmem_to_smem(x_ref, smem, barrier.at[0])
      plgpu.barrier_wait(barrier.at[0])
      o_ref[...] = smem[...]

    pl.run_scoped(
      body, plgpu.SMEM((128,), jnp.float32), plgpu.Barrier(num_barriers=1)
    )

  call = plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
    interpret=InterpretGPUParams(),
  )
  return jax.block_until_ready(call(jnp.zeros(128, jnp.float64)))


def test_a_case_the_gpu_interpreter_raised_on_does_not_fail_the_next():
  """jax's GPU interpreter keeps its state after a kernel raises, and
  every kernel after it fails too: the audit resets it with each error
  row, so the next case of the Hopper path is judged, not failed."""
  import jax.numpy as jnp

  from stableattn.auditing.kernel_audit import measured_or_error

  label, policy = {"shape": "s"}, sa.Precision.from_name("bf16-fa2")
  rows, errors = measured_or_error(_failing_mosaic_kernel, label, policy)
  assert not rows and len(errors) == 1
  q = jnp.ones((1, 64, 1, 64), jnp.bfloat16)

  def attention():
    return [sa.attention(q, q, q, implementation="mosaic_gpu")]

  rows, errors = measured_or_error(attention, label, policy)
  assert not errors and np.all(np.isfinite(np.asarray(rows[0], np.float32)))
