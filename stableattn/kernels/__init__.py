"""The implementations: the Pallas flash-attention forward and backward
kernels (with their block math, operand specs and quantization), the
differentiable wrapper that pads and ties them together, and the
materialized Baseline and XLA attention under the same policy.

May import `stableattn.numerics` and `stableattn.contract`.
"""
