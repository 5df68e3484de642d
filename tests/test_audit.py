"""The audit gates kernels: defects fail it, jax's kernels pass."""

import json
import os
import pathlib
import subprocess
import sys

import audit_kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import smoke_audit_config

import stableattn as sa
from stableattn.auditing import grid as audit
from stableattn.auditing import report as audit_report

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["xla", "jax_mha"])
def test_jax_kernels_pass(kernel, tmp_path):
  # jax's mha cannot trace causal masking with 64-bit mode on (its kernel
  # divides an int32 by an int64); the audit itself needs no FP64 in JAX.
  with jax.enable_x64(False):
    result = audit.run(smoke_audit_config(kernel), tmp_path)
  assert result["passed"], result["failures"]
  assert all(result["rules"].values())
  headline = json.loads((tmp_path / "headline.json").read_text())
  assert headline["kernel"] == kernel and headline["passed"] is True
  assert headline["environment"]["jax"] == jax.__version__
  report = (tmp_path / "report.md").read_text()
  assert "*Environment:*" in report.splitlines()[2]
  assert report.startswith(f"# Audit of `{kernel}`: **PASSED**")
  assert (tmp_path / "errors.png").stat().st_size > 0


FAST = dict(precisions="fp32", features="causal")


@pytest.mark.parametrize(
  "kernel, expected",
  [
    ("wrong_scale", "flashattention rule fails on out"),
    ("wrong_gradient", "flashattention rule fails on dq"),
    (
      "nondeterministic",
      "out at B1 T128 S128 H2/2 D32, normal inputs, seed 0, "
      "fp32, features causal differs between 2 identical runs",
    ),
    ("nan_rows", "NaN/Inf values in out"),
  ],
)
def test_defective_kernels_fail_and_the_report_says_why(
  kernel, expected, tmp_path
):
  result = audit.run(
    smoke_audit_config(f"audit_kernels:{kernel}", **FAST), tmp_path
  )
  assert result["passed"] is False
  assert any(expected in f for f in result["failures"]), result["failures"]
  report = (tmp_path / "report.md").read_text()
  assert "**FAILED**" in report.splitlines()[0]
  assert expected in report
  if kernel == "wrong_gradient":  # the forward itself is right
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").open()]
    out = [r for r in rows if r["tensor"] == "out"]
    assert all(r["flashattention_passed"] for r in out)


def _launch(*flags):
  env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
  return subprocess.run(
    [sys.executable, str(REPO / "launch" / "audit.py"), *flags],
    capture_output=True,
    text=True,
    env=env,
    cwd=REPO,
    timeout=300,
  )


@pytest.mark.slow  # a launcher process end to end (CI's slow tier)
def test_launcher_exit_code_gates_ci(tmp_path):
  smoke = "--config=smoke"
  bad = _launch(
    f"--workdir={tmp_path / 'bad'}",
    smoke,
    "--config.kernel=audit_kernels:wrong_scale",
    "--config.precisions=fp32",
  )
  assert bad.returncode == 1, bad.stderr[-2000:]
  headline = json.loads((tmp_path / "bad" / "headline.json").read_text())
  assert headline["passed"] is False and headline["verdict"] == "FAILED"
  # A person reads a summary: the verdict, the worst ratio per rule and
  # tensor, the first failures and the report's path.
  lines = bad.stdout.splitlines()
  assert lines[0] == "audit_kernels:wrong_scale: FAILED", bad.stdout
  worst = headline["worst_ratio"]["flashattention"]["out"]
  assert worst > 1 and f"out {worst:.3g}" in bad.stdout
  assert "flashattention rule fails on out" in bad.stdout
  assert lines[-1].endswith("report.md")


def _row(tensor, passed=True, deterministic=True, nonfinite=0):
  row = {
    "shape": "B1 T8 S8 H1/1 D4",
    "distribution": "normal",
    "seed": 0,
    "tensor": tensor,
    "policy": "bf16-framework",
    "features": "none",
    "deterministic": deterministic,
    "repeats": 3,
    "nonfinite": nonfinite,
    "max_abs": 1e-3,
    "baseline_max_abs": 2e-3,
    "cosine": 0.999,
    "snr_db": 50.0,
    "signed_share": 0.1,
  }
  for rule in audit_report.RULES:
    ok = passed or rule != "flashattention"
    row.update(
      {
        f"{rule}_value": 1.0 if ok else 3.0,
        f"{rule}_limit": 2.0,
        f"{rule}_passed": ok,
        f"{rule}_applies": rule != "flexattention" or tensor != "dk",
      }
    )
  return row


def test_verdict_and_headline_from_synthetic_rows():
  settings = audit.settings_from_config(smoke_audit_config("xla"))
  rows = [_row("out"), _row("dq", passed=False), _row("dk"), _row("dv")]
  table = audit_report.verdict_table(rows)
  assert "| bf16-framework | none | dq | FAIL 0/1 | pass 1/1 |" in table
  assert "| bf16-framework | none | dk | pass 1/1 | n/a |" in table
  result = audit_report.headline(settings, rows)
  assert result["passed"] is False
  assert result["rules"]["flashattention"] is False
  assert result["rules"]["flexattention"] is True
  (failure,) = result["failures"]
  assert failure.startswith("flashattention rule fails on dq at B1 T8 S8")
  assert "3 > limit 2" in failure
  rows = [_row("out", deterministic=False), _row("dq", nonfinite=2)]
  result = audit_report.headline(settings, rows)
  assert not result["passed"]
  assert not result["deterministic"] and not result["finite"]
  assert len(result["failures"]) == 2
  assert result["worst_ratio"]["flashattention"] == {"out": 0.5, "dq": 0.5}


def test_python_api_audits_gradients_too():
  report = sa.audit(audit_kernels.correct, precision="bf16-framework")
  assert report.passed, str(report)
  assert {r["tensor"] for r in report.rows} == {"out", "dq", "dk", "dv"}
  bad = sa.audit(audit_kernels.wrong_gradient, precision="bf16-framework")
  assert not bad.passed and "FAILED" in str(bad)
  assert all("on dq" in f or "on dk" in f or "on dv" in f for f in bad.failures)
  with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
    sa.audit(audit_kernels.correct, repeats=0)


@pytest.mark.slow
def test_fp8_audit_runs_our_kernel_at_fp8_against_the_same_format_baseline(
  tmp_path,
):
  # "auto" below 16 bits: the kernel runs the audited FP8 policy itself.
  settings = audit.settings_from_config(
    smoke_audit_config("pallas", precisions="fp8-fa3")
  )
  policy = sa.Precision.from_name("fp8-fa3")
  q = np.random.default_rng(0).standard_normal((1, 64, 1, 32))
  q = jnp.asarray(q, jnp.float16)
  np.testing.assert_array_equal(
    np.asarray(audit.kernel_fn(settings, policy)(q, q, q, causal=False)),
    np.asarray(sa.attention(q, q, q, precision=policy)),
  )
  fp8 = {**FAST, "precisions": "fp8-fa3"}
  result = audit.run(smoke_audit_config("pallas", **fp8), tmp_path)
  assert result["passed"], result["failures"]
  # The FP8 baseline errs more than an FP16 one, so the rule is looser
  # there; a kernel with a wrong softmax scale still fails it.
  bad = audit.run(
    smoke_audit_config("audit_kernels:wrong_scale", **fp8),
    tmp_path / "bad",
  )
  assert bad["passed"] is False


@pytest.mark.parametrize(
  "kernel, verdict, expected",
  [
    pytest.param(
      "split_by_batch",
      {"batch": False, "decode": True},
      "not batch-invariant (batch 1 vs 64): rows differ by",
      marks=pytest.mark.slow,
    ),
    (
      "decode_differs",
      {"batch": True, "decode": False},
      "not decode-invariant (last query over its prefix): rows differ by",
    ),
  ],
)
def test_invariance_gate_names_the_path_that_changes_a_row(
  kernel, verdict, expected, tmp_path
):
  """Split counts picked by batch size, and a decode path apart from
  prefill: right to the FlashAttention rule, flagged by name."""
  config = smoke_audit_config(
    f"audit_kernels:{kernel}",
    precisions="bf16-framework",
    features="none",
    invariances="batch,decode",
    gate="flashattention,invariance",
  )
  result = audit.run(config, tmp_path)
  assert result["rules"]["flashattention"]
  assert result["invariant"] == verdict
  assert result["passed"] is False
  assert any(expected in f for f in result["failures"]), result["failures"]
  headline = json.loads((tmp_path / "headline.json").read_text())
  assert headline["invariant"] == verdict
  report = (tmp_path / "report.md").read_text()
  assert "## Invariance" in report and "**differs**" in report


@pytest.mark.slow
def test_fixed_split_size_kernel_and_xla_pass_the_invariance_gate():
  """Our kernel with fixed tiles and a fixed split size keeps every row
  bitwise in BF16, however inference computes it; so does
  jax.nn.dot_product_attention on the CPU for decode, chunked prefill and
  a padded cache (its batch invariance depends on XLA's matmul choice per
  batch size, and it has no splits or pages). In FP32 an unmasked decode
  call and the causal pass are different programs, one ulp apart."""
  probes = "batch,decode,chunked_prefill,padded_cache"
  invariant = sa.Options(precision="bf16-fa2", split_size=64, fixed_tiles=True)
  ours = sa.audit(
    audit.resolve("pallas", invariant),
    precision="bf16-framework",
    shapes=((1, 128, 2, 64),),
    tensors=("out",),
    repeats=2,
    invariances=probes,
    gate=("flashattention", "invariance"),
  )
  assert ours.passed, ours.failures
  assert ours.invariant == dict.fromkeys(probes.split(","), True)
  assert any("shuffled pages" in r["detail"] for r in ours.invariance_rows)
  xla_fn = audit.resolve("xla", sa.Options(precision="bf16-framework"))
  xla = sa.audit(
    xla_fn,
    precision="bf16-framework",
    shapes=((1, 128, 2, 32),),
    tensors=("out",),
    repeats=2,
    invariances="decode,chunked_prefill,padded_cache,splits",
    gate=("flashattention", "invariance"),
  )
  assert xla.passed, xla.failures
  assert xla.invariant == {
    "decode": True,
    "chunked_prefill": True,
    "padded_cache": True,
    "splits": None,
  }
  reasons = {r["reason"] for r in xla.invariance_rows if r["invariant"] is None}
  assert "the kernel takes no page table" in reasons
  with pytest.raises(ValueError, match="Unknown invariances \\['batches'\\]"):
    sa.audit(xla_fn, invariances="batches")
  with pytest.raises(ValueError, match="unknown gate \\['invariant'\\]"):
    sa.audit(xla_fn, gate=("invariant",))


def test_invariance_and_kernel_option_settings_are_checked_before_running():
  with pytest.raises(ValueError, match="config: Unknown invariances"):
    audit.settings_from_config(
      smoke_audit_config("xla", invariances="batch,batches")
    )
  with pytest.raises(ValueError, match="applies to our implementations"):
    audit.settings_from_config(
      smoke_audit_config("jax_mha", kernel_options="split_size=64")
    )
  with pytest.raises(ValueError, match="Unknown Options fields"):
    audit.settings_from_config(
      smoke_audit_config("pallas", kernel_options="splits=4")
    )
  s = audit.settings_from_config(
    smoke_audit_config(
      "pallas", kernel_options="split_size=64", invariances="all"
    )
  )
  assert s.invariances == (
    "batch",
    "decode",
    "chunked_prefill",
    "padded_cache",
    "splits",
    "mixed_batch",
    "packed",
    "backward_batch",
    "causal_leak",
    "key_shift",
    "value_shift",
  )
  fn = audit.kernel_fn(s, sa.Precision.from_name("bf16-framework"))
  assert fn.keywords["options"].split_size == 64
  assert fn.keywords["options"].precision.name == "bf16-fa2"


def test_list_arguments_take_one_form_everywhere():
  """A comma string, a list and a tuple name the same distributions, gates
  and tensors; a string is never taken apart into letters."""
  from stableattn.contract.arguments import names

  assert names("normal, uniform", "d") == ("normal", "uniform")
  assert names(["normal", "uniform"], "d") == names(("normal", "uniform"), "d")
  assert names("normal", "d") == ("normal",)
  assert names(None, "d") == names("", "d") == ()
  with pytest.raises(ValueError, match="distributions must be names"):
    names(3, "distributions")
  with pytest.raises(ValueError, match="must be strings"):
    names(["normal", 2], "distributions")

  def kernel(q, k, v):
    return jax.nn.dot_product_attention(q, k, v)

  shape = [(1, 32, 1, 16)]
  by_string = sa.audit(
    kernel,
    shapes=shape,
    distributions="normal,uniform",
    gate="flashattention",
    tensors="out",
    repeats=1,
  )
  by_list = sa.audit(
    kernel,
    shapes=shape,
    distributions=["normal", "uniform"],
    gate=["flashattention"],
    tensors=("out",),
    repeats=1,
  )
  assert by_string.rows == by_list.rows and by_string.passed
  assert {r["distribution"] for r in by_string.rows} == {"normal", "uniform"}
