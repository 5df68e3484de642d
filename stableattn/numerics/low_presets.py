"""The precision presets below 16 bits: FlashAttention-3's FP8 baseline
and kernel, SageAttention's choices, NVFP4, and Hopper's FP8 accumulator
with and without two-level accumulation (see `precision.py`)."""

from __future__ import annotations


def low_presets(make) -> dict:
  """The presets below 16 bits, each built by `make` (`Precision`)."""
  presets = {}
  # FlashAttention-3, Table 3 (FP8 e4m3): the baseline scales each of Q, K,
  # V once per tensor, accumulates matmuls in FP32 and keeps the softmax
  # intermediates in FP16; FlashAttention-3 scales per tile ("block
  # quantization") and rotates Q and K ("incoherent processing"), with
  # FP32 statistics. Ablations: "+block_quant=off", "+hadamard=off".
  fp8 = dict(
    inputs="fp16",
    matmul_operands="fp8_e4m3",
    matmul_accum="fp32",
    probs="fp8_e4m3",
    out_accum="fp32",
    output="fp16",
    delta="fp32",
    grad_accum="fp32",
  )
  presets["fp8-baseline"] = make(
    name="fp8-baseline",
    scores="fp16",
    softmax_stats="fp16",
    scaling="tensor",
    **fp8,
  )
  presets["fp8-fa3"] = make(
    name="fp8-fa3",
    scores="fp32",
    softmax_stats="fp32",
    scaling="block",
    hadamard=True,
    **fp8,
  )
  # SageAttention 2's choices (Zhang et al., arXiv 2411.10958) in FP8: K
  # smoothed, Q and K scaled per token, P scaled by a static 448 and V per
  # channel, all e4m3. SageAttention 2 itself quantizes Q and K to INT4 or
  # INT8 (here one operand format serves both matmuls), smooths Q as well,
  # and accumulates P V in a 22-bit format (here FP32).
  presets["fp8-sage"] = make(
    name="fp8-sage",
    scores="fp32",
    softmax_stats="fp32",
    scaling="token",
    smooth_k=True,
    p_scale=448.0,
    **fp8,
  )
  presets.update(_accumulator_presets(make, fp8))
  # An NVFP4 attention (SageAttention 3's format, arXiv 2505.11594): Q, K,
  # P and V in e2m1 with one e4m3 scale per 16 values along each matmul's
  # contraction and one FP32 scale per tensor (P's static); FP32 softmax.
  presets["fp4-nvfp4"] = make(
    name="fp4-nvfp4",
    scores="fp32",
    softmax_stats="fp32",
    scaling="nvfp4",
    **{**fp8, "matmul_operands": "fp4_e2m1", "probs": "fp4_e2m1"},
  )
  return presets


def _accumulator_presets(make, fp8: dict) -> dict:
  """FP8 presets with the tensor core's accumulator (`mma_chunk`)."""
  presets = {}
  # FlashAttention-3's FP8 forward on Hopper as vLLM serves it before
  # two-level accumulation (vllm #23813, #15865): BF16 model, Q, K, V and P
  # in e4m3 with per-tensor scales, no rotation; the WGMMA accumulator adds
  # 32 products at a time keeping about 14 significant bits, truncating
  # (DeepSeek-V3, arXiv 2412.19437, section 3.3.2: fp22 here), and the
  # running output stays in it for the whole row.
  hopper = dict(
    fp8,
    inputs="bf16",
    output="bf16",
    matmul_accum="fp22",
    scores="fp32",
    softmax_stats="fp32",
    scaling="tensor",
    mma_chunk=32,
    mma_rounding="truncate",
  )
  presets["fp8-fa3-hopper"] = make(
    name="fp8-fa3-hopper", promote_every=0, **hopper
  )
  # The fix: each key tile's P V promoted into an FP32 accumulator
  # (vllm-project/flash-attention #104, Dao-AILab/flash-attention #2250).
  presets["fp8-fa3-two-level"] = make(
    name="fp8-fa3-two-level", promote_every=1, **hopper
  )
  return presets
