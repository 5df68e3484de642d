"""Which (query, key) pairs attend, and what is added to their scores.

One definition of the attention features, used by every implementation
(the Pallas kernels tile by tile, the reference and the FP64 golden on the
whole matrix). For example b, query row i and key column j:

  position   the key's position kp_j = j - offset_b, where offset_b is 0
             with top-left alignment and kv_len_b - q_len_b with
             bottom-right alignment (kv_len_b, q_len_b: the example's
             lengths, else the array lengths). Bottom-right puts the last
             query on the last key, as FlashAttention >= 2.1 and a KV cache
             do; top-left (the default) is `jax.nn.dot_product_attention`'s.
  causal     kp_j <= i.
  window     i - left <= kp_j <= i + right (`local_window_size`); a side
             that is None is unbounded. With causal too, both apply.
  lengths    i < q_len_b and j < kv_len_b (`query_seq_lengths`,
             `key_value_seq_lengths`): trailing padding.
  segments   q_segment[b, i] == kv_segment[b, j] (packed sequences).
  mask       mask[b, h, i, j] is True (dense; any pattern).

A pair attends iff every feature in use allows it. Scores are then
S = softcap * tanh(Q K^T * scale / softcap) (or Q K^T * scale) plus an
additive `bias`, and a per-head `sink` logit joins each row's softmax
denominator with a zero value (gpt-oss; FlashAttention's learnable sink).
A row where no key attends (and no sink) gives output 0 and zero
gradient, never NaN, and a key that no query attends never reaches a
result, whatever it holds (NaN in padding included).

Inside the kernels lengths and segments become one integer id per token
(padding gets ids no segment uses), so one comparison covers both.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

ALIGNMENTS = ("top_left", "bottom_right")
# Token ids of padding: a padded query matches no key, a padded key no query.
QUERY_PAD_ID = -(2**31)
KEY_PAD_ID = -(2**31) + 1


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of the features (hashable: part of a kernel config).

  Attributes:
    causal: the causal mask.
    alignment: "top_left" or "bottom_right".
    window: (left, right) bounds of the local window, None for no window;
      a side that is None is unbounded.
    key_offset: the static offset of key positions (bottom-right with
      array lengths); see the module docstring.
    token_ids: the `q_ids`/`kv_ids` operands exist (lengths or segments).
    key_positions: the `kv_pos` operand exists (bottom-right alignment with
      per-example lengths).
    bias, dense_mask: None, or (per example, per head) of their shapes.
    sink: the per-head `sink` operand exists.
    softcap: the logit softcap, or None.
    scale: the score scale.
  """

  scale: float
  causal: bool = False
  alignment: str = "top_left"
  window: tuple[int | None, int | None] | None = None
  key_offset: int = 0
  token_ids: bool = False
  key_positions: bool = False
  bias: tuple[bool, bool] | None = None
  dense_mask: tuple[bool, bool] | None = None
  sink: bool = False
  softcap: float | None = None

  @property
  def limits_positions(self) -> bool:
    return self.causal or self.window is not None

  @property
  def skips_blocks(self) -> bool:
    """Whether key blocks can be empty by structure (not a dense mask)."""
    return self.limits_positions or self.token_ids


class MaskOperands(NamedTuple):
  """The arrays of the features in use (None where unused).

  q_ids [B, T] and kv_ids [B, S] int32; kv_pos [B, S] int32; bias
  [B|1, H|1, T, S] float; mask [B|1, H|1, T, S] int8; sink [H] float.
  """

  q_ids: object = None
  kv_ids: object = None
  kv_pos: object = None
  bias: object = None
  mask: object = None
  sink: object = None


def key_positions(spec: MaskSpec, ops: MaskOperands, kv_len: int, xp=jnp):
  """kp [B|1, S]: each key's position on the query axis."""
  if spec.key_positions:
    return ops.kv_pos
  return xp.arange(kv_len, dtype=xp.int32)[None, :] - spec.key_offset


def pair_mask(spec: MaskSpec, q_index, k_pos, q_ids=None, kv_ids=None):
  """Boolean mask from positions and token ids (broadcasting arrays), or
  None when positions and ids limit nothing."""
  allowed = []
  if spec.causal:
    allowed.append(k_pos <= q_index)
  if spec.window is not None:
    left, right = spec.window
    if left is not None:
      allowed.append(k_pos >= q_index - left)
    if right is not None:
      allowed.append(k_pos <= q_index + right)
  if spec.token_ids:
    allowed.append(q_ids == kv_ids)
  if not allowed:
    return None
  out = allowed[0]
  for a in allowed[1:]:
    out = out & a
  return out


def allowed_pairs(spec: MaskSpec, ops: MaskOperands, q_len, kv_len, xp=jnp):
  """[B|1, H|1, T, S] boolean: which pairs attend (whole matrix)."""
  q_index = xp.arange(q_len, dtype=xp.int32)[None, None, :, None]
  k_pos = key_positions(spec, ops, kv_len, xp)[:, None, None, :]
  q_ids = kv_ids = None
  if spec.token_ids:
    q_ids = ops.q_ids[:, None, :, None]
    kv_ids = ops.kv_ids[:, None, None, :]
  allowed = pair_mask(spec, q_index, k_pos, q_ids, kv_ids)
  if allowed is None:
    allowed = xp.ones((1, 1, q_len, kv_len), bool)
  if spec.dense_mask is not None:
    allowed = allowed & (ops.mask != 0)
  return allowed


def keys_some_query_attends(allowed):
  """[B|1, S] bool: the keys that some query of some head may attend
  (`allowed` [B|1, H|1, T, S] from `allowed_pairs`)."""
  return jnp.any(allowed, axis=(1, 2))


def keys_of_some_query(ops: MaskOperands):
  """[B, S] bool: the keys whose token id some query shares (not padding,
  not a segment without queries); O(S log T), no [T, S] matrix. Needs
  the token-id operands (lengths or segments)."""
  sorted_ids = jnp.sort(ops.q_ids, axis=-1)
  at = jnp.minimum(
    jax.vmap(jnp.searchsorted)(sorted_ids, ops.kv_ids),
    sorted_ids.shape[-1] - 1,
  )
  return jnp.take_along_axis(sorted_ids, at, axis=-1) == ops.kv_ids


def without_unattended_keys(attended, *keys_or_values):
  """k or v [B, S, Hkv, D] with 0 at every key not in `attended` [B|1,
  S] (`keys_some_query_attends`, `keys_of_some_query`).

  Padding, a cache's unused slots and other segments' keys may hold
  anything, NaN included; P is 0 there, but 0 x NaN is NaN, so without
  this a NaN beyond a sequence's length would reach every row of it
  (through P V, and through dP = dO V^T and dS K in the backward), and
  an Inf there would set a quantizing policy's scales.
  """
  keep = attended[:, :, None, None]
  return tuple(jnp.where(keep, x, jnp.zeros_like(x)) for x in keys_or_values)


# log2(e): a policy with `exp2` measures scores in base 2 (see `scores`).
LOG2E = math.log2(math.e)


def scores(
  product, spec: MaskSpec, ar, base2: bool = False, scaled=jnp.multiply
):
  """Scores from Q K^T (rounded to `matmul_accum`), rounded to `scores`.

  Without softcap: product * scale. With it: softcap * tanh(product *
  (scale / softcap)), FlashAttention's form; tanh is also returned (for
  the gradient), else None. With `base2` the one constant multiplier also
  carries log2(e) (scale * log2(e), or softcap * log2(e)), so the softmax
  that follows is 2^(s - m): FlashAttention-2's and Triton's form, one
  multiply and a native exp2 per score. `scaled(x, factor)` computes that
  last product (default x * factor; the kernels pass one that stays one
  rounding inside XLA, `block_math.kept_scaled`).
  """
  dtype = product.dtype
  to_base = LOG2E if base2 else 1.0
  if spec.softcap is None:
    scale = jnp.asarray(spec.scale * to_base, dtype)
    return ar.round(scaled(product, scale), "scores"), None
  tanh = jnp.tanh(product * jnp.asarray(spec.scale / spec.softcap, dtype))
  cap = jnp.asarray(spec.softcap * to_base, dtype)
  return ar.round(scaled(tanh, cap), "scores"), tanh


def logits_in_base(x, ar, base2: bool, stage: str):
  """A logit added to the scores (a bias, rounded to `scores`; a sink, to
  `softmax_stats`) in the scores' base: times log2(e) with `base2`,
  rounded again to `stage`."""
  x = ar.round(x, stage)
  if not base2:
    return x
  return ar.round(x * jnp.asarray(LOG2E, x.dtype), stage)


def softcap_slope(tanh, ar):
  """d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2, in `softmax_stats`."""
  stats = lambda x: ar.round(x, "softmax_stats")  # noqa: E731
  return stats(1.0 - stats(tanh * tanh))


def block_ranges(spec, ops, *, q_len_padded, kv_len_padded, kv_len, bq, bk):
  """Which blocks can hold an attending pair, as half-open index ranges.

  Returns (key_blocks [B|1, nQ, 2]: for each query block, the range of key
  blocks to visit; query_blocks [B|1, nK, 2]: for each key block, the range
  of query blocks). A block outside its range has no attending pair by
  causality, window, lengths or segments (a dense mask is not used to skip);
  inside, the tile mask decides. With segments out of order the range is
  the hull of the blocks that can match.
  """
  n_q, n_k = q_len_padded // bq, kv_len_padded // bk
  possible = jnp.ones((1, n_q, n_k), bool)
  if spec.token_ids:
    q_lo, q_hi = _id_bounds(ops.q_ids, QUERY_PAD_ID, bq)
    k_lo, k_hi = _id_bounds(ops.kv_ids, KEY_PAD_ID, bk)
    possible = (k_lo[:, None, :] <= q_hi[:, :, None]) & (
      k_hi[:, None, :] >= q_lo[:, :, None]
    )
  else:
    has_keys = jnp.arange(n_k) * bk < kv_len
    possible = possible & has_keys[None, None, :]
  if spec.limits_positions:
    k_pos = key_positions(spec, ops, kv_len_padded)
    k_pos = k_pos.reshape(k_pos.shape[0], n_k, bk)
    pos_lo, pos_hi = k_pos.min(-1)[:, None, :], k_pos.max(-1)[:, None, :]
    first_row = (jnp.arange(n_q, dtype=jnp.int32) * bq)[None, :, None]
    last_row = first_row + (bq - 1)
    left, right = spec.window or (None, None)
    if spec.causal:
      possible = possible & (pos_lo <= last_row)
    if left is not None:
      possible = possible & (pos_hi >= first_row - left)
    if right is not None:
      possible = possible & (pos_lo <= last_row + right)
  return _hull(possible), _hull(jnp.swapaxes(possible, 1, 2))


def _id_bounds(ids, pad_id, block):
  """Smallest and largest non-padding id of each block [B, n]; an all-pad
  block gets (max, min) so it overlaps nothing."""
  batch, length = ids.shape
  ids = ids.reshape(batch, length // block, block)
  valid = ids != pad_id
  big = jnp.iinfo(jnp.int32).max
  lo = jnp.where(valid, ids, big).min(-1)
  hi = jnp.where(valid, ids, -big).max(-1)
  return lo, hi


def _hull(possible):
  """[..., n_rows, n_cols] -> [..., n_rows, 2]: first and one past the last
  True column (0, 0 where none)."""
  n = possible.shape[-1]
  any_ = possible.any(-1)
  first = jnp.argmax(possible, axis=-1)
  last = n - jnp.argmax(possible[..., ::-1], axis=-1)
  return jnp.where(any_[..., None], jnp.stack([first, last], -1), 0).astype(
    jnp.int32
  )


def tile_mask(
  spec: MaskSpec,
  q_start,
  k_start,
  block_q: int,
  block_k: int,
  *,
  kv_len: int,
  kv_len_padded: int,
  q_ids=None,
  kv_ids=None,
  kv_pos=None,
  dense=None,
):
  """Boolean [block_q, block_k] mask of one tile inside a kernel, or None
  when every pair attends. Padding keys (index >= kv_len) never attend."""
  q_index = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  k_index = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  k_pos = kv_pos[None, :] if spec.key_positions else k_index - spec.key_offset
  allowed = pair_mask(
    spec,
    q_index,
    k_pos,
    None if q_ids is None else q_ids[:, None],
    None if kv_ids is None else kv_ids[None, :],
  )
  if not spec.token_ids and kv_len != kv_len_padded:
    in_range = k_index < kv_len
    allowed = in_range if allowed is None else allowed & in_range
  if dense is not None:
    allowed = dense != 0 if allowed is None else allowed & (dense != 0)
  return allowed
