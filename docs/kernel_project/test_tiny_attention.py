"""tiny_attention's numerics, judged by stableattn's audit against FP64
under four projects' rules; audit_baseline.json records what is known."""

import tiny_attention

from stableattn.testing import AttentionAuditTestBase


class TinyAttentionAuditTest(AttentionAuditTestBase):
  """Plain and causal attention in FP32 and BF16, output and gradients."""

  attention_fn = staticmethod(tiny_attention.attention)
  supports_gqa = False  # it takes as many KV heads as query heads
  precisions = ("fp32", "bf16-framework")
  shape = (1, 128, 2, 32)


def test_edge_regimes(attention_audit):
  """Huge logits and keys that tie for a row's maximum."""
  for precision in ("fp32", "bf16-framework"):
    attention_audit(
      tiny_attention.attention,
      precision=precision,
      shapes=[(1, 128, 2, 32)],
      regimes="large_logits,tied_maxima",
      repeats=2,
    )
