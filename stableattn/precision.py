"""Precision policy: one number format per place where attention rounds.

A deviation between two attention implementations can only be attributed to
a cause if every rounding step is named. `Precision` gives each stage its own
format, so that a study can change one stage and watch the deviation move.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Canonical short names and the dtypes they stand for.
_FORMATS = {
  "fp64": jnp.float64,
  "fp32": jnp.float32,
  "fp16": jnp.float16,
  "bf16": jnp.bfloat16,
  # Below 16 bits (see `LOW_FORMATS` in rounding.py for their ranges).
  "fp8_e4m3": jnp.float8_e4m3fn,
  "fp8_e5m2": jnp.float8_e5m2,
  "fp4_e2m1": jnp.float4_e2m1fn,
  "int8": jnp.int8,
  # FP32's range with 13 fraction bits, held in FP32: the width Hopper's
  # FP8 tensor cores accumulate in (SageAttention 2 calls it FP22).
  "fp22": jnp.float32,
}
# The formats every stage can take and each has presets (and a study axis).
WIDE_FORMATS = ("fp64", "fp32", "fp16", "bf16")
_ALIASES = {
  "float64": "fp64",
  "f64": "fp64",
  "double": "fp64",
  "float32": "fp32",
  "f32": "fp32",
  "float": "fp32",
  "float16": "fp16",
  "f16": "fp16",
  "half": "fp16",
  "bfloat16": "bf16",
  "e4m3": "fp8_e4m3",
  "fp8": "fp8_e4m3",
  "float8_e4m3fn": "fp8_e4m3",
  "e5m2": "fp8_e5m2",
  "float8_e5m2": "fp8_e5m2",
  "e2m1": "fp4_e2m1",
  "fp4": "fp4_e2m1",
  "float4_e2m1fn": "fp4_e2m1",
  "e8m13": "fp22",
}
# Mantissa bits (explicit fraction bits) of each format, for reports; int8
# has 7 magnitude bits.
MANTISSA_BITS = {
  "fp64": 52,
  "fp32": 23,
  "fp16": 10,
  "bf16": 7,
  "fp8_e4m3": 3,
  "fp8_e5m2": 2,
  "fp4_e2m1": 1,
  "int8": 7,
  "fp22": 13,
}
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
  "output": "final O",
  "delta": "backward: delta = rowsum(dO * O)",
  "grad_accum": "backward: running dQ, dK, dV sums across blocks",
}

DtypeLike = str | np.dtype | type


def format_name(dtype: DtypeLike) -> str:
  """Canonical short name ('fp64', 'fp32', 'fp16', 'bf16') of a dtype."""
  if isinstance(dtype, str):
    key = dtype.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _FORMATS:
      return key
    raise ValueError(
      f"Unknown number format {dtype!r}; valid formats are "
      f"{sorted(_FORMATS)} (or {sorted(_ALIASES)})."
    )
  try:
    np_dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(
      f"Unknown number format {dtype!r}; valid formats are {sorted(_FORMATS)}."
    ) from e
  for name, candidate in _FORMATS.items():
    if np_dtype == jnp.dtype(candidate):
      return name
  raise ValueError(
    f"Unsupported dtype {np_dtype}; valid formats are {sorted(_FORMATS)}."
  )


def to_dtype(name: str) -> np.dtype:
  """The numpy/JAX dtype for a format name."""
  return jnp.dtype(_FORMATS[format_name(name)])


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
  name: str = "custom"
  # How operands below 16 bits are scaled before their cast (see
  # `QUANT_OPTIONS`); none of these change a policy of 16 bits or more.
  scaling: str = "none"
  p_scale: float = 1.0
  hadamard: bool = False
  key_order: str = "forward"
  smooth_k: bool = False

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
        options[stage] = _parse_option(stage, fmt, name)
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
      f"{k}={_option_text(v)}"
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
        f"{k}={_option_text(v)}" for k, v in self.options().items()
      )
    return f"{self.name} [{body}]"


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
  # K minus its mean over tokens (per batch, head and channel) before the
  # rotation and scaling: each score row moves by one constant, which
  # softmax removes (SageAttention's smoothing of K; not with a softcap).
  "smooth_k": (False, True),
}
# Values per shared scale of each microscaling.
MICRO_GROUPS = {"mx": 32, "nvfp4": 16}
DEFAULT_OPTIONS = {
  "scaling": "none",
  "p_scale": 1.0,
  "hadamard": False,
  "key_order": "forward",
  "smooth_k": False,
}


def _option_text(value) -> str:
  if isinstance(value, bool):
    return "on" if value else "off"
  return f"{value:g}" if isinstance(value, float) else str(value)


def _parse_option(option: str, text: str, name: str):
  """An option's value from its text in a policy name."""
  if option in ("hadamard", "block_quant", "smooth_k"):
    if text in ("on", "true", "1"):
      return True
    if text in ("off", "false", "0"):
      return False
    raise ValueError(
      f"Bad value {text!r} for {option} in precision {name!r}; valid: on, off."
    )
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
  for option in ("scaling", "key_order"):
    valid = QUANT_OPTIONS[option]
    if getattr(policy, option) not in valid:
      raise ValueError(
        f"Unknown {option} {getattr(policy, option)!r}; valid: {list(valid)}."
      )
  for option in ("hadamard", "smooth_k"):
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
  if policy.matmul_operands in WIDE_FORMATS:
    # These prepare quantized operands; on wide ones they would be ignored.
    for option, value in (
      ("scaling", policy.scaling),
      ("hadamard", policy.hadamard),
      ("smooth_k", policy.smooth_k),
    ):
      if value != DEFAULT_OPTIONS[option]:
        raise ValueError(
          f"{option}={_option_text(value)} needs matmul operands below 16 "
          f"bits (fp8_e4m3, fp8_e5m2, fp4_e2m1, int8); this policy's are "
          f"{policy.matmul_operands}."
        )


def _uniform(fmt: str, name: str, **overrides: str) -> Precision:
  stages = {stage: fmt for stage in STAGES}
  stages.update(overrides)
  return Precision(name=name, **stages)


def _build_presets() -> dict[str, Precision]:
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
  presets["fp8-baseline"] = Precision(
    name="fp8-baseline",
    scores="fp16",
    softmax_stats="fp16",
    scaling="tensor",
    **fp8,
  )
  presets["fp8-fa3"] = Precision(
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
  presets["fp8-sage"] = Precision(
    name="fp8-sage",
    scores="fp32",
    softmax_stats="fp32",
    scaling="token",
    smooth_k=True,
    p_scale=448.0,
    **fp8,
  )
  # An NVFP4 attention (SageAttention 3's format, arXiv 2505.11594): Q, K,
  # P and V in e2m1 with one e4m3 scale per 16 values along each matmul's
  # contraction and one FP32 scale per tensor (P's static); FP32 softmax.
  presets["fp4-nvfp4"] = Precision(
    name="fp4-nvfp4",
    scores="fp32",
    softmax_stats="fp32",
    scaling="nvfp4",
    **{**fp8, "matmul_operands": "fp4_e2m1", "probs": "fp4_e2m1"},
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
