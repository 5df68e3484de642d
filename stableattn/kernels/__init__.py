"""The implementations: the Pallas flash-attention forward and backward
kernels (with their block math, operand specs and quantization), the
differentiable wrapper that pads and ties them together, and the
materialized Baseline and XLA attention under the same policy.

May import `stableattn.numerics` and `stableattn.contract`.
"""

# Our Triton kernels' lowerings drop jax 0.11's Triton deprecation warning
# (and only that one, and only for them): `triton_deprecation`.
from stableattn.kernels import triton_deprecation  # noqa: E402, F401
