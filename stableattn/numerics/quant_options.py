"""Options of a precision policy: for matmul operands below 16 bits
scaling, P's scale, rotation and K smoothing; for any policy the key order
and the softmax's base (exp2); their text in a policy name and their
validation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from stableattn.numerics.precision import Precision

# Formats of 16 bits or more; policies with operands in one take no
# quantization option.
WIDE_FORMATS = ("fp64", "fp32", "fp16", "bf16")

# Quantization options of a policy with operands below 16 bits:
QUANT_OPTIONS = {
  # "none": operands are rounded as they are (values beyond the format
  # saturate); "tensor": one scale per array (Q, K, V), amax / max finite;
  # "block": one scale per kernel tile of block_q query or block_k key rows
  # of one (batch, head). Scales are applied before the cast and removed
  # after the matmul, in FP32 (FlashAttention-3's descaling).
  # "token": one scale per row of Q and of K (each token) and one per
  # channel of V (a V scale must be constant along the P V sum over keys
  # to be removed after it; SageAttention's choice).
  # Microscaling, one scale per group of consecutive values along each
  # matmul's contraction (Q and K along the head dim, P and V along keys),
  # applied inside the matmul as block-scaled tensor cores do: "mx" (OCP
  # MX: groups of 32, power-of-two scales) and "nvfp4" (groups of 16,
  # e4m3 scales times one FP32 scale per tensor; e2m1 values only).
  "scaling": ("none", "tensor", "block", "token", "mx", "nvfp4"),
  # P is multiplied by this before its cast to `probs` and divided out of
  # P V after it (e.g. 448 or 256 for e4m3, whose subnormals end at 2^-9).
  "p_scale": "a number > 0",
  # Q and K rotated by one random orthogonal matrix (random signs times a
  # normalized Hadamard matrix) along the head dimension before scaling:
  # QK^T is unchanged in exact arithmetic, outliers are spread out
  # (FlashAttention-3's incoherent processing; head dim a power of two).
  "hadamard": (False, True),
  # Order in which the forward kernel visits key blocks.
  "key_order": ("forward", "reversed"),
  # The forward softmax in base 2 (any policy): the one multiplier of Q K^T
  # carries log2(e) and P = 2^(s - m), as FlashAttention-2, jax's Triton
  # `mha` and the Triton tutorial compute it (one multiply and the GPU's
  # native exp2 instead of exp's range reduction). Scores, running max and
  # sum are then in base 2, rounded where the natural ones were; lse is
  # stored in natural log. The Baseline follows it; the backward does not
  # (it recomputes P from the natural lse).
  "exp2": (False, True),
  # K minus its mean over tokens (per batch, head and channel) before the
  # rotation and scaling: each score row moves by one constant, which
  # softmax removes (SageAttention's smoothing of K; not with a softcap).
  "smooth_k": (False, True),
  # The tensor core's accumulator (forward kernel, any policy). With
  # mma_chunk = k > 0 a matmul adds its reduction k products at a time
  # (the MMA's depth: 32 for FP8 WGMMA, 16 for BF16) into an accumulator
  # held in `matmul_accum`, each add rounded by mma_rounding: QK^T over the
  # head dim from zero, P V over a tile's keys into the running output.
  # Hopper's FP8 accumulator keeps about 14 bits (DeepSeek-V3, arXiv
  # 2412.19437, section 3.3.2): fp22 with truncation. 0: the whole
  # reduction summed in the carrier and rounded once.
  "mma_chunk": "an integer >= 0",
  "mma_rounding": ("nearest", "truncate"),
  # QK^T's sum over the head dim taken k products at a time (static
  # slices of Q's and K's columns), the chunk sums added pairwise in the
  # carrier and the total rounded once (blocked summation: an error bound
  # of about k + log2(D / k) roundings instead of D; Blanchard, Higham and
  # Mary, SIAM J. Sci. Comput. 42(3), 2020). A power of two >= 16 (the
  # smallest Triton dot); 0 leaves the order to the matmul. At
  # logits of hundreds the terms of a dot cancel, and XLA:CPU sums a
  # 64-key tile's FP32 dot with several times the Baseline's error.
  "score_chunk": "0 or a power of two >= 16",
  # Two-level accumulation: the P V accumulator is added into an FP32
  # output accumulator (and restarted) every n key tiles; 0 keeps the
  # running output in the MMA accumulator for the whole row, rescaled by
  # exp(m_old - m_new) in FP32 every tile (FlashAttention-3's FP8 kernel
  # before vllm-project/flash-attention #104). 1 is today's kernel.
  "promote_every": "an integer >= 0",
  # An FP8 KV cache read by 16-bit attention (FlashInfer, vLLM): K and V
  # stored as round(x / s) in e4m3 with one scale per tensor (amax / 448)
  # and dequantized to the `inputs` format before any math; Q untouched.
  "kv_cache": ("none", "fp8_e4m3"),
  # The flash backward's residuals (any policy; see docs/precision.md,
  # "Stable presets"). Where delta = rowsum(dO * O) takes O from:
  # "output", O as stored in `output` (FlashAttention-2/3, cuDNN, jax's
  # `mha`); "fp32", the normalized accumulator kept in `out_accum` as an
  # extra residual; "hi_lo", O's rounding residual O - round(O) stored
  # in `output` beside it and added back (O_hi + O_lo); "probs",
  # rowsum(P * dP) recomputed in the backward from its own P and dP
  # (eager attention's delta; two more matmuls per tile).
  "delta_source": ("output", "fp32", "hi_lo", "probs"),
  # How delta = rowsum(dO * O) is summed: "rowsum", products summed along
  # the row (FlashAttention-2/3's preprocess kernel, cuDNN); "matmul", O
  # rounded to `matmul_operands` through the matmul that forms dP = dO V^T
  # (the diagonal of dO O^T per query tile) and the rest of O as a row
  # sum. Where one key holds a row's probability, O is that key's V, and
  # dP - delta cancels exactly as in eager attention instead of leaving
  # two summation orders' difference in every dS of the row.
  "delta_product": ("rowsum", "matmul"),
  # The delta of d(sink) = -sum_i p_sink,i delta_i: "shared", the delta
  # dS uses; "probs", rowsum(P * dP) recomputed for it alone (two more
  # matmuls per tile, only in calls with a sink). A sink that holds a row
  # leaves its other P in FP16's subnormals, where O, rounded or not, no
  # longer carries delta; P in the carrier does.
  "sink_delta": ("shared", "probs"),
  # What the backward recomputes P from: "lse", one log-sum-exp per row,
  # P = exp(s - lse) (FlashAttention-2/3/4, cuDNN); "max_sum", the row's
  # max and sum apart, P = exp(s - m) * (1 / l) (tokamax), as the forward
  # normalized it.
  "softmax_residuals": ("lse", "max_sum"),
  # The forward's softmax sum l: "stats", the sum of P in
  # `softmax_stats`; "rounded_probs", the sum of P rounded to `probs`,
  # the P that multiplies V (Dao-AILab/flash-attention #2721).
  "softmax_sum": ("stats", "rounded_probs"),
  # How dS enters the backward's dQ = dS K: "rounded", rounded to `probs`
  # once (FlashAttention-2/3); "hi_lo", as dS_hi + dS_lo, both in `probs`
  # (two matmuls): where a row's largest scores tie, their dS cancel in
  # dQ and one rounding of each leaves what they cancel to.
  "ds_for_dq": ("rounded", "hi_lo"),
}
# Values per shared scale of each microscaling.
MICRO_GROUPS = {"mx": 32, "nvfp4": 16}
DEFAULT_OPTIONS = {
  "scaling": "none",
  "p_scale": 1.0,
  "hadamard": False,
  "key_order": "forward",
  "smooth_k": False,
  "exp2": False,
  "mma_chunk": 0,
  "mma_rounding": "nearest",
  "score_chunk": 0,
  "promote_every": 1,
  "kv_cache": "none",
  "delta_source": "output",
  "delta_product": "rowsum",
  "sink_delta": "shared",
  "softmax_residuals": "lse",
  "softmax_sum": "stats",
  "ds_for_dq": "rounded",
}
# Options that change what the flash kernel saves for, or how it
# normalizes before, its backward.
STABILITY_OPTIONS = (
  "delta_source",
  "delta_product",
  "sink_delta",
  "softmax_residuals",
  "softmax_sum",
  "ds_for_dq",
)


def option_text(value) -> str:
  if isinstance(value, bool):
    return "on" if value else "off"
  return f"{value:g}" if isinstance(value, float) else str(value)


def parse_option(option: str, text: str, name: str):
  """An option's value from its text in a policy name."""
  if option in ("hadamard", "block_quant", "smooth_k", "exp2"):
    if text in ("on", "true", "1"):
      return True
    if text in ("off", "false", "0"):
      return False
    raise ValueError(
      f"Bad value {text!r} for {option} in precision {name!r}; valid: on, off."
    )
  if option in ("mma_chunk", "promote_every", "score_chunk"):
    try:
      return int(text)
    except ValueError:
      raise ValueError(
        f"Bad value {text!r} for {option} in precision {name!r}; give an "
        "integer >= 0, e.g. 32."
      ) from None
  if option == "p_scale":
    try:
      return float(text)
    except ValueError:
      raise ValueError(
        f"Bad value {text!r} for p_scale in precision {name!r}; give a "
        "number > 0, e.g. 448."
      ) from None
  return text


def check_quant_options(policy: Precision) -> None:
  """Raises ValueError for options that are unknown or meaningless."""
  _check_accumulator(policy)
  _check_stability(policy)
  for option in ("scaling", "key_order", "kv_cache"):
    valid = QUANT_OPTIONS[option]
    if getattr(policy, option) not in valid:
      raise ValueError(
        f"Unknown {option} {getattr(policy, option)!r}; valid: {list(valid)}."
      )
  for option in ("hadamard", "smooth_k", "exp2"):
    if not isinstance(getattr(policy, option), bool):
      raise ValueError(
        f"{option} must be True or False, got {getattr(policy, option)!r}."
      )
  p_scale = policy.p_scale
  if (
    isinstance(p_scale, bool)
    or not isinstance(p_scale, (int, float))
    or not np.isfinite(p_scale)
    or p_scale <= 0
  ):
    raise ValueError(f"p_scale must be a finite number > 0, got {p_scale!r}.")
  object.__setattr__(policy, "p_scale", float(p_scale))
  low_probs = policy.probs not in WIDE_FORMATS
  if policy.scaling == "nvfp4" and (
    policy.matmul_operands != "fp4_e2m1"
    or (low_probs and policy.probs != "fp4_e2m1")
  ):
    raise ValueError(
      "scaling=nvfp4 scales e2m1 values (NVFP4): matmul_operands and a "
      f"probs format below 16 bits must be fp4_e2m1, not "
      f"{policy.matmul_operands} and {policy.probs}; or use scaling=mx."
    )
  if policy.scaling in MICRO_GROUPS and policy.matmul_operands == "int8":
    raise ValueError(
      f"scaling={policy.scaling} is built for float elements (fp8_e4m3, "
      "fp8_e5m2, fp4_e2m1); int8 takes none, tensor, block or token."
    )
  if policy.kv_cache != "none" and policy.matmul_operands not in WIDE_FORMATS:
    raise ValueError(
      f"kv_cache={policy.kv_cache} is an FP8 cache read by 16-bit math; "
      f"this policy's matmul operands are {policy.matmul_operands} "
      "already (quantized with `scaling`). Use it with bf16-fa2 or fp16-fa2."
    )
  if policy.matmul_operands in WIDE_FORMATS:
    # These prepare quantized operands; on wide ones they would be ignored.
    for option, value in (
      ("scaling", policy.scaling),
      ("hadamard", policy.hadamard),
      ("smooth_k", policy.smooth_k),
    ):
      if value != DEFAULT_OPTIONS[option]:
        raise ValueError(
          f"{option}={option_text(value)} needs matmul operands below 16 "
          f"bits (fp8_e4m3, fp8_e5m2, fp4_e2m1, int8); this policy's are "
          f"{policy.matmul_operands}."
        )


def changed_stability_options(policy: Precision) -> list[str]:
  """The policy's stability options that differ from the defaults, as
  'option=value'."""
  return [
    f"{option}={getattr(policy, option)}"
    for option in STABILITY_OPTIONS
    if getattr(policy, option) != DEFAULT_OPTIONS[option]
  ]


def _check_stability(policy: Precision) -> None:
  """The stability options: valid, and meaningful under this policy."""
  for option in STABILITY_OPTIONS:
    valid = QUANT_OPTIONS[option]
    if getattr(policy, option) not in valid:
      raise ValueError(
        f"Unknown {option} {getattr(policy, option)!r}; valid: {list(valid)}."
      )
  if policy.delta_source in ("fp32", "hi_lo") and (
    policy.output == policy.out_accum
  ):
    raise ValueError(
      f"delta_source={policy.delta_source} keeps more of O than its "
      f"stored format for the backward's delta; this policy stores O in "
      f"{policy.output}, its accumulator's format, already. Use it where "
      "the output is narrower (bf16-fa2, fp16-fa2)."
    )
  if policy.delta_product != "rowsum" and policy.delta_source == "probs":
    raise ValueError(
      f"delta_product={policy.delta_product} sums rowsum(dO * O); "
      "delta_source=probs computes delta as rowsum(P * dP) from the "
      "backward's own dP, with no O. Use one of them."
    )
  if policy.sink_delta != "shared" and policy.delta_source == "probs":
    raise ValueError(
      f"sink_delta={policy.sink_delta} recomputes rowsum(P * dP) for "
      "d(sink); delta_source=probs makes it the delta of every gradient "
      "already. Use one of them."
    )
  if policy.softmax_sum != "stats" and policy.probs == policy.softmax_stats:
    raise ValueError(
      f"softmax_sum={policy.softmax_sum} sums P as rounded to `probs` "
      f"({policy.probs}), which is its statistics format already: the "
      "option changes nothing here. Use it where P is rounded narrower."
    )
  if policy.ds_for_dq != "rounded" and policy.probs == policy.softmax_stats:
    raise ValueError(
      f"ds_for_dq={policy.ds_for_dq} splits dS into two {policy.probs} "
      "parts, the format dS is computed in already. Use it where `probs` "
      "is narrower (bf16-fa2, fp16-fa2)."
    )
  if policy.softmax_residuals == "max_sum" and policy.exp2:
    raise ValueError(
      "softmax_residuals=max_sum stores the forward's running max, which "
      "exp2=on keeps in base 2; the backward recomputes P in natural "
      "log. Use one of them."
    )
  changed = changed_stability_options(policy)
  if changed and policy.quantizes:
    raise ValueError(
      f"{', '.join(changed)}: options of a 16-bit flash kernel's "
      "residuals; "
      f"this policy's operands are {policy.matmul_operands}, whose "
      "backward is straight-through (documented in docs/precision.md)."
    )


# Formats with FP32's exponent, whose FP32 bit pattern truncates.
TRUNCATING_FORMATS = ("fp32", "fp22", "bf16")


def _check_accumulator(policy: Precision) -> None:
  """The MMA accumulator options: valid, and meaningful together."""
  for option in ("mma_chunk", "promote_every", "score_chunk"):
    value = getattr(policy, option)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{option} must be an integer >= 0, got {value!r}.")
  if policy.mma_rounding not in QUANT_OPTIONS["mma_rounding"]:
    raise ValueError(
      f"Unknown mma_rounding {policy.mma_rounding!r}; valid: "
      f"{list(QUANT_OPTIONS['mma_rounding'])}."
    )
  chunk = policy.score_chunk
  if chunk and (chunk < 16 or chunk & (chunk - 1)):
    raise ValueError(
      f"score_chunk must be 0 (off) or a power of two >= 16 (Triton's "
      f"smallest dot; a padded head dim splits into equal parts), got "
      f"{chunk!r}."
    )
  if chunk and policy.mma_chunk:
    raise ValueError(
      f"score_chunk={chunk} and mma_chunk={policy.mma_chunk} both set how "
      "QK^T adds its head dim (mma_chunk as the tensor core's accumulator "
      "does). Use one of them."
    )
  if policy.mma_chunk == 0 and (
    policy.mma_rounding != "nearest" or policy.promote_every != 1
  ):
    raise ValueError(
      "mma_rounding and promote_every describe the chunked MMA "
      "accumulator: give mma_chunk (e.g. 32 for FP8 WGMMA) with them."
    )
  if (
    policy.mma_rounding == "truncate"
    and policy.matmul_accum not in TRUNCATING_FORMATS
  ):
    raise ValueError(
      f"mma_rounding=truncate needs an accumulator with FP32's exponent "
      f"({list(TRUNCATING_FORMATS)}), not {policy.matmul_accum}."
    )
  if policy.promote_every != 1 and policy.scaling not in ("none", "tensor"):
    raise ValueError(
      f"promote_every={policy.promote_every} keeps P V of several key tiles "
      f"in one accumulator, which needs one V scale for all of them "
      f"(scaling none or tensor), not scaling={policy.scaling}."
    )
