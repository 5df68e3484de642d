"""The stability experiment's configuration, validated into typed settings.

An *arm* is one attention variant, trained in one format, with one
mitigation; every arm is swept over the same learning rates, in the same
replicates (each its own initialization and data order).
"""

from __future__ import annotations

import dataclasses
import math

from stableattn.contract import features as features_lib
from stableattn.contract import options as options_lib
from stableattn.contract.features import Features
from stableattn.contract.options import Options
from stableattn.experiments.sections import (
  DataSection,
  ModelSection,
  TileSection,
)
from stableattn.harness import environment
from stableattn.harness.config_values import (
  as_tuple,
  from_section,
  ring_devices,
  spec,
)
from stableattn.numerics.precision import (
  Precision,
  natural_policy,
  stable_policy,
)
from stableattn.ops.dispatch import FLASH_IMPLEMENTATIONS
from stableattn.ops.registry import resolve
from stableattn.training.compute_format import MIXED_PRECISION
from stableattn.training.model import AttentionSpec, ModelSpec
from stableattn.training.trainer import COMPUTE_DTYPES, OptimizerSpec, RunSpec

# Attention variants: name -> (implementation, policy; "natural": the
# kernel's natural policy at the training format).
VARIANTS = {
  "baseline": ("reference", "natural"),
  # "flash": our flash kernel, the Hopper path on a Hopper GPU where it
  # runs the request, else the Triton path (`flash_choice.flash_path`).
  "flash": ("flash", "natural"),
  # Flash with every stage in BF16 (the paper's emulation).
  "flash_bf16": ("flash", "bf16"),
  # Flash under its stable preset at the format (docs/precision.md).
  "flash_stable": ("flash", "stable"),
}
# Mitigations (Wortsman et al. 2023; Qiu & Yao 2025): these three, or any
# field of `stableattn.Features` (e.g. softcap, every kernel) or of
# `stableattn.Options` (e.g. Qiu & Yao's fix, the flash kernel only) that
# `config.strengths` sets.
MITIGATIONS = ("none", "qk_norm", "z_loss")


@dataclasses.dataclass(frozen=True)
class Arm:
  """One variant, trained in one format, with one mitigation; `machine`
  names the other machine it is compiled for ("": this one)."""

  variant: str
  precision: str
  mitigation: str
  machine: str = ""

  @property
  def name(self) -> str:
    where = f"@{self.machine}" if self.machine else ""
    return f"{self.variant}{where}/{self.precision}/{self.mitigation}"

  @property
  def here(self) -> Arm:
    """The same arm on this machine."""
    return dataclasses.replace(self, machine="")


@dataclasses.dataclass(frozen=True)
class Settings:
  model: ModelSpec
  arms: tuple[Arm, ...]
  runs: dict  # Arm -> (ModelSpec, RunSpec)
  learning_rates: tuple[float, ...]
  replicates: int
  steps: int
  warmup_steps: int
  batch_size: int
  seq_len: int
  log_every: int
  divergence_loss: float  # a training loss above this has diverged
  clip_loss: float  # final losses are clipped here (the initial loss)
  corpus: str
  corpus_tokens: int
  data_seed: int
  reference_precision: str  # the format the baseline is also trained in
  # XLA_FLAGS of the other machine the Baseline arms are rerun on, and its
  # label; None and the reason where there is none.
  machine_flags: str | None
  machine: str
  capture_logit: float = 0.0
  capture_map: int = 0
  capture_rows: int = 2

  @property
  def arms_here(self) -> tuple[Arm, ...]:
    return tuple(a for a in self.arms if not a.machine)

  @property
  def arms_elsewhere(self) -> tuple[Arm, ...]:
    return tuple(a for a in self.arms if a.machine)

  def optimizer(self) -> OptimizerSpec:
    """A unit peak learning rate; each run scales it (one compiled step
    per arm for the whole sweep)."""
    return OptimizerSpec(
      learning_rate=1.0,
      warmup_steps=self.warmup_steps,
      total_steps=self.steps,
    )


def _learning_rates(raw, name: str) -> tuple[float, ...]:
  rates = tuple(float(x) for x in as_tuple(raw))
  if len(rates) < 2 or any(not math.isfinite(x) or x <= 0 for x in rates):
    raise ValueError(
      f"config.{name} must hold two or more positive numbers (a log grid), "
      f"got {raw!r}."
    )
  return tuple(sorted(rates))


def _reference_precision(raw, name: str) -> str:
  value = str(raw).strip()
  if value and value not in COMPUTE_DTYPES:
    raise ValueError(
      f"config.{name}: unknown {value!r}; valid: {list(COMPUTE_DTYPES)}."
    )
  return value


@dataclasses.dataclass(frozen=True)
class TrainSection:
  precision: str = spec(choices=COMPUTE_DTYPES)
  mixed_precision: str = spec(choices=MIXED_PRECISION)
  reference_precision: str = spec(parse=_reference_precision)
  learning_rates: tuple[float, ...] = spec(parse=_learning_rates)
  replicates: int = spec(minimum=1)
  steps: int = spec(minimum=1)
  warmup_steps: int = spec(minimum=0)
  batch_size: int = spec(minimum=1)
  log_every: int = spec(minimum=1)
  divergence_factor: float = spec()
  machine_pair: bool = spec()
  # > 0: the first logging step of each flash-kernel arm's cell (first
  # replicate) whose largest logit reaches this saves every attention
  # layer's q, k, v and dO under captures/<arm>-lr<lr>/ (0: never).
  capture_logit: float = spec(minimum=0)
  capture_map: int = spec(minimum=0)
  capture_rows: int = spec(minimum=1)


AttentionSection = TileSection


def settings_from_config(config, *, machine: str | None = None) -> Settings:
  """Validates the ConfigDict (fails fast, one clear line) into settings.

  machine: the other machine's label, as the parent run named it (for
  the child process that trains its arms); None: found from this process.
  """
  c = config
  model = from_section(ModelSection, c, "model")
  train = from_section(TrainSection, c, "train")
  attention = from_section(AttentionSection, c, "attention")
  data = from_section(DataSection, c, "data")
  variants = _variants(c)
  mitigations = as_tuple(c.mitigations)
  valid = MITIGATIONS + tuple(
    name
    for name in c.strengths
    if name in features_lib.names() or name in options_lib.field_names()
  )
  for m in mitigations:
    if m not in valid:
      raise ValueError(
        f"config.mitigations: unknown {m!r}; valid: {list(valid)}."
      )
  if not mitigations:
    raise ValueError(f"config.mitigations is empty; valid: {valid}.")
  arms = [Arm(v, train.precision, m) for m in mitigations for v in variants]
  reference = train.reference_precision
  if reference and reference != train.precision:
    arms += [Arm("baseline", reference, m) for m in mitigations]
  flags, label = None, "not asked for (config.train.machine_pair)"
  if train.machine_pair:
    flags, label = (
      environment.other_machine_flags() if machine is None else ("", machine)
    )
  if flags is not None:
    arms += [Arm("baseline", train.precision, m, label) for m in mitigations]
  settings = Settings(
    model=model.spec(),
    arms=tuple(arms),
    runs={},
    learning_rates=train.learning_rates,
    replicates=train.replicates,
    steps=train.steps,
    warmup_steps=train.warmup_steps,
    batch_size=train.batch_size,
    seq_len=model.seq_len,
    log_every=train.log_every,
    divergence_loss=train.divergence_factor * math.log(model.vocab_size),
    clip_loss=math.log(model.vocab_size),
    corpus=data.corpus,
    corpus_tokens=data.corpus_tokens,
    data_seed=data.seed,
    reference_precision=reference,
    machine_flags=flags,
    machine=label,
    capture_logit=train.capture_logit,
    capture_map=train.capture_map,
    capture_rows=train.capture_rows,
  )
  runs = {arm: _run(c, arm.here, settings.model, attention) for arm in arms}
  return dataclasses.replace(settings, runs=runs)


def _variants(c) -> tuple[str, ...]:
  names = list(as_tuple(c.variants))
  for name in names:
    _choice(name, "variants", VARIANTS)
  candidate = str(c.get("candidate", "") or "").strip()
  if candidate:
    resolve(candidate)  # one clear line for a name that does not resolve
    names.append("candidate")
  low = str(c.get("low_precision", "") or "").strip()
  if low:
    if not Precision.from_name(low).quantizes:
      raise ValueError(
        f"config.low_precision {low!r} is not below 16 bits; give e.g. "
        "fp8-fa3, fp8-sage or fp4-nvfp4."
      )
    names.append("low_precision")
  if context_devices(c):
    names.append(CONTEXT_PARALLEL)
  if not names:
    raise ValueError(f"config.variants is empty; valid: {list(VARIANTS)}.")
  return tuple(names)


# The flash arm again with its attention as ring attention, the sequence
# sharded over `config.context_parallel` devices.
CONTEXT_PARALLEL = "flash_context_parallel"


def context_devices(c) -> int:
  """config.context_parallel: 0 (no such arm) or the ring's devices."""
  return ring_devices(c.get("context_parallel", 0), "context_parallel")


def _run(
  c, arm: Arm, model: ModelSpec, tiles: AttentionSection
) -> tuple[ModelSpec, RunSpec]:
  """The model and run of one arm."""
  if arm.variant == "candidate":
    kind, policy = str(c.candidate).strip(), "fp32"
  elif arm.variant == CONTEXT_PARALLEL:
    kind, policy = VARIANTS["flash"]
  elif arm.variant == "low_precision":
    kind, policy = "flash", Precision.from_name(str(c.low_precision)).name
  else:
    kind, policy = VARIANTS[arm.variant]
  if policy == "natural":
    role = "flash" if kind in FLASH_IMPLEMENTATIONS else "baseline"
    policy = natural_policy(arm.precision, role)
  elif policy == "stable":
    policy = stable_policy(arm.precision)
  m = arm.mitigation
  options = Options(
    precision=policy,
    block_q=tiles.block_q,
    block_k=tiles.block_k,
  )
  features = Features(causal=True)
  if m in features_lib.names():
    features = features.replace(**{m: float(c.strengths[m])})
  # A kernel option lives in the flash kernel; the others run as is.
  if m in options_lib.field_names() and kind in FLASH_IMPLEMENTATIONS:
    options = options.replace(**{m: float(c.strengths[m])})
  attention = AttentionSpec(
    kind=kind,
    options=options,
    features=features,
    context_parallel=context_devices(c)
    if arm.variant == CONTEXT_PARALLEL
    else 1,
  )
  run = RunSpec(
    attention=attention,
    precision=arm.precision,
    mixed_precision=str(c.train.mixed_precision),
    z_loss=float(c.strengths.z_loss) if m == "z_loss" else 0.0,
  )
  return dataclasses.replace(model, qk_norm=m == "qk_norm"), run


def _choice(value, name: str, valid) -> str:
  value = str(value).strip()
  if value not in valid:
    raise ValueError(f"config.{name}: unknown {value!r}; valid: {list(valid)}.")
  return value
