"""stableattn.testing: the audit as an assertion, its baseline, the test
base class, and the pytest plugin (which imports nothing heavy)."""

import json
import os
import subprocess
import sys
import unittest

import audit_kernels
import jax
import pytest

from stableattn.auditing import ci_reports
from stableattn.auditing.inputs import Shape
from stableattn.testing import (
  AttentionAuditTestBase,
  AuditFailed,
  assert_audit_passes,
  kernel_name,
)
from stableattn.testing.assertions import shape_spec

pytest_plugins = ["pytester"]
SMALL = {"precision": "fp32", "shapes": [(1, 64, 2, 16)], "repeats": 2}


def good(q, k, v, *, causal=False):
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def off_by(scale):
  def kernel(q, k, v, *, causal=False):
    return good(q, k, v, causal=causal) * scale

  return kernel


def test_a_good_kernel_passes_and_a_wrong_one_names_its_cases():
  assert assert_audit_passes(good, **SMALL).passed
  with pytest.raises(AuditFailed) as failed:
    assert_audit_passes(audit_kernels.wrong_scale, features="causal", **SMALL)
  message = str(failed.value)
  assert "audit_kernels:wrong_scale fails the audit" in message
  assert "| fp32 | none | causal | flashattention | dq" in message
  command = next(x for x in message.splitlines() if "reproduce:" in x)
  assert "stableattn audit" in command
  assert "--config.kernel=audit_kernels:wrong_scale" in command
  assert "--config.shapes='((1, 64, 64, 2, 2, 16),)'" in command
  assert "--config.features=causal" in command
  assert failed.value.failing and not failed.value.report.passed


def test_shape_labels_read_back():
  for shape in (Shape(2, 1, 300, 8, 2, 64), Shape(1, 96, 96, 4, 2, 192, 128)):
    assert shape_spec(shape.label) == shape.spec
  assert kernel_name(good) == f"{__name__}:good"


def test_a_baseline_passes_known_findings_and_fails_new_and_worse(tmp_path):
  baseline = tmp_path / "baseline.json"
  ci_reports.write_baseline(baseline, {"other:kernel | x | y | z | r | t": 2.0})
  small = {**SMALL, "tensors": ("out",), "baseline": baseline, "name": "k"}
  assert_audit_passes(off_by(1.01), update_baseline=True, **small)
  recorded = json.loads(baseline.read_text())["failures"]
  assert "other:kernel | x | y | z | r | t" in recorded  # kept
  assert list(ci_reports.of_kernel(recorded, "k")) == [
    "k | fp32 | none | none | flashattention | out"
  ]
  assert assert_audit_passes(off_by(1.01), **small).rows
  with pytest.raises(AuditFailed, match="0 new and 1 worse"):
    assert_audit_passes(off_by(1.05), **small)
  with pytest.raises(AuditFailed, match="1 new and 0 worse"):
    assert_audit_passes(off_by(1.01), **{**small, "features": "causal"})
  with pytest.raises(ValueError, match="needs a baseline path"):
    assert_audit_passes(good, update_baseline=True, **SMALL)


class GoodKernelAuditTest(AttentionAuditTestBase):
  attention_fn = staticmethod(good)
  precisions = ("fp32",)
  shape = (1, 64, 2, 16)


class BrokenKernelAudit(AttentionAuditTestBase):  # run below, not collected
  __test__ = False
  attention_fn = staticmethod(off_by(1.01))
  precisions = ("fp32",)
  shape = (1, 64, 2, 16)
  supports_gqa = False


def test_the_base_class_fails_a_broken_kernel_and_skips_what_it_lacks():
  suite = unittest.defaultTestLoader.loadTestsFromTestCase(BrokenKernelAudit)
  result = unittest.TestResult()
  suite.run(result)
  failed = sorted(
    t.id().rsplit(".", 1)[1].split(" ")[0] for t, _ in result.failures
  )
  assert failed == ["test_audit_causal", "test_audit_plain"], result.errors
  skipped = dict((t.id().rsplit(".", 1)[1], why) for t, why in result.skipped)
  assert "supports_gqa" in skipped["test_grouped_query_attention"]
  assert "supports_segment_ids" in skipped["test_audit_segment_ids"]
  assert "no regimes" in skipped["test_edge_regimes"]


def test_the_plugin_imports_nothing_heavy():
  code = "import stableattn_pytest, sys; print('jax' in sys.modules)"
  done = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
  )
  assert done.stdout.strip() == "False", done.stderr


def test_the_fixture_records_and_judges_a_baseline(pytester):
  pytester.makepyfile(
    test_kernel="""
      import jax

      def kernel(q, k, v):
        return jax.nn.dot_product_attention(q, k, v) * 1.01

      def test_kernel(attention_audit):
        attention_audit(kernel, precision="fp32", shapes=[(1, 64, 2, 16)],
                        repeats=2, tensors=("out",))
    """
  )
  assert pytester.runpytest("-p", "no:cacheprovider").ret == 1
  recorded = pytester.runpytest(
    "--stableattn-baseline=known.json", "--stableattn-update-baseline"
  )
  assert recorded.ret == 0
  assert pytester.runpytest("--stableattn-baseline=known.json").ret == 0
  unset = pytester.runpytest("--stableattn-update-baseline")
  assert unset.ret != 0
  assert "STABLEATTN_UPDATE_BASELINE" not in os.environ  # restored
  assert "STABLEATTN_BASELINE" not in os.environ
