"""The audit in a kernel project's own test suite.

  from stableattn.testing import assert_audit_passes

  def test_my_kernel():
    assert_audit_passes(my_attention, precision="bf16-framework",
                        features="causal", baseline="audit_baseline.json")

`AttentionAuditTestBase` is the same as a suite to subclass with the
kernel and its `supports_*` flags; the pytest plugin (installed with
stableattn, `stableattn_pytest`) adds the `attention_audit` fixture and
--stableattn-baseline / --stableattn-update-baseline.
"""

from stableattn.testing.assertions import (
  AuditFailed,
  assert_audit_passes,
  kernel_name,
)
from stableattn.testing.suite import AttentionAuditTestBase

__all__ = [
  "AttentionAuditTestBase",
  "AuditFailed",
  "assert_audit_passes",
  "kernel_name",
]
