"""The straight-through backward of a quantizing forward, as the
emulator computes it (see `stableattn/kernels/quantization.py`)."""

from __future__ import annotations

import numpy as np
from emulator_arithmetic import LARGEST, Emulator, per_channel, quantize_inputs


def straight_through(q, k, v, stages, options, block_q, block_k):
  """The operands a quantizing forward's matmuls saw, round(x / s) * s in
  FP32 (after the rotation), and the backward's stages: every stage below
  16 bits but `inputs` in FP32 (documented straight-through backward)."""
  em = Emulator(stages, options)
  q, k, v = (em.r(x, "inputs") for x in (q, k, v))
  q, k, v, scales = quantize_inputs(em, q, k, v, block_q, block_k)
  if em.micro:
    seen = [q, k, v]
    scales = ()
  else:
    seen = []
  for name, x, s in zip("qkv", (q, k, v), scales):
    if name == "v" and per_channel(em):
      s = s[:, None]  # [B, 1, heads, D]
    else:
      s = s.transpose(0, 2, 1)[..., None]  # [B, T, heads, 1]
    scaled = (x * (np.float32(1) / s)).astype(np.float32)
    seen.append(em.r(scaled, "matmul_operands") * s)
  wide = {
    stage: "fp32" if fmt in LARGEST and stage != "inputs" else fmt
    for stage, fmt in stages.items()
  }
  return seen, wide
