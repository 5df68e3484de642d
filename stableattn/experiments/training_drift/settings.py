"""The drift experiment's configuration, validated into typed settings."""

from __future__ import annotations

import dataclasses

import jax

from stableattn.attention_fns import IMPLEMENTATIONS, resolve
from stableattn.dispatch import xla_unsupported_reason
from stableattn.experiments.config_values import as_tuple, field
from stableattn.experiments.training_drift.pairs import BY_NAME, PAIRS
from stableattn.experiments.training_drift.variants import VARIANTS, Variant
from stableattn.model import SHADOW, AttentionSpec, ModelSpec
from stableattn.options import SCHEMES, Options
from stableattn.precision import Precision, natural_policy, preset_names
from stableattn.training import COMPUTE_DTYPES, OptimizerSpec, RunSpec

COMPARE_MODES = ("natural", "shared")
KINDS = (*IMPLEMENTATIONS, SHADOW)  # what the base and flash runs may use
CORPORA = ("generated", "python_stdlib")


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
  compare: str  # "natural": each kernel's own policy; "shared": Flash's

  @property
  def physical_runs(self) -> dict[str, RunSpec]:
    """One entry per distinct RunSpec (first variant name wins)."""
    out = {}
    for name, spec in self.runs.items():
      if spec not in out.values():
        out[name] = spec
    return out

  def physical_name(self, variant: str) -> str:
    spec = self.runs[variant]
    return next(n for n, s in self.physical_runs.items() if s == spec)

  @property
  def flash_runs(self) -> list[str]:
    """Physical runs whose attention is our flash kernel (the runs whose
    attention-gradient error the Trainer can measure)."""
    return [
      name
      for name, spec in self.physical_runs.items()
      if spec.attention.kind == "pallas"
    ]


def _policy(
  name: str, implementation: str, precision: str, compare: str = "natural"
) -> str:
  """The attention policy of a run: `name`, or for 'auto' the kernel's
  natural policy at the training format ('shared': Flash's for both)."""
  if name != "auto":
    if name not in preset_names():
      raise ValueError(
        f"Unknown attention precision {name!r}; valid: 'auto' or "
        f"{preset_names()}."
      )
    return name
  kernel = (
    "flash" if implementation == "pallas" or compare == "shared" else "baseline"
  )
  return natural_policy(precision, kernel)


def settings_from_config(config) -> Settings:
  """Validates the ConfigDict (fails fast) and builds typed settings."""
  c = config
  _choice(c.train.precision, "train.precision", COMPUTE_DTYPES)
  for name in (c.attention.baseline, c.attention.flash):
    if name not in KINDS:
      raise ValueError(
        f"Unknown attention {name!r}; valid: {', '.join(KINDS)}."
      )
  candidate = str(c.attention.get("candidate", "") or "").strip()
  if candidate:
    resolve(candidate)  # one clear line for a name that does not resolve
  devices = field(c, "train.devices", minimum=0) or jax.device_count()
  pairs = _pairs(c, devices)
  batch_size = field(c, "train.batch_size", minimum=1)
  if batch_size % devices:
    raise ValueError(
      f"train.batch_size {batch_size} is not divisible by the device count "
      f"{devices}."
    )
  variants = {run for p in pairs for run in BY_NAME[p].runs}
  runs = {
    name: _run_spec(c, VARIANTS[name], devices)
    for name in VARIANTS
    if name in variants
  }
  _check_xla_runs(runs, pairs)
  return Settings(
    model=_model(c),
    optimizer=_optimizer(c),
    runs=runs,
    pairs=pairs,
    replicates=field(c, "train.replicates", minimum=1),
    batch_size=batch_size,
    seq_len=field(c, "model.seq_len", minimum=2),
    log_every=field(c, "train.log_every", minimum=1),
    checkpoint_every=field(c, "train.checkpoint_every", minimum=1),
    stop_at_step=field(c, "train.stop_at_step", minimum=0),
    data_seed=field(c, "data.seed", minimum=0),
    data_path=str(c.data.path),
    corpus=_choice(c.data.corpus, "data.corpus", CORPORA),
    corpus_tokens=field(c, "data.corpus_tokens", minimum=1),
    grad_error=bool(c.train.grad_error),
    compare=_choice(c.attention.compare, "attention.compare", COMPARE_MODES),
  )


def _pairs(c, devices: int) -> tuple[str, ...]:
  """`config.pairs` ("all": every pair whose config is set) that exist on
  `devices`."""
  names = as_tuple(c.pairs)
  if names == ("all",):
    names = tuple(p.name for p in PAIRS if not p.requires or _set(c, p))
  unknown = [p for p in names if p not in BY_NAME]
  if unknown:
    raise ValueError(
      f"Unknown pairs {unknown}; valid: {list(BY_NAME)} or 'all'."
    )
  for name in names:
    if BY_NAME[name].requires and not _set(c, BY_NAME[name]):
      raise ValueError(
        f"pair {name!r} needs config.{BY_NAME[name].requires} "
        f"({REQUIRED_TEXT[BY_NAME[name].requires]})."
      )
  return tuple(p for p in names if devices >= BY_NAME[p].min_devices)


REQUIRED_TEXT = {
  "attention.candidate": "a kernel name or 'package.module:function'",
  "attention.low_precision": "a policy below 16 bits, e.g. fp8-fa3",
}


def _low_precision(c) -> str:
  name = str(c.attention.low_precision).strip()
  policy = Precision.from_name(name)
  if not policy.quantizes:
    raise ValueError(
      f"attention.low_precision {name!r} has {policy.matmul_operands} "
      "matmul operands; give a policy below 16 bits, e.g. fp8-fa3, "
      "fp8-sage or fp4-nvfp4."
    )
  return policy.name


def _set(c, pair) -> bool:
  section, name = pair.requires.split(".")
  return bool(str(c[section].get(name, "") or "").strip())


def _choice(value, name: str, valid) -> str:
  value = str(value)
  if value in valid:
    return value
  if name == "train.precision":
    raise ValueError(
      f"Unknown training precision {value!r}; valid: {list(valid)}."
    )
  hint = " (or set data.path to your own tokens)"
  raise ValueError(
    f"config.{name}: unknown {value!r}; valid: {list(valid)}"
    f"{hint if name == 'data.corpus' else ''}."
  )


def _model(c) -> ModelSpec:
  model = ModelSpec(
    vocab_size=field(c, "model.vocab_size", minimum=2),
    width=field(c, "model.width", minimum=1),
    depth=field(c, "model.depth", minimum=1),
    heads=field(c, "model.heads", minimum=1),
    max_len=field(c, "model.seq_len", minimum=2),
    mlp_ratio=field(c, "model.mlp_ratio", minimum=1),
  )
  if model.width % model.heads:
    raise ValueError(
      f"model.width {model.width} is not divisible by "
      f"model.heads {model.heads}."
    )
  return model


def _optimizer(c) -> OptimizerSpec:
  total = field(c, "train.total_steps", minimum=1)
  if total <= field(c, "train.warmup_steps", minimum=0):
    raise ValueError(
      f"train.total_steps ({total}) must exceed train.warmup_steps "
      f"({c.train.warmup_steps}): the cosine decay needs at least one step."
    )
  return OptimizerSpec(
    learning_rate=field(c, "train.learning_rate", float),
    warmup_steps=field(c, "train.warmup_steps", minimum=0),
    total_steps=total,
    weight_decay=field(c, "train.weight_decay", float),
    clip_norm=field(c, "train.clip_norm", float),
  )


def _extra_options(c) -> dict:
  """Each variant's `Options` changes ("name=value,..." in the config),
  validated now: one clear line for an unknown name or a bad value."""
  out = {None: ""}
  for key, name in (("flash", "flash_options"), ("fix", "fix")):
    text = str(c.attention.get(name, "") or "")
    try:
      Options.from_string(text)
    except ValueError as e:
      raise ValueError(f"config.attention.{name}: {e}") from None
    out[key] = text
  return out


def _run_spec(c, variant: Variant, devices: int) -> RunSpec:
  """The RunSpec of one variant under this config."""
  precision = variant.precision or c.train.precision
  kind = str(c.attention[variant.attention]).strip()
  compare = str(c.attention.compare)
  flash_policy = _policy(c.attention.flash_precision, "pallas", precision)
  if variant.low_precision:
    flash_policy = _low_precision(c)
  baseline = _policy(
    c.attention.baseline_precision, "reference", precision, compare
  )
  tiles = Options(
    precision=baseline,
    block_q=field(c, "attention.block_q", minimum=1),
    block_k=field(c, "attention.block_k", minimum=1),
    scheme=_choice(c.attention.scheme, "attention.scheme", SCHEMES),
  )
  if kind == "pallas":
    flash = tiles.replace(precision=flash_policy + variant.flash_stages)
    options = Options.from_string(_extra_options(c)[variant.options], flash)
  else:
    options = tiles
  return RunSpec(
    attention=AttentionSpec(kind=kind, options=options, shadow_baseline=tiles),
    precision=precision,
    devices=1 if variant.single_device else devices,
    init_seed=variant.init_seed,
    replica=variant.replica,
  )


def _check_xla_runs(runs: dict, pairs) -> None:
  for name, spec in runs.items():
    if spec.attention.kind != "xla":
      continue
    reason = xla_unsupported_reason(spec.attention.options.precision)
    if reason:
      raise ValueError(
        f"run {name!r} ({spec.precision} training with attention 'xla', "
        f"needed by pairs {list(pairs)}): {reason}"
      )
