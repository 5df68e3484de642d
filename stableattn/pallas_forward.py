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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from stableattn.block_math import (
  NN_DIMS,
  block_scores,
  key_mask,
  row_sum,
  stats_exp,
  tie_safe_max,
)
from stableattn.precision import Precision
from stableattn.rounding import PolicyArithmetic

SCHEMES = ("fa2", "fa1")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Everything static about one flash-attention call (hashable)."""

  policy: Precision
  block_q: int
  block_k: int
  scheme: str
  causal: bool
  q_len: int  # true lengths, before padding
  kv_len: int
  head_dim: int  # true head dim; the scale uses it
  interpret: bool
  num_warps: int | None = None
  num_stages: int | None = None
  bwd_block_q: int | None = None
  bwd_block_k: int | None = None
  tie_beta: float | None = None  # Qiu & Yao's fix; see `tie_safe_max`

  @property
  def scale(self) -> float:
    return self.head_dim**-0.5

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


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, cfg: KernelConfig):
  """One program: one query block of one (batch, head), all key blocks.

  Every line below is one operation of the documented algorithm; its
  result is rounded to the stage named beside it (see `rounding.py`).
  """
  ar = cfg.arithmetic
  block_q, block_k = cfg.block_q, cfg.block_k
  kv_len_padded = k_ref.shape[0]
  head_dim_padded = q_ref.shape[-1]

  def stats(x):
    return ar.round(x, "softmax_stats")

  def accum(x):
    return ar.round(x, "out_accum")

  q_index = pl.program_id(0)
  q_start = q_index * block_q
  q_BqxD = q_ref[...]
  needs_mask = cfg.causal or cfg.kv_len % block_k != 0

  def body(k_index, carry):
    acc_BqxD, m_Bq, l_Bq = carry
    k_start = pl.multiple_of(k_index * block_k, block_k)
    k_BkxD = k_ref[pl.ds(k_start, block_k), :]
    v_BkxD = v_ref[pl.ds(k_start, block_k), :]
    mask = None
    if needs_mask:
      mask = key_mask(
        q_start, k_start, block_q, block_k, kv_len=cfg.kv_len, causal=cfg.causal
      )
    s_BqxBk = block_scores(q_BqxD, k_BkxD, ar=ar, scale=cfg.scale, mask=mask)
    m_block_Bq = tie_safe_max(
      s_BqxBk, jnp.max(s_BqxBk, axis=-1), ar, cfg.tie_beta
    )
    m_new_Bq = jnp.maximum(m_Bq, m_block_Bq)
    alpha_Bq = stats_exp(stats(m_Bq - m_new_Bq), ar)
    if cfg.scheme == "fa2":
      p_BqxBk = stats_exp(stats(s_BqxBk - m_new_Bq[:, None]), ar)
      l_new_Bq = stats(stats(alpha_Bq * l_Bq) + row_sum(p_BqxBk, ar))
      pv_BqxD = _probs_times_values(p_BqxBk, v_BkxD, ar)
      acc_BqxD = accum(accum(accum(alpha_Bq)[:, None] * acc_BqxD) + pv_BqxD)
    else:
      # Probabilities against the block's own max (Dao et al. 2022, Alg. 1
      # line 10), then two rescale factors bring old and new to m_new.
      # A causal row can have no key in this block (max -inf); measuring it
      # against m_new keeps its zero weight instead of exp(-inf + inf).
      m_ref_Bq = jnp.where(m_block_Bq == -jnp.inf, m_new_Bq, m_block_Bq)
      p_BqxBk = stats_exp(stats(s_BqxBk - m_ref_Bq[:, None]), ar)
      beta_Bq = stats_exp(stats(m_ref_Bq - m_new_Bq), ar)
      old_sum_Bq = stats(alpha_Bq * l_Bq)
      l_new_Bq = stats(old_sum_Bq + stats(beta_Bq * row_sum(p_BqxBk, ar)))
      pv_BqxD = _probs_times_values(p_BqxBk, v_BkxD, ar)
      old_weight_Bq = accum(stats(old_sum_Bq / l_new_Bq))
      new_weight_Bq = accum(stats(beta_Bq / l_new_Bq))
      acc_BqxD = accum(
        accum(old_weight_Bq[:, None] * acc_BqxD)
        + accum(new_weight_Bq[:, None] * pv_BqxD)
      )
    return acc_BqxD, m_new_Bq, l_new_Bq

  upper = _key_blocks_needed(cfg, q_start, kv_len_padded // block_k)
  carrier = ar.carrier
  init = (
    jnp.zeros((block_q, head_dim_padded), carrier),
    jnp.full((block_q,), -jnp.inf, carrier),
    jnp.zeros((block_q,), carrier),
  )
  acc_BqxD, m_Bq, l_Bq = lax.fori_loop(0, upper, body, init)
  if cfg.scheme == "fa2":
    acc_BqxD = accum(acc_BqxD * accum(stats(1.0 / l_Bq))[:, None])
  o_ref[...] = ar.stored(acc_BqxD, "output")
  lse_ref[...] = ar.stored(m_Bq + stats(jnp.log(l_Bq)), "softmax_stats")


def _key_blocks_needed(cfg: KernelConfig, q_start, num_k_blocks: int):
  """How many key blocks a query block visits: with a causal mask, key
  blocks that start past its last row are entirely masked and skipped."""
  if not cfg.causal:
    return num_k_blocks
  last_needed = lax.div(q_start + (cfg.block_q - 1), jnp.int32(cfg.block_k))
  return jnp.minimum(last_needed + 1, num_k_blocks)


def _probs_times_values(p_BqxBk, v_BkxD, ar: PolicyArithmetic):
  """P V with P rounded to `probs` first; result in `out_accum`."""
  pv_BqxD = ar.dot(ar.round(p_BqxBk, "probs"), v_BkxD, NN_DIMS)
  return ar.round(pv_BqxD, "out_accum")


def flash_forward(q, k, v, cfg: KernelConfig):
  """Runs the forward kernel on padded inputs.

  Args:
    q: [batch, q_len_padded, heads, head_dim_padded].
    k, v: [batch, kv_len_padded, kv_heads, head_dim_padded].
    cfg: static configuration; lengths padded to multiples of the tiles.

  Returns:
    (out [batch, q_len_padded, heads, head_dim_padded] in `output`,
     lse [batch, heads, q_len_padded] in `softmax_stats`).
  """
  batch, q_len_padded, heads, head_dim_padded = q.shape
  kv_len_padded, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  policy = cfg.policy
  grid = (q_len_padded // cfg.block_q, batch, heads)

  q_spec = pl.BlockSpec(
    (None, cfg.block_q, None, head_dim_padded),
    lambda i, b, h: (b, i, h, 0),
  )
  kv_spec = pl.BlockSpec(
    (None, kv_len_padded, None, head_dim_padded),
    lambda i, b, h: (b, 0, h // group, 0),
  )
  lse_spec = pl.BlockSpec((None, None, cfg.block_q), lambda i, b, h: (b, h, i))
  out_shape = (
    jax.ShapeDtypeStruct(q.shape, policy.dtype("output")),
    jax.ShapeDtypeStruct(
      (batch, heads, q_len_padded), policy.dtype("softmax_stats")
    ),
  )
  return pl.pallas_call(
    functools.partial(_forward_kernel, cfg=cfg),
    grid=grid,
    in_specs=[q_spec, kv_spec, kv_spec],
    out_specs=[q_spec, lse_spec],
    out_shape=out_shape,
    compiler_params=cfg.compiler_params(cfg.block_q * cfg.block_k),
    interpret=cfg.interpret,
    name=f"stableattn_flash_forward_{cfg.scheme}",
  )(q, k, v)
