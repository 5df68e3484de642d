"""Runs as data: how each run differs from the base run.

A pair (`pairs.py`) names two variants; a variant says what changes:
which of the configured kernels computes attention, the training format,
kernel options (the tie fix), a policy change of the flash kernel, the
initialization, a second identical copy, or one device instead of all.
"""

from __future__ import annotations

import dataclasses

from stableattn.training.compute_format import FP32_CLASSES


@dataclasses.dataclass(frozen=True)
class Variant:
  """One run's difference from the base run.

  Attributes:
    attention: "baseline", "flash" or "candidate": the kernel named by
      `config.attention.baseline`, `.flash` or `.candidate` (any name of
      `stableattn.ops.registry`) computes every layer's attention.
    precision: the training format ("fp32", "bf16", "fp16"); None keeps
      `config.train.precision`.
    options: None, "flash" (`config.attention.flash_options`) or "fix"
      (`config.attention.fix`): `Options` changes of the flash kernel,
      e.g. Qiu & Yao's fix.
    flash_stages: stage changes appended to the flash kernel's policy,
      e.g. "+out_accum=bf16" (see `stableattn.Precision.from_name`).
    low_precision: the flash kernel runs `config.attention.low_precision`
      (a policy below 16 bits, e.g. fp8-fa3) instead of its own.
    init_seed: the initialization seed (replicates fold their number in).
    replica: a second copy of an identical run.
    single_device: train on one device instead of `config.train.devices`.
    context_parallel: the flash kernel runs as ring attention over
      `config.attention.context_parallel` devices (no data parallelism).
    stable: the flash kernel runs its policy's stable preset
      (`stableattn.numerics.precision.stable_policy`).
    fp32_classes: tensor classes of a low-precision run kept in FP32
      (`compute_format.FP32_CLASSES`; "attention" puts attention's
      policy in FP32).
  """

  attention: str = "baseline"
  precision: str | None = None
  options: str | None = None
  flash_stages: str = ""
  low_precision: bool = False
  init_seed: int = 0
  replica: int = 0
  single_device: bool = False
  context_parallel: bool = False
  stable: bool = False
  fp32_classes: tuple[str, ...] = ()


def kept_in_fp32(tensor_class: str) -> str:
  """The name of the BF16 run that keeps `tensor_class` in FP32."""
  return f"bf16_{tensor_class}_in_fp32"


def only_in_bf16(tensor_class: str) -> str:
  """The name of the run that computes only `tensor_class` in BF16."""
  return f"bf16_only_{tensor_class}"


VARIANTS = {
  "base": Variant(),
  "flash": Variant(attention="flash", options="flash"),
  "flash_fixed": Variant(attention="flash", options="fix"),
  "flash_stable": Variant(attention="flash", options="flash", stable=True),
  "seed": Variant(init_seed=1),
  "rerun": Variant(replica=1),
  "fp32": Variant(precision="fp32"),
  "bf16": Variant(precision="bf16"),
  "fp16": Variant(precision="fp16"),
  "one_device": Variant(single_device=True),
  "candidate": Variant(attention="candidate"),
  "flash_low": Variant(attention="flash", low_precision=True),
  "flash_context_parallel": Variant(
    attention="flash", options="flash", context_parallel=True
  ),
  **{
    kept_in_fp32(c): Variant(precision="bf16", fp32_classes=(c,))
    for c in FP32_CLASSES
  },
  **{
    only_in_bf16(c): Variant(
      precision="bf16",
      fp32_classes=tuple(other for other in FP32_CLASSES if other != c),
    )
    for c in FP32_CLASSES
  },
  # Every class kept in FP32: the FP32 run bit for bit (a control).
  "bf16_all_in_fp32": Variant(precision="bf16", fp32_classes=FP32_CLASSES),
}
