"""The format a training run computes in, and by which mixed-precision
convention: what each tensor class of `model.Transformer` is held in."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from stableattn.numerics.formats import to_dtype

# What "mixed precision" means besides attention, in the two conventions
# in use (docs/experiments.md has the table of every tensor class):
# "activations" (MaxText, jmp): parameters cast to the compute format on
# the way in, every activation in it (embedding output, residual stream,
# norms' outputs, MLP, logits), norm statistics in FP32; "autocast"
# (PyTorch's, the paper's framework): parameters stay FP32 and only each
# matmul's operands are cast, so the embedding output, the residual
# stream and the norms stay FP32. The loss is FP32 in both.
MIXED_PRECISION = ("activations", "autocast")
TRAINING_FORMATS = ("fp32", "bf16", "fp16")
# The tensor classes a low-precision run can keep in FP32, to find which
# carries its drift from FP32 training (docs/results.md). Together they
# cover the whole model, so a run that keeps all of them in FP32 is the
# FP32 run bit for bit: the embedding (its table and output, rounded as
# it enters the stream), the residual stream (the sums between blocks and
# the norms' scales), the attention projections (q, k, v, the attention's
# inputs, and the output projection, with their weights; the attention
# policy still rounds what it rounds), attention itself (its policy in
# FP32), the MLP (weights, products and GELU; its output rounded to the
# stream) and the head (the final norm and the tied logits).
FP32_CLASSES = (
  "embedding",
  "residual_stream",
  "attention_projections",
  "attention",
  "mlp",
  "head",
)


@dataclasses.dataclass(frozen=True)
class ComputeFormat:
  """The format a model computes in, and by which convention."""

  precision: str = "fp32"  # one of TRAINING_FORMATS
  mixed_precision: str = "activations"  # one of MIXED_PRECISION
  fp32_classes: tuple[str, ...] = ()  # of FP32_CLASSES, kept in FP32

  def __post_init__(self):
    if self.precision not in TRAINING_FORMATS:
      raise ValueError(
        f"Unknown training precision {self.precision!r}; valid: "
        f"{list(TRAINING_FORMATS)}."
      )
    if self.mixed_precision not in MIXED_PRECISION:
      raise ValueError(
        f"Unknown mixed_precision {self.mixed_precision!r}; valid: "
        f"{list(MIXED_PRECISION)} (MaxText's every activation in the "
        "compute format, or PyTorch autocast's matmul operands only)."
      )
    unknown = set(self.fp32_classes) - set(FP32_CLASSES)
    if unknown:
      raise ValueError(
        f"Unknown tensor classes {sorted(unknown)} to keep in FP32; valid: "
        f"{list(FP32_CLASSES)}."
      )
    if self.fp32_classes and self.precision == "fp32":
      raise ValueError(
        f"fp32_classes {list(self.fp32_classes)} keep parts of a bf16 or "
        "fp16 run in FP32; an fp32 run computes every class in FP32."
      )

  @property
  def dtype(self):
    """The compute format: every matmul's operands."""
    return to_dtype(self.precision)

  @property
  def activation_dtype(self):
    """The embedding output's and the residual stream's format under the
    convention."""
    if self.mixed_precision == "autocast":
      return jnp.dtype(jnp.float32)
    return self.dtype

  def dtype_of(self, tensor_class: str):
    """The format `tensor_class` (one of FP32_CLASSES) computes in: FP32
    where this format keeps it there, else the convention's."""
    if tensor_class not in FP32_CLASSES:
      raise ValueError(
        f"Unknown tensor class {tensor_class!r}; valid: {list(FP32_CLASSES)}."
      )
    if tensor_class in self.fp32_classes:
      return jnp.dtype(jnp.float32)
    if tensor_class in ("embedding", "residual_stream"):
      return self.activation_dtype
    return self.dtype

  @property
  def attention_precision(self) -> str:
    """The training format attention's policy follows."""
    return "fp32" if "attention" in self.fp32_classes else self.precision

  @property
  def casts_parameters(self) -> bool:
    """Whether the parameters enter the model in the compute format."""
    return self.mixed_precision == "activations"

  def record(self) -> dict:
    """The formats as a record says them (a capture's `capture.json`):
    q, k, v arrive in the compute format under both conventions, the
    residual stream only under "activations"."""
    record = {
      "precision": self.precision,
      "mixed_precision": self.mixed_precision,
      "compute": str(self.dtype),
      "residual_stream": str(self.dtype_of("residual_stream")),
    }
    if self.fp32_classes:
      record["fp32_classes"] = list(self.fp32_classes)
    return record
