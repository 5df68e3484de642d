"""`Options`: how the attention kernel computes, as one hashable value.

Every caller (`stableattn.attention`, the Flax drop-in, the model, the
registry, the experiments) holds one `Options` instead of re-threading
its fields as keywords, so a new kernel option is one field here and its
use in the kernel. What attention computes (masks and score features)
lives apart, in `stableattn.contract.features.Features`.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os

import numpy as np

from stableattn.contract.tiling import check_block_size, check_flag
from stableattn.numerics.precision import Precision, resolve

SCHEMES = ("fa2", "fa1")
# The Hopper path's forward in FlashAttention-3's form, switch by switch
# (`hopper_form`); without them it takes the form jax's GPU interpreter
# runs (`kernels.mosaic_forward`).
HOPPER_SWITCHES = (
  "warp_specialized",
  "two_consumers",
  "k_as_stored",
  "p_in_registers",
  "accumulate_in_place",
)

HOPPER_FORMS = ("interpreter", "fa3")


# XLA:CPU's scheduler must not interleave independent work for jax's GPU
# interpreter to run more than one warpgroup: each warpgroup's program is
# an XLA:CPU execution of its own, and with the concurrency-optimized
# schedule one may wait on XLA:CPU's intra-op thread pool while every
# thread of that pool is held by a warpgroup blocked in a barrier wait or
# by the interpreter waiting for the warpgroups: a deadlock (jax 0.10.2:
# every run on one core, 1 in 10 on two with three warpgroups; jax's own
# warp-specialized pipeline hangs the same way, `launch/
# interpreter_stall.py`, docs/findings.md). With the flag set before jax
# starts no measured run stalled, and the results measured were bit for
# bit the same.
SEQUENTIAL_SCHEDULE_FLAG = (
  "--xla_cpu_enable_concurrency_optimized_scheduler=false"
)


def sequential_schedule_set() -> bool:
  """Whether the environment's XLA_FLAGS hold `SEQUENTIAL_SCHEDULE_FLAG`."""
  return SEQUENTIAL_SCHEDULE_FLAG in os.environ.get("XLA_FLAGS", "").split()


def _hopper_form(value) -> str:
  """ "interpreter", "fa3" (every switch), or switches joined by "+"; held
  canonically (switches in `HOPPER_SWITCHES`' order)."""
  valid = (
    f"{list(HOPPER_FORMS)} or switches of {list(HOPPER_SWITCHES)} joined by '+'"
  )
  if not isinstance(value, str) or not value:
    raise ValueError(f"hopper_form must be one of {valid}, got {value!r}.")
  if value in HOPPER_FORMS:
    return value
  switches = value.split("+")
  unknown = [s for s in switches if s not in HOPPER_SWITCHES]
  if unknown:
    raise ValueError(
      f"hopper_form={value!r}: unknown {unknown}; valid: {valid}."
    )
  chosen = [s for s in HOPPER_SWITCHES if s in switches]
  if len(chosen) == len(HOPPER_SWITCHES):
    return "fa3"
  return "+".join(chosen)


def hopper_switches(form: str) -> tuple[str, ...]:
  """The switches a (canonical) `hopper_form` turns on."""
  if form == "interpreter":
    return ()
  if form == "fa3":
    return HOPPER_SWITCHES
  return tuple(form.split("+"))


# Options that change the arithmetic beyond the policy (None: off); only
# our kernel and reference implement them, not jax's own attention.
ARITHMETIC_OPTIONS = ("tie_beta",)


def _tile(name: str, value, optional: bool = False):
  """A positive integer (None where optional); the shape checks come when
  a call resolves the options (`dispatch.kernel_config`)."""
  if value is None and optional:
    return None
  return check_block_size(name, value, for_gpu=False)


def _tie_beta(value) -> float | None:
  """Qiu & Yao's beta: None, or a finite number > 1."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(
    value, (int, float, np.floating, np.integer)
  ):
    raise ValueError(
      f"tie_beta must be None or a number > 1 (Qiu & Yao use 2 to 8), got "
      f"{type(value).__name__} {value!r}."
    )
  beta = float(value)
  if not math.isfinite(beta) or beta <= 1.0:
    raise ValueError(
      f"tie_beta must be a finite number > 1 (Qiu & Yao use 2 to 8), got "
      f"{value!r}; None disables the fix."
    )
  return beta


@dataclasses.dataclass(frozen=True)
class Options:
  """How the kernel computes: precision policy, tiles, scheme, compiler.

  Frozen and hashable (a static `jax.jit` argument). Fields are validated
  when the object is built; checks that need the shapes (a tile against
  the sequence, what a GPU can compile) run when a call uses it.

  Attributes:
    precision: a preset name (`stableattn.preset_names()`) or a
      `stableattn.Precision`; held as the resolved `Precision`.
    block_q, block_k: forward tile sizes B_r and B_c (any positive size in
      interpret mode; powers of two >= 16 on a GPU).
    bwd_block_q, bwd_block_k: backward tile sizes; None: the forward's.
    scheme: "fa2" (normalize once at the end) or "fa1" (renormalize after
      every key block).
    tie_beta: None for the standard safe softmax, or beta > 1 for Qiu &
      Yao's fix (arXiv 2510.04212, Alg. 1): where scores tie at a row's
      maximum r_m, subtract beta * r_m (or 0 if r_m < 0) instead of r_m,
      so no probability is exactly 1. The kernel applies it per tile, the
      reference per row; "xla" does not support it.
    num_splits: split-KV (flash-decoding) with this many splits of each
      query block's keys, each a separate program whose partial output
      and log-sum-exp are merged (FlashAttention's `num_splits`); the
      boundaries move with the cache length. None: one pass.
    split_size: split-KV with this many keys per split (a multiple of
      block_k): boundaries at fixed key positions, so a row's result does
      not depend on the batch or the cache's padding (SGLang's and
      FlashInfer's batch-invariant mode). Exclusive with num_splits.
    fixed_tiles: keep the tile sizes for sequences shorter than a tile
      (padding them) instead of clamping the tiles to the sequence. A
      row's sums then do not depend on how many queries or keys the call
      has: a decoded query and a chunk of prefill compute as their rows
      of the full pass, bitwise, at the cost of padded work (the fixed
      tiles of batch-invariant kernels, Thinking Machines 2025).
    center_kv: run the flash kernel on K and V less their per-head mean
      over the attended keys and add V's mean back to every row that
      attends a key (`stableattn.kernels.centring`): exact, and it takes
      the shared key and value components out of the backward's
      delta = rowsum(dO * O) error (Qiu & Yao, Eq. 1). Our flash kernels
      (pallas, mosaic_gpu) only; not with a sink, a softcap or a
      quantizing policy.
    hopper_form: the Hopper path's (implementation="mosaic_gpu") forward:
      "interpreter" (tested on a CPU in jax's GPU interpret mode), "fa3"
      (FlashAttention-3's form: a copy warpgroup filling the K/V ring, K
      read as stored through a transposed shared-memory view, P handed
      to wgmma from registers, P V accumulated in place), or some of
      those switches joined by "+" ("warp_specialized", "k_as_stored",
      "p_in_registers", "accumulate_in_place"), to time each on a GPU.
    num_warps, num_stages: Triton compiler parameters (GPU only).
    interpret: run the Pallas kernel in interpret mode; None means "iff
      the default backend is the CPU".
  """

  precision: str | Precision = "bf16"
  block_q: int = 64
  block_k: int = 64
  bwd_block_q: int | None = None
  bwd_block_k: int | None = None
  scheme: str = "fa2"
  tie_beta: float | None = None
  num_splits: int | None = None
  split_size: int | None = None
  fixed_tiles: bool = False
  center_kv: bool = False
  hopper_form: str = "interpreter"
  num_warps: int | None = None
  num_stages: int | None = None
  interpret: bool | None = None

  def __post_init__(self):
    def put(name, value):
      object.__setattr__(self, name, value)

    put("precision", resolve(self.precision))
    for name in ("block_q", "block_k"):
      put(name, _tile(name, getattr(self, name)))
    for name in (
      "bwd_block_q",
      "bwd_block_k",
      "num_splits",
      "split_size",
      "num_warps",
      "num_stages",
    ):
      put(name, _tile(name, getattr(self, name), optional=True))
    if self.num_splits is not None and self.split_size is not None:
      raise ValueError(
        f"num_splits={self.num_splits} and split_size={self.split_size} "
        "both choose how split-KV divides the keys; give one of them (a "
        "fixed split_size is the batch-invariant choice)."
      )
    if self.scheme not in SCHEMES:
      raise ValueError(
        f"Unknown scheme {self.scheme!r}; valid: {list(SCHEMES)}."
      )
    put("tie_beta", _tie_beta(self.tie_beta))
    if self.scheme != "fa2" and self.precision.mma_chunk:
      raise ValueError(
        f"The MMA accumulator options (mma_chunk) model FlashAttention-2's "
        f"and -3's rescaling; scheme={self.scheme!r} renormalizes every "
        "tile. Use scheme='fa2'."
      )
    if self.tie_beta is not None and self.precision.exp2:
      raise ValueError(
        f"tie_beta={self.tie_beta} shifts natural-log scores; the policy "
        f"{self.precision.name!r} takes exp in base 2 (exp2=on). Use one "
        "of them."
      )
    put("fixed_tiles", check_flag("fixed_tiles", self.fixed_tiles))
    put("center_kv", check_flag("center_kv", self.center_kv))
    put("hopper_form", _hopper_form(self.hopper_form))
    if self.interpret is not None:
      put("interpret", check_flag("interpret", self.interpret))

  @property
  def policy(self) -> Precision:
    return self.precision

  def replace(self, **changes) -> Options:
    """A copy with `changes` (field names of `Options`), validated."""
    check_names(changes, "Options")
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_string(cls, text: str, base: Options | None = None) -> Options:
    """Options from "name=value,..." (config files), over `base`.

    Values are read as Python literals where they parse ("64", "2.0",
    "None", "True"), else as strings ("bf16-fa2").
    """
    base = cls() if base is None else base
    changes = {}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
      name, sep, value = item.partition("=")
      if not sep:
        raise ValueError(
          f"Kernel option {item!r} must look like name=value; valid names: "
          f"{field_names()}."
        )
      changes[name.strip()] = _literal(value.strip())
    return base.replace(**changes)


def _literal(text: str):
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def field_names() -> list[str]:
  return [f.name for f in dataclasses.fields(Options)]


def check_names(values: dict, what: str) -> None:
  """Raises for keys of `values` that are not fields of `Options`."""
  unknown = sorted(set(values) - set(field_names()))
  if unknown:
    raise ValueError(
      f"Unknown {what} fields {unknown}; valid: {field_names()}."
    )
