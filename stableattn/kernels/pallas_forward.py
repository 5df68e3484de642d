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

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from stableattn.contract.masking import MaskOperands, logits_in_base
from stableattn.kernels.block_math import (
  block_scores,
  descaled,
  no_key_safe,
  probs_times_values,
  stats_exp,
  stored_lse,
  summed_probs,
  tie_safe_max,
  unattended_keys_zeroed,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.kernel_operands import TileReader, operand_specs
from stableattn.kernels.mma_accumulator import promote, two_level_update
from stableattn.kernels.residuals import (
  MONITOR_RESIDUALS,
  initial_top_two,
  merged_top_two,
  residual_names,
  residual_specs,
  store_residuals,
  store_top_two,
)
from stableattn.kernels.split_merge import merge_splits


def _forward_kernel(
  q_ref, k_ref, v_ref, *refs, cfg: KernelConfig, names, residuals=()
):
  """One program: one query block of one (batch, head), its key blocks
  (with split-KV, those of one split).

  `refs` are the page table (a paged cache only), the feature operands
  named by `names` (see `kernel_operands.py`), then the outputs o and lse.
  Every line below is one operation of the documented algorithm; its
  result is rounded to the stage named beside it (see `rounding.py`).
  """
  page_table_ref = None
  if cfg.page_size is not None:
    page_table_ref, *refs = refs
  residual_refs = dict(zip(residuals, refs[len(refs) - len(residuals) :]))
  *feature_refs, o_ref, lse_ref = refs[: len(refs) - len(residuals)]
  tiles = TileReader.of(cfg, names, feature_refs, query_major=True)
  ar = cfg.arithmetic
  block_q, block_k = cfg.block_q, cfg.block_k

  def stats(x):
    return ar.round(x, "softmax_stats")

  q_start = pl.program_id(0) * block_q
  q_BqxD = q_ref[...]
  forward_order = cfg.policy.key_order == "forward"
  base2 = cfg.policy.exp2

  first, end, split = _key_blocks(cfg, tiles)

  def body(step, carry):
    acc_BqxD, m_Bq, l_Bq, mma, top_two = carry
    # Key blocks in order, or last to first (policy option key_order).
    k_index = step if forward_order else first + end - 1 - step
    k_start = pl.multiple_of(k_index * block_k, block_k)
    read_start = _pool_start(cfg, page_table_ref, k_start)
    k_BkxD = k_ref[pl.ds(read_start, block_k), :]
    v_BkxD = v_ref[pl.ds(read_start, block_k), :]
    mask = tiles.mask(q_start, k_start, block_q, block_k)
    (v_BkxD,) = unattended_keys_zeroed(mask, v_BkxD)
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
      base2=base2,
    )
    m_block_Bq = tie_safe_max(
      s_BqxBk, jnp.max(s_BqxBk, axis=-1), ar, cfg.options
    )
    top_two = merged_top_two(top_two, s_BqxBk)
    m_new_Bq = jnp.maximum(m_Bq, m_block_Bq)
    # A row with no key so far keeps m = -inf; subtract 0 instead.
    m_use_Bq = no_key_safe(m_new_Bq)
    alpha_Bq = stats_exp(stats(m_Bq - m_use_Bq), ar, base2)

    def times_values(p_BqxBk, acc=None):
      return probs_times_values(
        p_BqxBk, v_BkxD, ar, v_scale, tiles.v_per_channel, acc=acc
      )

    stats_Bq = (m_block_Bq, m_use_Bq, alpha_Bq, l_Bq)
    if cfg.scheme == "fa2":
      acc_BqxD, l_new_Bq, mma = _fa2_update(
        cfg, step - first, s_BqxBk, stats_Bq, (acc_BqxD, mma), times_values
      )
    else:
      acc_BqxD, l_new_Bq = _fa1_update(
        ar, base2, s_BqxBk, stats_Bq, acc_BqxD, times_values
      )
    return acc_BqxD, m_new_Bq, l_new_Bq, mma, top_two

  init = (*_initial_state(tiles, ar, block_q, v_ref.shape[-1], split),
          initial_top_two(residual_refs, ar, block_q))  # fmt: skip
  acc_BqxD, m_Bq, l_Bq, mma, top_two = lax.fori_loop(first, end, body, init)
  store_top_two(residual_refs, ar, top_two)
  if mma:
    acc_BqxD = promote(ar, acc_BqxD, mma)
  carry = acc_BqxD, m_Bq, l_Bq
  _store(
    carry, cfg, ar, (o_ref, lse_ref, residual_refs), partial=split is not None
  )


def _fa2_update(cfg: KernelConfig, visited, s_BqxBk, stats_Bq, o_state, pv):
  """FlashAttention-2's step: P against the running max, l = alpha l +
  rowsum(P), O = alpha O + P V, with P V in the MMA accumulator across
  tiles if the policy keeps it there (`mma` in `o_state`). `pv(p, acc)`
  is P V before descaling, and the descale. Returns (O, l, mma)."""
  ar, base2 = cfg.arithmetic, cfg.policy.exp2
  _, m_use_Bq, alpha_Bq, l_Bq = stats_Bq
  acc_BqxD, mma = o_state

  def stats(x):
    return ar.round(x, "softmax_stats")

  def accum(x):
    return ar.round(x, "out_accum")

  p_BqxBk = stats_exp(stats(s_BqxBk - m_use_Bq[:, None]), ar, base2)
  l_new_Bq = stats(stats(alpha_Bq * l_Bq) + summed_probs(p_BqxBk, ar))
  if mma:
    acc_BqxD, mma = two_level_update(
      ar,
      cfg.policy.promote_every,
      visited,
      (acc_BqxD, alpha_Bq),
      mma,
      functools.partial(pv, p_BqxBk),
    )
    return acc_BqxD, l_new_Bq, mma
  pv_BqxD = descaled(ar, *pv(p_BqxBk))
  acc_BqxD = accum(accum(accum(alpha_Bq)[:, None] * acc_BqxD) + pv_BqxD)
  return acc_BqxD, l_new_Bq, mma


def _key_blocks(cfg: KernelConfig, tiles):
  """The key blocks [first, end) this program visits (with split-KV, those
  of its split) and its split index, or None without split-KV."""
  first, end = tiles.block_range(cfg.kv_len_padded // cfg.block_k)
  if cfg.blocks_per_split is None:
    return first, end, None
  split = pl.program_id(3)
  first = jnp.maximum(first, split * cfg.blocks_per_split)
  end = jnp.minimum(end, (split + 1) * cfg.blocks_per_split)
  return first, jnp.maximum(end, first), split


def _pool_start(cfg: KernelConfig, page_table_ref, k_start):
  """Where key block `k_start` is read: itself, or in a paged cache its
  physical place in the pool (a key block lies inside one page)."""
  if cfg.page_size is None:
    return k_start
  page = page_table_ref[k_start // cfg.page_size]
  return pl.multiple_of(
    page * cfg.page_size + k_start % cfg.page_size, cfg.block_k
  )


def _fa1_update(ar, base2, s_BqxBk, stats_Bq, acc_BqxD, times_values):
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
  p_BqxBk = stats_exp(stats(s_BqxBk - m_ref_Bq[:, None]), ar, base2)
  beta_Bq = stats_exp(stats(m_ref_Bq - m_use_Bq), ar, base2)
  old_sum_Bq = stats(alpha_Bq * l_Bq)
  l_new_Bq = stats(old_sum_Bq + stats(beta_Bq * summed_probs(p_BqxBk, ar)))
  pv_BqxD = descaled(ar, *times_values(p_BqxBk))
  l_safe_Bq = jnp.where(l_new_Bq == 0, jnp.ones_like(l_new_Bq), l_new_Bq)
  old_weight_Bq = accum(stats(old_sum_Bq / l_safe_Bq))
  new_weight_Bq = accum(stats(beta_Bq / l_safe_Bq))
  acc_BqxD = accum(
    accum(old_weight_Bq[:, None] * acc_BqxD)
    + accum(new_weight_Bq[:, None] * pv_BqxD)
  )
  return acc_BqxD, l_new_Bq


def _initial_state(tiles, ar, block_q: int, value_dim_padded: int, split):
  """(accumulator, running max, running sum) before the first key block;
  with split-KV, the sink belongs to the first split only."""
  carrier = ar.carrier
  m_init = jnp.full((block_q,), -jnp.inf, carrier)
  l_init = jnp.zeros((block_q,), carrier)
  if "sink_rows" in tiles.refs:
    # The sink is a key with logit `sink` and value 0: it starts the
    # running maximum and contributes exp(sink - m) to the sum.
    m_sink = logits_in_base(
      tiles.refs["sink_rows"][...].astype(carrier),
      ar,
      ar.policy.exp2,
      "softmax_stats",
    )
    l_sink = jnp.ones((block_q,), carrier)
    if split is None:
      m_init, l_init = m_sink, l_sink
    else:
      m_init = jnp.where(split == 0, m_sink, m_init)
      l_init = jnp.where(split == 0, l_sink, l_init)
  acc = jnp.zeros((block_q, value_dim_padded), carrier)
  mma = ()
  if ar.policy.mma_chunk and ar.policy.promote_every != 1:
    mma = (jnp.zeros_like(acc), jnp.ones((block_q,), carrier))
  return acc, m_init, l_init, mma


def _store(carry, cfg: KernelConfig, ar, out_refs, partial: bool):
  """Normalizes (fa2) and stores the output and the log-sum-exp; a split's
  partial output goes to `partials`, and its lse is -inf where no key of
  the split attends, so the merge gives it weight 0. `out_refs` are O's,
  the lse's and the backward's residuals by name (`residual_names`)."""
  acc_BqxD, m_Bq, l_Bq = carry
  o_ref, lse_ref, residual_refs = out_refs

  def stats(x):
    return ar.round(x, "softmax_stats")

  empty_Bq = l_Bq == 0  # no key attends: output 0, lse +inf (backward p = 0)
  l_safe_Bq = jnp.where(empty_Bq, jnp.ones_like(l_Bq), l_Bq)
  if cfg.scheme == "fa2":
    inverse_Bq = ar.round(stats(1.0 / l_safe_Bq), "out_accum")
    acc_BqxD = ar.round(acc_BqxD * inverse_Bq[:, None], "out_accum")
  o_ref[...] = ar.stored(acc_BqxD, "partials" if partial else "output")
  store_residuals(residual_refs, ar, acc_BqxD, (m_Bq, l_safe_Bq))
  lse_Bq = jnp.where(
    empty_Bq,
    jnp.full_like(l_Bq, -jnp.inf if partial else jnp.inf),
    stored_lse(m_Bq, l_safe_Bq, ar, cfg.policy.exp2),
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
  residuals: bool = False,
  monitor: bool = False,
):
  """Runs the forward kernel on padded inputs.

  Args:
    q: [batch, q_len_padded, heads, head_dim_padded].
    k: [batch, kv_len_padded, kv_heads, head_dim_padded]; v the same with
      the value's head dim (MLA's may differ); for a paged cache
      (`cfg.page_size`), the page pools [1, pages * page_size, kv_heads,
      head dim].
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
    (out [batch, q_len_padded, heads, value head dim] in `output`,
     lse [batch, heads, q_len_padded] in `softmax_stats`; +inf for a row
     no key attends). With split-KV the kernel writes one output (in
     `partials`) and lse (-inf where the split is empty) per split, and
     `merge_splits` returns them merged, in the same formats as above.
    With `residuals`, a third element: {name: array} of the backward's
    extra residuals (`residual_names`), empty under the default policy;
    split-KV has none. With `monitor`, that dict also holds each row's
    largest and second largest score (`MONITOR_RESIDUALS`, [batch, heads,
    q_len_padded], in the kernel's score units: base 2 under exp2).
  """
  batch, q_len_padded, heads, head_dim_padded = q.shape
  group = heads // k.shape[2]
  splits = cfg.kv_splits
  split_kv = cfg.blocks_per_split is not None
  grid = (q_len_padded // cfg.block_q, batch, heads, splits)
  paged = page_table is not None
  names, arrays, specs = _operand_specs(
    cfg, q_len_padded, ops, ranges, scales, group, page_table
  )
  o_shape = (*q.shape[:3], v.shape[-1])
  o_spec, lse_spec, out_shape = _output_specs(cfg, o_shape, splits)
  extra = residual_names(cfg.policy) if residuals else ()
  if monitor:
    extra += MONITOR_RESIDUALS
  # Residuals exist without split-KV only, where O's spec is its rows'.
  extra_specs, extra_shapes = residual_specs(
    cfg, o_shape, (o_spec, lse_spec), extra
  )
  out, lse, *extra_out = pl.pallas_call(
    functools.partial(_forward_kernel, cfg=cfg, names=names, residuals=extra),
    grid=grid,
    in_specs=[
      _query_rows(cfg, head_dim_padded),
      _kv_rows(k, group, paged),
      _kv_rows(v, group, paged),
      *specs,
    ],
    out_specs=[o_spec, lse_spec, *extra_specs],
    out_shape=[*out_shape, *extra_shapes],
    compiler_params=cfg.compiler_params(cfg.block_q * cfg.block_k),
    interpret=cfg.interpret,
    name=f"stableattn_flash_forward_{cfg.scheme}",
  )(q, k, v, *arrays)
  if split_kv and merge:
    out, lse = merge_splits(out, lse, cfg)
  if residuals or monitor:
    return out, lse, dict(zip(extra, extra_out))
  return out, lse


def _query_rows(cfg: KernelConfig, head_dim: int):
  """One query block of one head, [block_q, head_dim]: q's, and O's."""
  return pl.BlockSpec(
    (None, cfg.block_q, None, head_dim), lambda i, b, h, s: (b, i, h, 0)
  )


def _kv_rows(x, group: int, paged: bool):
  """Every key (or value) row of a query head's KV head: the sequence's,
  or a paged cache's whole pool; each with its own head dim."""
  return pl.BlockSpec(
    (None, x.shape[1], None, x.shape[-1]),
    lambda i, b, h, s: (0 if paged else b, 0, h // group, 0),
  )


def _output_specs(cfg: KernelConfig, o_shape, splits: int):
  """BlockSpecs and shapes of (out, lse): one of each per query block, or
  with split-KV one per (split, query block), the outputs in `partials`.
  `o_shape`: O's padded shape (q's with v's head dim)."""
  batch, q_len_padded, heads, value_dim_padded = o_shape
  policy = cfg.policy
  stats_dtype = policy.dtype("softmax_stats")
  if cfg.blocks_per_split is None:
    lse_spec = pl.BlockSpec(
      (None, None, cfg.block_q), lambda i, b, h, s: (b, h, i)
    )
    out_shape = (
      jax.ShapeDtypeStruct(o_shape, policy.dtype("output")),
      jax.ShapeDtypeStruct((batch, heads, q_len_padded), stats_dtype),
    )
    return _query_rows(cfg, value_dim_padded), lse_spec, out_shape
  o_spec = pl.BlockSpec(
    (None, None, cfg.block_q, None, value_dim_padded),
    lambda i, b, h, s: (b, s, i, h, 0),
  )
  lse_spec = pl.BlockSpec(
    (None, None, None, cfg.block_q), lambda i, b, h, s: (b, s, h, i)
  )
  out_shape = (
    jax.ShapeDtypeStruct(
      (batch, splits, *o_shape[1:]), policy.dtype("partials")
    ),
    jax.ShapeDtypeStruct((batch, splits, heads, q_len_padded), stats_dtype),
  )
  return o_spec, lse_spec, out_shape


def _operand_specs(cfg, q_len_padded, ops, ranges, scales, group, page_table):
  """(names, arrays, BlockSpecs) of the feature operands, each read by
  every split, with the page table first for a paged cache."""

  def per_split(spec):
    """A BlockSpec of the unsplit grid (i, b, h), read by every split."""
    index_map = spec.index_map
    return pl.BlockSpec(spec.block_shape, lambda i, b, h, s: index_map(i, b, h))

  names, arrays, specs = operand_specs(
    cfg.mask,
    ops,
    ranges,
    query_major=True,
    block_q=cfg.block_q,
    block_k=cfg.block_k,
    q_len_padded=q_len_padded,
    kv_len_padded=cfg.kv_len_padded,
    with_sink=True,
    scales=scales,
    group=group,
    policy=cfg.policy,
  )
  specs = [per_split(spec) for spec in specs]
  if page_table is not None:
    table_spec = pl.BlockSpec(
      (None, page_table.shape[1]), lambda i, b, h, s: (b, 0)
    )
    specs, arrays = [table_spec, *specs], [page_table, *arrays]
  return names, arrays, specs
