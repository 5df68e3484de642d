"""Precision policy: one number format per place where attention rounds.

A deviation between two attention implementations can only be attributed to
a cause if every rounding step is named. `Precision` gives each stage its own
format, so that a study can change one stage and watch the deviation move.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from stableattn.numerics.formats import (
  DtypeLike,
  format_name,
  to_dtype,
)
from stableattn.numerics.low_presets import low_presets
from stableattn.numerics.quant_options import (
  DEFAULT_OPTIONS,
  QUANT_OPTIONS,
  WIDE_FORMATS,
  check_quant_options,
  option_text,
  parse_option,
)

# Where int8 is allowed: an integer format holds quantized matmul operands.
INT8_STAGES = ("matmul_operands",)
# Where fp22 is allowed: a tensor core's accumulator.
FP22_STAGES = ("matmul_accum",)

STAGES = (
  "inputs",
  "matmul_operands",
  "matmul_accum",
  "scores",
  "softmax_stats",
  "probs",
  "out_accum",
  "partials",
  "output",
  "delta",
  "grad_accum",
)
STAGE_DESCRIPTIONS = {
  "inputs": "Q, K, V as stored",
  "matmul_operands": "what enters QK^T and PV (and the backward matmuls)",
  "matmul_accum": "dot products inside one block (preferred_element_type)",
  "scores": "S = QK^T / sqrt(d) as stored",
  "softmax_stats": "running max m, running sum l, exp, rescale factors",
  "probs": "probabilities P cast before PV",
  "out_accum": "running output accumulator O, rescaled once per key block",
  "partials": "split-KV: each split's normalized output before the merge",
  "output": "final O",
  "delta": "backward: delta = rowsum(dO * O)",
  "grad_accum": "backward: running dQ, dK, dV sums across blocks",
}


@dataclasses.dataclass(frozen=True)
class Precision:
  """Number format of every rounding stage of attention.

  Each field holds a format name: 'fp64', 'fp32', 'fp16', 'bf16', or below
  16 bits 'fp8_e4m3' (e4m3fn: no infinity, casts saturate at +-448),
  'fp8_e5m2', 'fp4_e2m1' (saturates at +-6) and 'int8' (matmul operands
  only). See
  `STAGE_DESCRIPTIONS` for what each stage rounds. `name` is a label for
  reports; it is the preset name, or the preset name plus the changes made
  with `with_stage`.
  """

  inputs: str
  matmul_operands: str
  matmul_accum: str
  scores: str
  softmax_stats: str
  probs: str
  out_accum: str
  output: str
  delta: str
  grad_accum: str
  # FlashAttention keeps split-KV partial outputs in FP32 whatever the
  # input format; policies that name no format for them do the same.
  partials: str = "fp32"
  name: str = "custom"
  # How operands below 16 bits are scaled before their cast, and (any
  # policy) the order of key blocks and the softmax's base (see
  # `QUANT_OPTIONS`).
  scaling: str = "none"
  p_scale: float = 1.0
  hadamard: bool = False
  key_order: str = "forward"
  smooth_k: bool = False
  exp2: bool = False
  mma_chunk: int = 0
  mma_rounding: str = "nearest"
  score_chunk: int = 0
  promote_every: int = 1
  kv_cache: str = "none"
  delta_source: str = "output"
  delta_product: str = "rowsum"
  sink_delta: str = "shared"
  softmax_residuals: str = "lse"
  softmax_sum: str = "stats"
  ds_for_dq: str = "rounded"

  def __post_init__(self):
    for stage in STAGES:
      object.__setattr__(self, stage, format_name(getattr(self, stage)))
      if getattr(self, stage) == "int8" and stage not in INT8_STAGES:
        raise ValueError(
          f"int8 can only be the format of {list(INT8_STAGES)} (quantized "
          f"operands of a matmul, with scaling), not of {stage!r}; use "
          "fp8_e4m3, fp8_e5m2 or fp4_e2m1 below 16 bits there."
        )
      if getattr(self, stage) == "fp22" and stage not in FP22_STAGES:
        raise ValueError(
          f"fp22 can only be the format of {list(FP22_STAGES)} (an FP8 "
          f"tensor core's accumulator), not of {stage!r}."
        )
    check_quant_options(self)

  @classmethod
  def from_name(cls, name: str | Precision) -> Precision:
    """The preset called `name` (a `Precision` is returned unchanged).

    A name may add stage changes as `with_stage` labels them:
    "bf16-fa2+out_accum=bf16" is `from_name("bf16-fa2").with_stage(
    out_accum="bf16")`, so every policy's `name` reads back.

    Raises:
      ValueError: for an unknown name; the message lists the valid ones.
    """
    if isinstance(name, Precision):
      return name
    if not isinstance(name, str):
      raise ValueError(
        f"precision must be a preset name or a stableattn.Precision, got "
        f"{type(name).__name__} {name!r}; valid presets: {preset_names()}."
      )
    preset, *changes = name.strip().lower().split("+")
    if preset not in _PRESETS:
      raise ValueError(
        f"Unknown precision preset {preset!r} in {name!r}; valid presets: "
        f"{preset_names()}, optionally followed by '+stage=format' changes "
        "(e.g. 'bf16-fa2+out_accum=bf16')."
      )
    stages, options = {}, {}
    for change in changes:
      stage, sep, fmt = change.partition("=")
      if not sep:
        raise ValueError(
          f"Bad stage change {change!r} in precision {name!r}: write "
          "'stage=format', e.g. 'bf16-fa2+out_accum=bf16', or "
          "'option=value', e.g. 'fp8-fa3+hadamard=off'."
        )
      stage, fmt = stage.strip(), fmt.strip()
      if stage in QUANT_OPTIONS or stage == "block_quant":
        options[stage] = parse_option(stage, fmt, name)
      else:
        stages[stage] = fmt
    policy = _PRESETS[preset]
    if stages:
      policy = policy.with_stage(**stages)
    if options:
      policy = policy.with_options(**options)
    return policy

  def with_options(self, **options) -> Precision:
    """A copy with quantization options changed (see `QUANT_OPTIONS`);
    `block_quant=False` is `scaling="tensor"` (FlashAttention-3's
    ablation)."""
    if "block_quant" in options:
      options["scaling"] = "block" if options.pop("block_quant") else "tensor"
    unknown = sorted(set(options) - set(QUANT_OPTIONS))
    if unknown:
      raise ValueError(
        f"Unknown precision option(s) {unknown}; valid: "
        f"{list(QUANT_OPTIONS) + ['block_quant']}."
      )
    changed = [
      f"{k}={option_text(v)}"
      for k, v in options.items()
      if getattr(self, k) != v
    ]
    label = self.name + "".join(f"+{c}" for c in changed)
    return dataclasses.replace(self, name=label, **options)

  def with_stage(self, **stages: DtypeLike) -> Precision:
    """A copy with the given stages set to other formats.

    Example: `Precision.from_name("bf16-fa2").with_stage(probs="fp32")`.
    """
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
      raise ValueError(
        f"Unknown precision stage(s) {unknown}; valid stages: {list(STAGES)}."
      )
    formats = {stage: format_name(fmt) for stage, fmt in stages.items()}
    changed = [
      f"{stage}={fmt}"
      for stage, fmt in formats.items()
      if getattr(self, stage) != fmt
    ]
    label = self.name + "".join(f"+{c}" for c in changed)
    return dataclasses.replace(self, name=label, **formats)

  def dtype(self, stage: str) -> np.dtype:
    """The dtype of one stage."""
    if stage not in STAGES:
      raise ValueError(
        f"Unknown precision stage {stage!r}; valid stages: {list(STAGES)}."
      )
    return to_dtype(getattr(self, stage))

  def stages(self) -> dict[str, str]:
    """Stage name to format name, in pipeline order."""
    return {stage: getattr(self, stage) for stage in STAGES}

  @property
  def uses_fp64(self) -> bool:
    return "fp64" in self.stages().values()

  @property
  def quantizes(self) -> bool:
    """Whether matmul operands are below 16 bits (scaling applies)."""
    return self.matmul_operands not in WIDE_FORMATS

  def options(self) -> dict:
    return {k: getattr(self, k) for k in QUANT_OPTIONS}

  def __str__(self) -> str:
    body = " ".join(f"{k}={v}" for k, v in self.stages().items())
    if self.quantizes or self.options() != DEFAULT_OPTIONS:
      body += " " + " ".join(
        f"{k}={option_text(v)}" for k, v in self.options().items()
      )
    return f"{self.name} [{body}]"


def _uniform(fmt: str, name: str, **overrides: str) -> Precision:
  stages = {stage: fmt for stage in STAGES}
  stages.update(overrides)
  return Precision(name=name, **stages)


def _build_presets() -> dict[str, Precision]:
  wide = _wide_presets()
  # BF16 attention reading K and V from an FP8 KV cache with one scale per
  # tensor (FlashInfer #4977, vLLM's FP8 KV cache): `bf16-fa2`'s math.
  kv_cache = dataclasses.replace(
    wide["bf16-fa2"], name="bf16-fp8-kv-cache", kv_cache="fp8_e4m3"
  )
  return {
    **wide,
    **_stable_presets(wide),
    **low_presets(Precision),
    kv_cache.name: kv_cache,
  }


# The cheapest set of stability options (`quant_options.STABILITY_OPTIONS`)
# with which our kernel passes every edge regime of the audit at its format
# (docs/audit.md, "A kernel that does not break"): FP32 misses at large
# logits by recomputing P from one log-sum-exp; BF16 and FP16 at tied
# maxima by delta from O rounded to the format and by dS rounded once,
# and on a model's own tensors by an l that is not the sum of the P that
# multiplies V; every format where one key holds a row, by delta summed
# in another order than dP; FP16 also at large logits and extreme sinks;
# FP32 at logits of hundreds, where a dot's terms cancel, by the order of
# a 64-key tile's q.k sums (fixed by `score_chunk`, which is not a
# stability option; the Baseline ignores it as it ignores them).
STABLE_OPTIONS = {
  "fp32": {
    "softmax_residuals": "max_sum",
    "delta_product": "matmul",
    "score_chunk": 16,
  },
  # l sums the P that multiplies V, so that where a row's keys share one
  # V (a repeated token) O is that V and delta cancels dP.
  "bf16-fa2": {
    "delta_source": "hi_lo",
    "delta_product": "matmul",
    "ds_for_dq": "hi_lo",
    "softmax_sum": "rounded_probs",
  },
  # FP16's P also underflows (subnormal below 6.1e-5): l sums the P that
  # multiplies V, at logits of standard deviation 3,000 m and l apart, and
  # d(sink) takes its delta from P where a sink leaves O subnormal.
  "fp16-fa2": {
    "delta_source": "hi_lo",
    "delta_product": "matmul",
    "sink_delta": "probs",
    "ds_for_dq": "hi_lo",
    "softmax_sum": "rounded_probs",
    "softmax_residuals": "max_sum",
  },
}


def _stable_presets(wide: dict) -> dict:
  return {
    f"{base}-stable": dataclasses.replace(
      wide[base], name=f"{base}-stable", **options
    )
    for base, options in STABLE_OPTIONS.items()
  }


def _wide_presets() -> dict[str, Precision]:
  presets = {
    "fp64": _uniform("fp64", "fp64"),
    "fp32": _uniform("fp32", "fp32"),
  }
  for fmt in ("fp16", "bf16"):
    # Every stored value in the format; dot products accumulate in FP32
    # as tensor cores (and CPU matmuls) do.
    presets[fmt] = _uniform(fmt, fmt, matmul_accum="fp32")
    # Real flash kernels (FlashAttention-2/3, jax's Pallas kernel): only
    # the tensor-core operands and the stored output are low precision.
    presets[f"{fmt}-fa2"] = _uniform(
      "fp32",
      f"{fmt}-fa2",
      inputs=fmt,
      matmul_operands=fmt,
      probs=fmt,
      output=fmt,
    )
    # Eager framework attention on half tensors: S, P and O are stored in
    # the format, softmax is computed internally in FP32.
    presets[f"{fmt}-framework"] = _uniform(
      fmt,
      f"{fmt}-framework",
      matmul_accum="fp32",
      softmax_stats="fp32",
      delta="fp32",
      grad_accum="fp32",
    )
  return presets


_PRESETS = _build_presets()


KERNELS = ("flash", "baseline")


def natural_policy(fmt: str, kernel: str) -> str:
  """The preset a kernel runs at a format when nobody forces a policy.

  FP32 and FP64: every stage in the format. Half formats: real flash
  kernels keep statistics and accumulators in FP32 ("<fmt>-fa2"); eager
  framework attention stores S and P in the format ("<fmt>-framework").
  """
  fmt = format_name(fmt)
  if fmt not in WIDE_FORMATS:
    raise ValueError(
      f"No natural policy at {fmt}: below 16 bits a kernel is a set of "
      "choices (scaling, rotation), named by presets such as fp8-fa3."
    )
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}.")
  if fmt in ("fp32", "fp64"):
    return fmt
  return f"{fmt}-fa2" if kernel == "flash" else f"{fmt}-framework"


def stable_policy(fmt: str) -> str:
  """Our flash kernel's stable preset at a training format (its natural
  policy plus `STABLE_OPTIONS`): fp32-stable, bf16-fa2-stable,
  fp16-fa2-stable."""
  base = natural_policy(fmt, "flash")
  if base not in STABLE_OPTIONS:
    raise ValueError(
      f"No stable preset at {fmt}: there are "
      f"{[f'{b}-stable' for b in STABLE_OPTIONS]}."
    )
  return f"{base}-stable"


def preset_names() -> list[str]:
  """Names accepted by `Precision.from_name`."""
  return list(_PRESETS)


def resolve(precision: str | Precision) -> Precision:
  """A `Precision` from a preset name or a `Precision`."""
  return Precision.from_name(precision)


def require_x64_if_needed(policy: Precision) -> None:
  """Raises if the policy has an FP64 stage but JAX computes in FP32."""
  if policy.uses_fp64 and not jax.config.jax_enable_x64:
    fp64_stages = [s for s, f in policy.stages().items() if f == "fp64"]
    raise ValueError(
      f"Precision {policy.name!r} computes stages {fp64_stages} in FP64, but "
      "JAX 64-bit mode is off, so JAX would silently compute them in FP32. "
      "Enable it first with jax.config.update('jax_enable_x64', True) (or "
      "JAX_ENABLE_X64=1), or use a policy without FP64 stages."
    )
