"""stableattn: how far does flash attention deviate from plain attention?

Public API:
  attention(q, k, v, *, implementation, precision, block_q, block_k, scheme,
            causal, interpret)
  golden_attention(q, k, v, causal) / golden_attention_vjp(...)
  compare(expected, actual) -> Deviation; error_ratio; passes_fa_rule
  round_to(x, format): x rounded to a format (FP8/FP4 casts saturate)
  Precision, preset_names; tiles_from_sram
  check(fn, precision=..., shapes=...) -> CheckReport (FlashAttention rule)
  audit(fn, precision=..., shapes=..., causal=...) -> AuditReport: output
    and gradients under four projects' rules, determinism, NaN/Inf
  make_attention_fn(...) -> attention_fn for flax.nnx.MultiHeadAttention
"""

from stableattn.audit import AuditReport, audit
from stableattn.check import CheckReport, check
from stableattn.dispatch import IMPLEMENTATIONS, attention
from stableattn.flax_attention import make_attention_fn
from stableattn.golden import golden_attention, golden_attention_vjp
from stableattn.metrics import (
  Deviation,
  compare,
  error_ratio,
  passes_fa_rule,
  rounding_floor,
)
from stableattn.pallas_forward import SCHEMES
from stableattn.precision import STAGES, Precision, preset_names
from stableattn.rounding import round_to
from stableattn.tiling import tiles_from_sram

__all__ = [
  "IMPLEMENTATIONS",
  "AuditReport",
  "SCHEMES",
  "STAGES",
  "CheckReport",
  "Deviation",
  "Precision",
  "attention",
  "audit",
  "check",
  "compare",
  "error_ratio",
  "golden_attention",
  "golden_attention_vjp",
  "make_attention_fn",
  "passes_fa_rule",
  "preset_names",
  "round_to",
  "rounding_floor",
  "tiles_from_sram",
]
