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
}
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
}
# Mantissa bits (explicit fraction bits) of each format, for reports.
MANTISSA_BITS = {"fp64": 52, "fp32": 23, "fp16": 10, "bf16": 7}

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

  Each field holds a format name: 'fp64', 'fp32', 'fp16' or 'bf16'. See
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

  def __post_init__(self):
    for stage in STAGES:
      object.__setattr__(self, stage, format_name(getattr(self, stage)))

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
    stages = {}
    for change in changes:
      stage, sep, fmt = change.partition("=")
      if not sep:
        raise ValueError(
          f"Bad stage change {change!r} in precision {name!r}: write "
          "'stage=format', e.g. 'bf16-fa2+out_accum=bf16'."
        )
      stages[stage.strip()] = fmt.strip()
    if not stages:
      return _PRESETS[preset]
    return _PRESETS[preset].with_stage(**stages)

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

  def __str__(self) -> str:
    body = " ".join(f"{k}={v}" for k, v in self.stages().items())
    return f"{self.name} [{body}]"


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
