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


@dataclasses.dataclass(frozen=True)
class ComputeFormat:
  """The format a model computes in, and by which convention."""

  precision: str = "fp32"  # one of TRAINING_FORMATS
  mixed_precision: str = "activations"  # one of MIXED_PRECISION

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

  @property
  def dtype(self):
    """The compute format: every matmul's operands."""
    return to_dtype(self.precision)

  @property
  def activation_dtype(self):
    """The embedding output's and the residual stream's format."""
    if self.mixed_precision == "autocast":
      return jnp.dtype(jnp.float32)
    return self.dtype

  @property
  def casts_parameters(self) -> bool:
    """Whether the parameters enter the model in the compute format."""
    return self.mixed_precision == "activations"

  def record(self) -> dict:
    """The formats as a record says them (a capture's `capture.json`):
    q, k, v arrive in the compute format under both conventions, the
    residual stream only under "activations"."""
    return {
      "precision": self.precision,
      "mixed_precision": self.mixed_precision,
      "compute": str(self.dtype),
      "residual_stream": str(self.activation_dtype),
    }
