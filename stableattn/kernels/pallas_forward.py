"""Pallas flash-attention forward kernel with per-stage precision control.

Reads top to bottom: the static kernel configuration, the kernel body over
refs, then the `pallas_call` wrapper. Inputs arrive padded (see
`flash_attention.py`): sequence lengths are multiples of the tile sizes, so
no block reads out of bounds; padded keys are masked by index.

Two rescaling schemes:
  * `fa2` (FlashAttention-2): the output accumulator stays unnormalized and
    is scaled by the reciprocal of the softmax sum once, after the last key
    block.
  * `fa1` (FlashAttention-1, Algorithm 1 of Dao et al. 2022; also jax's TPU
    kernel): each key block's probabilities are computed against the block's
    own maximum, and the accumulator is renormalized after every key block.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from stableattn.contract.masking import MaskOperands, MaskSpec
from stableattn.contract.options import Options
from stableattn.contract.tiling import round_up
from stableattn.kernels.block_math import (
  block_scores,
  no_key_safe,
  probs_times_values,
  row_sum,
  stats_exp,
  tie_safe_max,
)
from stableattn.kernels.kernel_operands import TileReader, operand_specs
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
  head_dim: int  # true head dim
  page_size: int | None = None  # keys per page of a paged KV cache

  def __getattr__(self, name):
    # The options' fields read as the configuration's own (cfg.block_q).
    if name in _OPTION_FIELDS:
      return getattr(self.options, name)
    raise AttributeError(name)

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


def _forward_kernel(q_ref, k_ref, v_ref, *refs, cfg: KernelConfig, names):
  """One program: one query block of one (batch, head), its key blocks
  (with split-KV, those of one split).

  `refs` are the page table (a paged cache only), the feature operands
  named by `names` (see `kernel_operands.py`), then the outputs o and lse.
  Every line below is one operation of the documented algorithm; its
  result is rounded to the stage named beside it (see `rounding.py`).
  """
  if cfg.page_size is not None:
    page_table_ref, *refs = refs
  *feature_refs, o_ref, lse_ref = refs
  tiles = TileReader.of(cfg, names, feature_refs, query_major=True)
  ar = cfg.arithmetic
  block_q, block_k = cfg.block_q, cfg.block_k
  kv_len_padded = cfg.kv_len_padded
  head_dim_padded = q_ref.shape[-1]

  def stats(x):
    return ar.round(x, "softmax_stats")

  def accum(x):
    return ar.round(x, "out_accum")

  q_start = pl.program_id(0) * block_q
  q_BqxD = q_ref[...]
  forward_order = cfg.policy.key_order == "forward"

  first, end = tiles.block_range(kv_len_padded // block_k)
  split = None
  if cfg.blocks_per_split is not None:
    split = pl.program_id(3)
    first = jnp.maximum(first, split * cfg.blocks_per_split)
    end = jnp.minimum(end, (split + 1) * cfg.blocks_per_split)
    end = jnp.maximum(end, first)

  def body(step, carry):
    acc_BqxD, m_Bq, l_Bq = carry
    # Key blocks in order, or last to first (policy option key_order).
    k_index = step if forward_order else first + end - 1 - step
    k_start = pl.multiple_of(k_index * block_k, block_k)
    read_start = k_start
    if cfg.page_size is not None:
      # A key block lies inside one page: its physical place in the pool.
      page = page_table_ref[k_start // cfg.page_size]
      read_start = pl.multiple_of(
        page * cfg.page_size + k_start % cfg.page_size, block_k
      )
    k_BkxD = k_ref[pl.ds(read_start, block_k), :]
    v_BkxD = v_ref[pl.ds(read_start, block_k), :]
    mask = tiles.mask(q_start, k_start, block_q, block_k)
    scales = tiles.scales(q_start, k_start, block_q, block_k)
    v_scale = None if scales is None else scales[2]
    s_BqxBk, _ = block_scores(
      q_BqxD,
      k_BkxD,
      ar=ar,
      spec=cfg.mask,
      mask=mask,
      bias=tiles.bias(q_start, k_start, block_q, block_k),
      scales=None if scales is None else scales[:2],
    )
    m_block_Bq = tie_safe_max(
      s_BqxBk, jnp.max(s_BqxBk, axis=-1), ar, cfg.options
    )
    m_new_Bq = jnp.maximum(m_Bq, m_block_Bq)
    # A row with no key so far keeps m = -inf; subtract 0 instead.
    m_use_Bq = no_key_safe(m_new_Bq)
    alpha_Bq = stats_exp(stats(m_Bq - m_use_Bq), ar)
    if cfg.scheme == "fa2":
      p_BqxBk = stats_exp(stats(s_BqxBk - m_use_Bq[:, None]), ar)
      l_new_Bq = stats(stats(alpha_Bq * l_Bq) + row_sum(p_BqxBk, ar))
      pv_BqxD = probs_times_values(
        p_BqxBk, v_BkxD, ar, v_scale, tiles.v_per_channel
      )
      acc_BqxD = accum(accum(accum(alpha_Bq)[:, None] * acc_BqxD) + pv_BqxD)
    else:
      acc_BqxD, l_new_Bq = _fa1_update(
        ar,
        s_BqxBk,
        (m_block_Bq, m_use_Bq, alpha_Bq, l_Bq),
        acc_BqxD,
        lambda p: probs_times_values(
          p, v_BkxD, ar, v_scale, tiles.v_per_channel
        ),
      )
    return acc_BqxD, m_new_Bq, l_new_Bq

  init = _initial_state(tiles, ar, block_q, head_dim_padded, split)
  carry = lax.fori_loop(first, end, body, init)
  _store(carry, cfg, ar, o_ref, lse_ref, partial=split is not None)


def _fa1_update(ar, s_BqxBk, stats_Bq, acc_BqxD, times_values):
  """FlashAttention-1's step: probabilities against the block's own max
  (Dao et al. 2022, Alg. 1 line 10), then two rescale factors bring the
  old and new parts to the new max, renormalized by the new sum."""
  m_block_Bq, m_use_Bq, alpha_Bq, l_Bq = stats_Bq

  def stats(x):
    return ar.round(x, "softmax_stats")

  def accum(x):
    return ar.round(x, "out_accum")

  # A row can have no key in this block (max -inf); measuring it against
  # m_new keeps its zero weight instead of exp(-inf + inf).
  m_ref_Bq = jnp.where(m_block_Bq == -jnp.inf, m_use_Bq, m_block_Bq)
  p_BqxBk = stats_exp(stats(s_BqxBk - m_ref_Bq[:, None]), ar)
  beta_Bq = stats_exp(stats(m_ref_Bq - m_use_Bq), ar)
  old_sum_Bq = stats(alpha_Bq * l_Bq)
  l_new_Bq = stats(old_sum_Bq + stats(beta_Bq * row_sum(p_BqxBk, ar)))
  pv_BqxD = times_values(p_BqxBk)
  l_safe_Bq = jnp.where(l_new_Bq == 0, jnp.ones_like(l_new_Bq), l_new_Bq)
  old_weight_Bq = accum(stats(old_sum_Bq / l_safe_Bq))
  new_weight_Bq = accum(stats(beta_Bq / l_safe_Bq))
  acc_BqxD = accum(
    accum(old_weight_Bq[:, None] * acc_BqxD)
    + accum(new_weight_Bq[:, None] * pv_BqxD)
  )
  return acc_BqxD, l_new_Bq


def _initial_state(tiles, ar, block_q: int, head_dim_padded: int, split):
  """(accumulator, running max, running sum) before the first key block;
  with split-KV, the sink belongs to the first split only."""
  carrier = ar.carrier
  m_init = jnp.full((block_q,), -jnp.inf, carrier)
  l_init = jnp.zeros((block_q,), carrier)
  if "sink_rows" in tiles.refs:
    # The sink is a key with logit `sink` and value 0: it starts the
    # running maximum and contributes exp(sink - m) to the sum.
    m_sink = ar.round(
      tiles.refs["sink_rows"][...].astype(carrier), "softmax_stats"
    )
    l_sink = jnp.ones((block_q,), carrier)
    if split is None:
      m_init, l_init = m_sink, l_sink
    else:
      m_init = jnp.where(split == 0, m_sink, m_init)
      l_init = jnp.where(split == 0, l_sink, l_init)
  return jnp.zeros((block_q, head_dim_padded), carrier), m_init, l_init


def _store(carry, cfg: KernelConfig, ar, o_ref, lse_ref, partial: bool):
  """Normalizes (fa2) and stores the output and the log-sum-exp; a split's
  partial output goes to `partials`, and its lse is -inf where no key of
  the split attends, so the merge gives it weight 0."""
  acc_BqxD, m_Bq, l_Bq = carry

  def stats(x):
    return ar.round(x, "softmax_stats")

  empty_Bq = l_Bq == 0  # no key attends: output 0, lse +inf (backward p = 0)
  if cfg.scheme == "fa2":
    l_safe_Bq = jnp.where(empty_Bq, jnp.ones_like(l_Bq), l_Bq)
    inverse_Bq = ar.round(stats(1.0 / l_safe_Bq), "out_accum")
    acc_BqxD = ar.round(acc_BqxD * inverse_Bq[:, None], "out_accum")
  o_ref[...] = ar.stored(acc_BqxD, "partials" if partial else "output")
  lse_Bq = jnp.where(
    empty_Bq,
    jnp.full_like(l_Bq, -jnp.inf if partial else jnp.inf),
    m_Bq + stats(jnp.log(jnp.where(empty_Bq, jnp.ones_like(l_Bq), l_Bq))),
  )
  lse_ref[...] = ar.stored(lse_Bq, "softmax_stats")


def flash_forward(
  q,
  k,
  v,
  ops: MaskOperands,
  ranges,
  cfg: KernelConfig,
  scales=None,
  page_table=None,
  merge: bool = True,
):
  """Runs the forward kernel on padded inputs.

  Args:
    q: [batch, q_len_padded, heads, head_dim_padded].
    k, v: [batch, kv_len_padded, kv_heads, head_dim_padded]; for a paged
      cache (`cfg.page_size`), the page pool [1, pages * page_size,
      kv_heads, head_dim_padded].
    ops: the padded feature operands (`masking.MaskOperands`; the sink as
      rows [heads, q_len_padded]).
    ranges: key-block ranges [B|1, n_q_blocks, 2], or None.
    cfg: static configuration; lengths padded to multiples of the tiles.
    scales: padded row scales (`quantization.QuantScales`) of a policy
      with operands below 16 bits, or None.
    page_table: int32 [batch, pages per sequence] (paged cache only): the
      pool page that holds each page of a sequence's keys.
    merge: with split-KV, merge the splits; False returns the partials
      (out [batch, splits, ...] in `partials`, lse -inf where a split is
      empty) for a caller that merges them with others (ring attention).

  Returns:
    (out [batch, q_len_padded, heads, head_dim_padded] in `output`,
     lse [batch, heads, q_len_padded] in `softmax_stats`; +inf for a row
     no key attends). With split-KV the kernel writes one output (in
     `partials`) and lse (-inf where the split is empty) per split, and
     `merge_splits` returns them merged, in the same formats as above.
  """
  batch, q_len_padded, heads, head_dim_padded = q.shape
  kv_len_padded, kv_heads = cfg.kv_len_padded, k.shape[2]
  pool_len = k.shape[1]
  group = heads // kv_heads
  policy = cfg.policy
  splits = cfg.kv_splits
  split_kv = cfg.blocks_per_split is not None
  grid = (q_len_padded // cfg.block_q, batch, heads, splits)

  def per_split(spec):
    """A BlockSpec of the unsplit grid (i, b, h), read by every split."""
    index_map = spec.index_map
    return pl.BlockSpec(spec.block_shape, lambda i, b, h, s: index_map(i, b, h))

  q_spec = pl.BlockSpec(
    (None, cfg.block_q, None, head_dim_padded),
    lambda i, b, h, s: (b, i, h, 0),
  )
  paged = page_table is not None
  kv_spec = pl.BlockSpec(
    (None, pool_len, None, head_dim_padded),
    lambda i, b, h, s: (0 if paged else b, 0, h // group, 0),
  )
  names, arrays, specs = operand_specs(
    cfg.mask,
    ops,
    ranges,
    query_major=True,
    block_q=cfg.block_q,
    block_k=cfg.block_k,
    q_len_padded=q_len_padded,
    kv_len_padded=kv_len_padded,
    with_sink=True,
    scales=scales,
    group=group,
    policy=cfg.policy,
  )
  specs = [per_split(spec) for spec in specs]
  if paged:
    table_spec = pl.BlockSpec(
      (None, page_table.shape[1]), lambda i, b, h, s: (b, 0)
    )
    specs, arrays = [table_spec, *specs], [page_table, *arrays]
  if split_kv:
    o_spec = pl.BlockSpec(
      (None, None, cfg.block_q, None, head_dim_padded),
      lambda i, b, h, s: (b, s, i, h, 0),
    )
    lse_spec = pl.BlockSpec(
      (None, None, None, cfg.block_q), lambda i, b, h, s: (b, s, h, i)
    )
    out_shape = (
      jax.ShapeDtypeStruct(
        (batch, splits, *q.shape[1:]), policy.dtype("partials")
      ),
      jax.ShapeDtypeStruct(
        (batch, splits, heads, q_len_padded), policy.dtype("softmax_stats")
      ),
    )
  else:
    o_spec = q_spec
    lse_spec = pl.BlockSpec(
      (None, None, cfg.block_q), lambda i, b, h, s: (b, h, i)
    )
    out_shape = (
      jax.ShapeDtypeStruct(q.shape, policy.dtype("output")),
      jax.ShapeDtypeStruct(
        (batch, heads, q_len_padded), policy.dtype("softmax_stats")
      ),
    )
  out, lse = pl.pallas_call(
    functools.partial(_forward_kernel, cfg=cfg, names=names),
    grid=grid,
    in_specs=[q_spec, kv_spec, kv_spec, *specs],
    out_specs=[o_spec, lse_spec],
    out_shape=out_shape,
    compiler_params=cfg.compiler_params(cfg.block_q * cfg.block_k),
    interpret=cfg.interpret,
    name=f"stableattn_flash_forward_{cfg.scheme}",
  )(q, k, v, *arrays)
  if split_kv and merge:
    return merge_splits(out, lse, cfg)
  return out, lse


def merge_splits(partial_out, partial_lse, cfg: KernelConfig, final=True):
  """Split-KV's combine step (FlashAttention's `combine_attn_seqk_parallel`):
  lse = max_s lse_s + log(sum_s exp(lse_s - max)), then
  O = sum_s exp(lse_s - lse) O_s, summed over the splits in order.

  Arithmetic in the carrier: exponentials, logs and the lse in
  `softmax_stats`, each weighted partial and the running sum in
  `out_accum`; the result is stored in `output`. An empty split (lse -inf)
  adds exactly 0; a row no split attends gives output 0 and lse +inf.

  Args:
    partial_out: [batch, splits, q_len, heads, head_dim] in `partials`.
    partial_lse: [batch, splits, heads, q_len] in `softmax_stats`.
    final: store the result in `output` with lse +inf for an empty row;
      False keeps it a partial (in `partials`, lse -inf) to merge again,
      as an online merge does.
  """
  ar = PolicyArithmetic(cfg.policy)

  def stats(x):
    return ar.round(x, "softmax_stats")

  def accum(x):
    return ar.round(x, "out_accum")

  lse_BxSxHxT = partial_lse.astype(ar.carrier)
  splits = lse_BxSxHxT.shape[1]
  top_BxHxT = jnp.max(lse_BxSxHxT, axis=1)
  empty_BxHxT = top_BxHxT == -jnp.inf
  top_BxHxT = jnp.where(empty_BxHxT, jnp.zeros_like(top_BxHxT), top_BxHxT)
  total_BxHxT = jnp.zeros_like(top_BxHxT)
  for s in range(splits):
    total_BxHxT = stats(
      total_BxHxT + stats(jnp.exp(stats(lse_BxSxHxT[:, s] - top_BxHxT)))
    )
  total_safe = jnp.where(empty_BxHxT, jnp.ones_like(total_BxHxT), total_BxHxT)
  lse_BxHxT = stats(top_BxHxT + stats(jnp.log(total_safe)))
  out_BxTxHxD = jnp.zeros(
    (partial_out.shape[0], *partial_out.shape[2:]), ar.carrier
  )
  for s in range(splits):
    weight_BxHxT = stats(jnp.exp(stats(lse_BxSxHxT[:, s] - lse_BxHxT)))
    weight_BxTxH = jnp.swapaxes(accum(weight_BxHxT), 1, 2)
    part = partial_out[:, s].astype(ar.carrier)
    out_BxTxHxD = accum(out_BxTxHxD + accum(weight_BxTxH[..., None] * part))
  if not final:
    lse_BxHxT = jnp.where(empty_BxHxT, -jnp.inf, lse_BxHxT)
    return (
      ar.stored(out_BxTxHxD, "partials"),
      ar.stored(lse_BxHxT, "softmax_stats"),
    )
  lse_BxHxT = jnp.where(empty_BxHxT, jnp.inf, lse_BxHxT)
  return (
    ar.stored(out_BxTxHxD, "output"),
    ar.stored(lse_BxHxT, "softmax_stats"),
  )
