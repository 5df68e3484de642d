"""A test base class a kernel project subclasses: its kernel and what the
kernel supports, and the audit's cases come with it (absltest-style, as
tokamax's and JAX's suites are; pytest runs it too).

  class MyKernelAuditTest(AttentionAuditTestBase):
    attention_fn = staticmethod(my_attention)
    supports_local_window = True
    precisions = ("bf16-framework", "fp32")
"""

from __future__ import annotations

import inspect
import os

from absl.testing import parameterized

from stableattn.testing.assertions import assert_audit_passes
from stableattn_pytest import BASELINE_VARIABLE, UPDATE_VARIABLE

# (test name, feature recipes, the supports_* flags it needs)
FEATURE_CASES = (
  ("plain", "none", ()),
  ("causal", "causal", ("supports_causal",)),
  (
    "local_window",
    "causal,window",
    ("supports_causal", "supports_local_window"),
  ),
  ("segment_ids", "segments", ("supports_segment_ids",)),
  ("softcap", "softcap", ("supports_softcap",)),
  ("lengths", "lengths", ("supports_lengths",)),
)


class AttentionAuditTestBase(parameterized.TestCase):
  """The audit of `attention_fn` as a test suite.

  Set on the subclass:
    attention_fn: the kernel, fn(q, k, v, **features) (a staticmethod or
      a plain function).
    supports_causal, supports_local_window, supports_segment_ids,
      supports_softcap, supports_lengths, supports_gqa (fewer KV heads
      than query heads), supports_gradients (False: the output alone is
      judged): which cases run; the others are skipped, saying why.
    precisions: input formats with their same-policy baselines.
    shape: (batch, length, heads, head_dim) of every case.
    regimes: edge regimes test_edge_regimes runs (names or "all"; empty:
      skipped). layout: "bshd" or "bhsd". gate: the rules that decide.
    baseline: a file of known findings (or $STABLEATTN_BASELINE);
      STABLEATTN_UPDATE_BASELINE=1 records the current failures there.
  """

  __test__ = False  # the base itself is not a suite; its subclasses are
  attention_fn = None
  name: str | None = None
  supports_causal = True
  supports_local_window = False
  supports_segment_ids = False
  supports_softcap = False
  supports_lengths = False
  supports_gqa = True
  supports_gradients = True
  precisions: tuple[str, ...] = ("bf16-framework",)
  shape: tuple[int, ...] = (1, 128, 2, 32)
  regimes: str | tuple[str, ...] = ()
  layout = "bshd"
  gate: tuple[str, ...] = ("flashattention", "flexattention")
  baseline: str | None = None

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls.__test__ = cls.__dict__.get("__test__", True)

  def _kernel(self):
    fn = inspect.getattr_static(self, "attention_fn")
    fn = fn.__func__ if isinstance(fn, staticmethod) else fn
    if fn is None:
      self.skipTest("the base class itself: a subclass sets attention_fn")
    return fn

  def _audit(self, **kwargs):
    fn = self._kernel()
    baseline = self.baseline or os.environ.get(BASELINE_VARIABLE) or None
    update = os.environ.get(UPDATE_VARIABLE, "") not in ("", "0")
    tensors = None if self.supports_gradients else ("out",)
    for precision in self.precisions:
      with self.subTest(precision=precision):
        assert_audit_passes(
          fn,
          baseline=baseline,
          update_baseline=update and baseline is not None,
          name=self.name,
          precision=precision,
          layout=self.layout,
          gate=self.gate,
          repeats=2,
          **({"tensors": tensors} if tensors else {}),
          **kwargs,
        )

  def _requires(self, flags) -> None:
    missing = [f for f in flags if not getattr(self, f)]
    if missing:
      self.skipTest(f"the kernel does not set {', '.join(missing)}")

  @parameterized.named_parameters(*FEATURE_CASES)
  def test_audit(self, features, needs):
    self._kernel()
    self._requires(needs)
    features = None if features == "none" else features
    self._audit(shapes=(self.shape,), features=features)

  def test_grouped_query_attention(self):
    self._kernel()
    self._requires(("supports_gqa",))
    batch, length, heads, head_dim = self.shape
    kv_heads = max(1, heads // 2)
    if kv_heads == heads:
      self.skipTest(f"{heads} query heads cannot be grouped")
    grouped = (batch, length, length, heads, kv_heads, head_dim)
    self._audit(shapes=(grouped,))

  def test_edge_regimes(self):
    self._kernel()
    if not self.regimes:
      self.skipTest("no regimes set (regimes = 'all' runs every one)")
    self._audit(shapes=(self.shape,), regimes=self.regimes)
