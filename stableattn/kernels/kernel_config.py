"""The static configuration of one flash-attention call: the caller's
`Options` resolved against the shapes, the features' static spec and the
true sizes; what every kernel (forward, backward, split merge) reads."""

from __future__ import annotations

import dataclasses
import math

from jax.experimental.pallas import triton as plgpu

from stableattn.contract.masking import MaskSpec
from stableattn.contract.options import Options
from stableattn.contract.tiling import round_up
from stableattn.numerics.precision import Precision
from stableattn.numerics.rounding import PolicyArithmetic

_OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(Options))


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Everything static about one flash-attention call (hashable): the
  caller's `Options` resolved against the shapes (tiles clamped to the
  lengths, backward tiles filled in, `interpret` decided), the features'
  static spec and the true sizes."""

  options: Options
  mask: MaskSpec  # features: causal, window, segments, softcap, scale, ...
  q_len: int  # true lengths, before padding
  kv_len: int
  head_dim: int  # true head dim of q and k
  page_size: int | None = None  # keys per page of a paged KV cache
  head_dim_v: int | None = None  # v's head dim where it differs (MLA)

  def __getattr__(self, name):
    # The options' fields read as the configuration's own (cfg.block_q).
    if name in _OPTION_FIELDS:
      return getattr(self.options, name)
    raise AttributeError(name)

  @property
  def value_dim(self) -> int:
    """The true head dim of v and of the output."""
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  @property
  def policy(self) -> Precision:
    return self.options.precision

  def with_policy(self, policy: Precision) -> KernelConfig:
    return dataclasses.replace(
      self, options=dataclasses.replace(self.options, precision=policy)
    )

  @property
  def padded_lengths(self) -> tuple[int, int]:
    """Sequence lengths rounded up to a multiple of every tile in use."""
    q_multiple = math.lcm(self.block_q, self.bwd_block_q or self.block_q)
    k_multiple = math.lcm(self.block_k, self.bwd_block_k or self.block_k)
    return round_up(self.q_len, q_multiple), round_up(self.kv_len, k_multiple)

  @property
  def kv_len_padded(self) -> int:
    return self.padded_lengths[1]

  @property
  def blocks_per_split(self) -> int | None:
    """Key blocks per split-KV split, or None for one pass over all keys.

    `split_size` fixes the keys per split, so a key's split depends on its
    position only (the batch-invariant schedule of SGLang and FlashInfer);
    `num_splits` fixes the count, so the boundaries move with the cache
    length (FlashAttention's `num_splits`: ceil(blocks / splits) each).
    """
    if self.split_size is not None:
      return self.split_size // self.block_k
    if self.num_splits is not None:
      key_blocks = self.kv_len_padded // self.block_k
      return -(-key_blocks // self.num_splits)
    return None

  @property
  def kv_splits(self) -> int:
    """How many splits the keys are divided into (1 without split-KV)."""
    per_split = self.blocks_per_split
    if per_split is None:
      return 1
    return -(-(self.kv_len_padded // self.block_k) // per_split)

  @property
  def causal(self) -> bool:
    return self.mask.causal

  @property
  def scale(self) -> float:
    return self.mask.scale

  @property
  def arithmetic(self) -> PolicyArithmetic:
    """The policy's arithmetic; a compiled kernel's casts are roundings."""
    return PolicyArithmetic(self.policy, casts_round=not self.interpret)

  def compiler_params(self, block_area: int):
    """Triton compiler parameters; passing them selects the Triton lowering.

    Defaults from a search on an H100 (jax 0.11.2, bf16, head dims 64 and
    128, length 8192; README, Performance): 4 warps up to 64x128 tiles and
    8 above, one pipeline stage. 8 warps on 64-row tiles ran 1.8x slower,
    and a second stage cost up to 25% (2026-11-23).
    """
    num_warps = self.num_warps
    if num_warps is None:
      num_warps = 4 if block_area <= 64 * 128 else 8
    num_stages = 1 if self.num_stages is None else self.num_stages
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
