"""The benchmark's configuration, validated into plain settings."""

from __future__ import annotations

import dataclasses
import importlib.util

import jax

from stableattn.contract.features import Features
from stableattn.harness.config_values import (
  as_tuple,
  booleans,
  field,
  field_tuple,
  from_section,
  spec,
)
from stableattn.numerics.precision import Precision, natural_policy
from stableattn.ops.registry import (
  IMPLEMENTATIONS,
  NAMES,
  PEERS,
  TOKAMAX,
  needs_gpu,
)

MODES = ("forward", "forward_backward")


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class Settings:
  implementations: tuple[str, ...]
  modes: tuple[str, ...]
  causal: tuple[bool, ...]
  precisions: tuple[str, ...]  # presets timed; inputs in each's format
  head_dims: tuple[int, ...]
  seq_lens: tuple[int, ...]
  batch: int
  heads: int
  block_q: int
  block_k: int
  warmup: int
  repeats: int
  memory_seq_lens: tuple[int, ...]
  memory_implementations: tuple[str, ...]
  tile_search: bool
  search_seq_len: int
  mask_settings: tuple[str, ...]  # block skipping: timed at masks_seq_len
  masks_seq_len: int
  # Time the attention monitor in training, at the sizes of the config
  # block `monitor`.
  monitor_overhead: bool = False
  monitor: object = None


def _policy_names(raw, name: str) -> tuple[str, ...]:
  names = as_tuple(raw)
  for policy in names:
    Precision.from_name(policy)  # a clear error naming the valid presets
  return names


@dataclasses.dataclass(frozen=True)
class DeviceSection:
  """The `cpu` or `gpu` block: sizes for the backend that runs."""

  dtypes: tuple[str, ...] = spec(allow_empty=True)
  policies: tuple[str, ...] = spec(parse=_policy_names)
  seq_lens: tuple[int, ...] = spec(minimum=1)
  batch: int = spec(minimum=1)
  heads: int = spec(minimum=1)
  block_q: int = spec(minimum=1)
  block_k: int = spec(minimum=1)
  memory_seq_lens: tuple[int, ...] = spec(minimum=1, allow_empty=True)
  search_seq_len: int = spec(minimum=1)
  masks_seq_len: int = spec(minimum=1)

  @property
  def precisions(self) -> tuple[str, ...]:
    """`policies` if given, else each dtype's flash-kernel policy."""
    if self.policies:
      return self.policies
    return tuple(natural_policy(dtype, "flash") for dtype in self.dtypes)


def settings_from_config(c) -> Settings:
  gpu = on_gpu()
  device = from_section(DeviceSection, c, "gpu" if gpu else "cpu")
  return Settings(
    implementations=_implementations(c, gpu),
    modes=_choices(c, "modes", MODES),
    causal=booleans(c.causal, "causal"),
    precisions=device.precisions,
    head_dims=field_tuple(c, "head_dims", int, minimum=1),
    seq_lens=device.seq_lens,
    batch=device.batch,
    heads=device.heads,
    block_q=device.block_q,
    block_k=device.block_k,
    warmup=field(c, "warmup", minimum=0),
    repeats=field(c, "repeats", minimum=1),
    memory_seq_lens=device.memory_seq_lens,
    memory_implementations=_choices(
      c, "memory_implementations", IMPLEMENTATIONS, allow_empty=True
    ),
    tile_search=bool(c.tile_search) and gpu,
    search_seq_len=device.search_seq_len,
    mask_settings=_mask_settings(c),
    monitor_overhead=bool(c.get("monitor_overhead", False)),
    monitor=c.get("monitor"),
    masks_seq_len=device.masks_seq_len,
  )


# The masks whose skipped key blocks the benchmark times against "full".
MASK_SETTINGS = {
  "full": Features(),
  "causal": Features(causal=True),
  "window_256": Features(causal=True, local_window_size=(256, 0)),
  "window_1024": Features(causal=True, local_window_size=(1024, 0)),
}


def _mask_settings(c) -> tuple[str, ...]:
  names = _choices(c, "mask_settings", tuple(MASK_SETTINGS), allow_empty=True)
  if names and "full" not in names:
    raise ValueError(
      f"config.mask_settings {list(names)} needs 'full': every other "
      "setting is timed against it."
    )
  return names


def gpu_peers() -> tuple[str, ...]:
  """Peers that join the configured names on a GPU: those that run on the
  device and are installed. PyTorch's kernels reach it through a host
  callback, whose copies a timing would count: timed only when named."""
  has_tokamax = importlib.util.find_spec("tokamax") is not None
  return tuple(
    p
    for p in PEERS
    if not p.startswith("torch") and (has_tokamax or p not in TOKAMAX)
  )


def _implementations(c, gpu: bool) -> tuple[str, ...]:
  """The configured names; on a GPU the device-side peers join them."""
  names = as_tuple(c.implementations)
  if gpu:
    names += tuple(p for p in gpu_peers() if p not in names)
  for name in names:
    if name not in NAMES:
      raise ValueError(
        f"Unknown implementation {name!r}; valid: {list(NAMES)}."
      )
    if needs_gpu(name) and not gpu:
      raise ValueError(f"Implementation {name!r} needs a GPU.")
  return names


def _choices(c, name: str, valid, allow_empty: bool = False):
  values = field_tuple(c, name, str, allow_empty=allow_empty)
  bad = [v for v in values if v not in valid]
  if bad:
    raise ValueError(f"config.{name}: unknown {bad}; valid: {list(valid)}.")
  return values
