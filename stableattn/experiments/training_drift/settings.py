"""The drift experiment's configuration, validated into typed settings."""

from __future__ import annotations

import dataclasses

import jax

from stableattn.contract.options import SCHEMES, Options
from stableattn.experiments import sections
from stableattn.experiments.sections import ModelSection
from stableattn.experiments.training_drift.pairs import (
  BY_NAME,
  MACHINE_RUN,
  PAIRS,
)
from stableattn.experiments.training_drift.variants import VARIANTS, Variant
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
  preset_names,
  stable_policy,
)
from stableattn.ops.dispatch import (
  FLASH_IMPLEMENTATIONS,
  xla_unsupported_reason,
)
from stableattn.ops.registry import IMPLEMENTATIONS, resolve
from stableattn.training.attention_spec import RING_KINDS
from stableattn.training.compute_format import MIXED_PRECISION, ComputeFormat
from stableattn.training.model import SHADOW, AttentionSpec, ModelSpec
from stableattn.training.trainer import COMPUTE_DTYPES, OptimizerSpec, RunSpec

COMPARE_MODES = ("natural", "shared")
MACHINE_PAIR = "other_machine"
KINDS = (*IMPLEMENTATIONS, SHADOW)  # what the base and flash runs may use


@dataclasses.dataclass(frozen=True)
class Settings:
  model: ModelSpec
  optimizer: OptimizerSpec
  runs: dict  # variant name -> RunSpec
  pairs: tuple[str, ...]
  replicates: int
  batch_size: int
  seq_len: int
  log_every: int
  checkpoint_every: int
  stop_at_step: int
  data_seed: int
  data_path: str
  corpus: str  # "generated" or "python_stdlib" (when data_path is "")
  corpus_tokens: int
  grad_error: bool  # measure flash runs' attention-gradient error
  capture_steps: tuple[int, ...]  # steps whose attention tensors are saved
  capture_rows: int
  capture_layers: tuple[int, ...]
  compare: str  # "natural": each kernel's own policy; "shared": Flash's
  # XLA_FLAGS of the other machine the base run is trained on again (pair
  # other_machine), and its label; None and the reason where there is none.
  machine_flags: str | None = None
  machine: str = "pair other_machine not asked for"

  @property
  def physical_runs(self) -> dict[str, RunSpec]:
    """One entry per distinct RunSpec (first variant name wins)."""
    out = {}
    for name, run in self.runs.items():
      if run not in out.values():
        out[name] = run
    return out

  def physical_name(self, variant: str) -> str:
    if variant == MACHINE_RUN:
      return MACHINE_RUN
    run = self.runs[variant]
    return next(n for n, s in self.physical_runs.items() if s == run)

  @property
  def flash_runs(self) -> list[str]:
    """Physical runs whose attention is our flash kernel (the runs whose
    attention-gradient error the Trainer can measure; on one device)."""
    return [
      name
      for name, run in self.physical_runs.items()
      if run.attention.kind in FLASH_IMPLEMENTATIONS
      and run.attention.context_parallel == 1
    ]


def _policy(
  name: str, implementation: str, precision: str, compare: str = "natural"
) -> str:
  """The attention policy of a run: `name`, or for 'auto' the kernel's
  natural policy at the training format ('shared': Flash's for both)."""
  if name != "auto":
    return name
  kernel = (
    "flash" if implementation == "pallas" or compare == "shared" else "baseline"
  )
  return natural_policy(precision, kernel)


@dataclasses.dataclass(frozen=True)
class TrainSection:
  precision: str = spec(choices=COMPUTE_DTYPES)
  mixed_precision: str = spec(choices=MIXED_PRECISION)
  replicates: int = spec(minimum=1)
  batch_size: int = spec(minimum=1)
  total_steps: int = spec(minimum=1)
  learning_rate: float = spec()
  warmup_steps: int = spec(minimum=0)
  weight_decay: float = spec()
  clip_norm: float = spec()
  log_every: int = spec(minimum=1)
  checkpoint_every: int = spec(minimum=1)
  devices: int = spec(minimum=0)
  stop_at_step: int = spec(minimum=0)
  grad_error: bool = spec()
  # Steps after which every attention layer's q, k, v and dO of the flash
  # run (first replicate) are saved under captures/ (the next step's
  # batch, `capture_rows` rows of it); empty: none.
  capture_steps: tuple[int, ...] = spec(minimum=0, allow_empty=True)
  capture_rows: int = spec(minimum=1)
  # The layers kept (a large model's subset); empty: every layer.
  capture_layers: tuple[int, ...] = spec(minimum=0, allow_empty=True)

  def __post_init__(self):
    if self.total_steps <= self.warmup_steps:
      raise ValueError(
        f"train.total_steps ({self.total_steps}) must exceed "
        f"train.warmup_steps ({self.warmup_steps}): the cosine decay needs "
        "at least one step."
      )

  def optimizer(self) -> OptimizerSpec:
    return OptimizerSpec(
      learning_rate=self.learning_rate,
      warmup_steps=self.warmup_steps,
      total_steps=self.total_steps,
      weight_decay=self.weight_decay,
      clip_norm=self.clip_norm,
    )


def _precision_name(raw, name: str) -> str:
  """'auto' or a preset name."""
  value = str(raw).strip()
  if value != "auto" and value not in preset_names():
    raise ValueError(
      f"Unknown attention precision {value!r} (config.{name}); valid: "
      f"'auto' or {preset_names()}."
    )
  return value


def _kernel_options(raw, name: str) -> str:
  """Options changes "name=value,...", validated now."""
  try:
    Options.from_string(raw)
  except ValueError as e:
    raise ValueError(f"config.{name}: {e}") from None
  return str(raw)


def _optional_kernel(raw, name: str) -> str:
  value = str(raw or "").strip()
  if value:
    resolve(value)  # one clear line for a name that does not resolve
  return value


def _low_precision(raw, name: str) -> str:
  value = str(raw or "").strip()
  if not value:
    return ""
  policy = Precision.from_name(value)
  if not policy.quantizes:
    raise ValueError(
      f"config.{name} {value!r} has {policy.matmul_operands} matmul "
      "operands; give a policy below 16 bits, e.g. fp8-fa3, fp8-sage or "
      "fp4-nvfp4."
    )
  return policy.name


@dataclasses.dataclass(frozen=True)
class AttentionSection(sections.TileSection):
  baseline: str = spec(choices=KINDS)  # attention of the base run
  flash: str = spec(choices=KINDS)  # attention of the run compared with it
  flash_precision: str = spec(parse=_precision_name)
  baseline_precision: str = spec(parse=_precision_name)
  compare: str = spec(choices=COMPARE_MODES)
  scheme: str = spec(choices=SCHEMES)
  flash_options: str = spec(parse=_kernel_options)
  fix: str = spec(parse=_kernel_options)
  candidate: str = spec(parse=_optional_kernel)
  low_precision: str = spec(parse=_low_precision)
  context_parallel: int = spec(parse=ring_devices)


@dataclasses.dataclass(frozen=True)
class DataSection(sections.DataSection):
  path: str = spec()  # your tokens: .npy, .bin (uint16) or text


def settings_from_config(config, *, twin: bool = False) -> Settings:
  """Validates the ConfigDict (fails fast) and builds typed settings.

  twin: the settings of the other-machine child process, which trains the
  base run alone.
  """
  c = config
  model = from_section(ModelSection, c, "model")
  train = from_section(TrainSection, c, "train")
  attention = from_section(AttentionSection, c, "attention")
  data = from_section(DataSection, c, "data")
  devices = train.devices or jax.device_count()
  beyond = [i for i in train.capture_layers if i >= model.depth]
  if beyond:
    raise ValueError(
      f"train.capture_layers {beyond} do not exist; the model has layers "
      f"0-{model.depth - 1}."
    )
  pairs = _pairs(c, attention, devices)
  flags, machine = None, Settings.machine
  if MACHINE_PAIR in pairs and not twin:
    flags, machine = environment.other_machine_flags()
    if flags is None and as_tuple(c.pairs) != ("all",):
      raise ValueError(
        f"pair {MACHINE_PAIR!r} needs another machine to compile for, and "
        f"there is none here: {machine}."
      )
  if flags is None:
    pairs = tuple(p for p in pairs if p != MACHINE_PAIR)
  if train.batch_size % devices:
    raise ValueError(
      f"train.batch_size {train.batch_size} is not divisible by the device "
      f"count {devices}."
    )
  variants = {run for p in pairs for run in BY_NAME[p].runs}
  if twin:  # the base run alone, measuring no pair (its parent does)
    pairs, variants = (), {"base"}
  runs = {
    name: _run_spec(attention, train, VARIANTS[name], devices)
    for name in VARIANTS
    if name in variants
  }
  _check_xla_runs(runs, pairs)
  return Settings(
    model=model.spec(),
    optimizer=train.optimizer(),
    runs=runs,
    pairs=pairs,
    replicates=train.replicates,
    batch_size=train.batch_size,
    seq_len=model.seq_len,
    log_every=train.log_every,
    checkpoint_every=train.checkpoint_every,
    stop_at_step=0 if twin else train.stop_at_step,
    data_seed=data.seed,
    data_path=data.path,
    corpus=data.corpus,
    corpus_tokens=data.corpus_tokens,
    grad_error=train.grad_error and not twin,
    capture_steps=() if twin else train.capture_steps,
    capture_rows=train.capture_rows,
    capture_layers=train.capture_layers,
    compare=attention.compare,
    machine_flags=flags,
    machine=machine,
  )


def _pairs(c, attention: AttentionSection, devices: int) -> tuple[str, ...]:
  """`config.pairs` ("all": every pair whose config is set, the ablation's
  left out) that exist on `devices`."""
  names = as_tuple(c.pairs)
  if names == ("all",):
    names = tuple(
      p.name
      for p in PAIRS
      if p.in_all and (not p.requires or _set(attention, p))
    )
  unknown = [p for p in names if p not in BY_NAME]
  if unknown:
    raise ValueError(
      f"Unknown pairs {unknown}; valid: {list(BY_NAME)} or 'all'."
    )
  for name in names:
    if BY_NAME[name].requires and not _set(attention, BY_NAME[name]):
      raise ValueError(
        f"pair {name!r} needs config.{BY_NAME[name].requires} "
        f"({REQUIRED_TEXT[BY_NAME[name].requires]})."
      )
  return tuple(p for p in names if devices >= BY_NAME[p].min_devices)


REQUIRED_TEXT = {
  "attention.candidate": "a kernel name or 'package.module:function'",
  "attention.low_precision": "a policy below 16 bits, e.g. fp8-fa3",
  "attention.context_parallel": "the devices of the ring, e.g. 2",
}


def _set(attention: AttentionSection, pair) -> bool:
  return bool(getattr(attention, pair.requires.split(".")[1]))


def _run_spec(
  a: AttentionSection, train: TrainSection, variant: Variant, devices: int
) -> RunSpec:
  """The RunSpec of one variant under this config."""
  precision = variant.precision or train.precision
  compute = ComputeFormat(
    precision, train.mixed_precision, variant.fp32_classes
  )
  kind = getattr(a, variant.attention)
  attention_precision = compute.attention_precision
  flash_policy = _policy(a.flash_precision, "pallas", attention_precision)
  if variant.low_precision:
    flash_policy = a.low_precision
  if variant.stable:
    flash_policy = stable_policy(precision)
  baseline = _policy(
    a.baseline_precision, "reference", attention_precision, a.compare
  )
  tiles = Options(
    precision=baseline, block_q=a.block_q, block_k=a.block_k, scheme=a.scheme
  )
  options = tiles
  if kind in FLASH_IMPLEMENTATIONS:
    flash = tiles.replace(precision=flash_policy + variant.flash_stages)
    extra = {None: "", "flash": a.flash_options, "fix": a.fix}
    options = Options.from_string(extra[variant.options], flash)
  context = a.context_parallel if variant.context_parallel else 1
  if context > 1 and kind not in RING_KINDS:
    raise ValueError(
      f"config.attention.context_parallel={context} runs the flash kernel "
      f"as ring attention; config.attention.flash must be one of "
      f"{list(RING_KINDS)}, got "
      f"{kind!r}."
    )
  return RunSpec(
    attention=AttentionSpec(
      kind=kind,
      options=options,
      shadow_baseline=tiles,
      context_parallel=context,
    ),
    precision=precision,
    mixed_precision=train.mixed_precision,
    fp32_classes=variant.fp32_classes,
    devices=1 if variant.single_device or context > 1 else devices,
    init_seed=variant.init_seed,
    replica=variant.replica,
  )


def _check_xla_runs(runs: dict, pairs) -> None:
  for name, run in runs.items():
    if run.attention.kind != "xla":
      continue
    reason = xla_unsupported_reason(run.attention.options.precision)
    if reason:
      raise ValueError(
        f"run {name!r} ({run.precision} training with attention 'xla', "
        f"needed by pairs {list(pairs)}): {reason}"
      )
