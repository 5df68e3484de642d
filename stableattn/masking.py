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
gradient, never NaN.

Inside the kernels lengths and segments become one integer id per token
(padding gets ids no segment uses), so one comparison covers both.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from stableattn.tiling import check_flag

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


def _concrete(x):
  """x as a NumPy array, or None under tracing (values unknown)."""
  try:
    return np.asarray(x)
  except Exception:  # a tracer
    return None


def _int_array(name: str, x, shape: tuple, what: str, xp):
  if not hasattr(x, "shape") or tuple(x.shape) != shape:
    raise ValueError(
      f"{name} must be an integer array of shape {shape} ({what}), got "
      f"{type(x).__name__} of shape {getattr(x, 'shape', None)}."
    )
  if not np.issubdtype(np.dtype(x.dtype), np.integer):
    raise ValueError(f"{name} must have an integer dtype, got {x.dtype}.")
  return xp.asarray(x).astype(xp.int32)


def _lengths(name: str, x, batch: int, limit: int, xp):
  if x is None:
    return None
  x = _int_array(name, x, (batch,), "one length per example", xp)
  values = _concrete(x)
  if values is not None and ((values < 0) | (values > limit)).any():
    raise ValueError(
      f"{name} must lie in [0, {limit}] (the array length), got "
      f"{values.tolist()}."
    )
  return x


def check_window(local_window_size) -> tuple[int | None, int | None] | None:
  """None, an int w (meaning (w, w)), or (left, right) with sides >= 0 or
  None/-1 (unbounded, FlashAttention's -1)."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(
    local_window_size, (bool, np.bool_)
  ):
    local_window_size = (local_window_size, local_window_size)
  ok = isinstance(local_window_size, (tuple, list)) and len(local_window_size)
  sides = []
  for side in local_window_size if ok == 2 else ():
    if side is None or (
      isinstance(side, (int, np.integer))
      and not isinstance(side, (bool, np.bool_))
      and side >= -1
    ):
      sides.append(None if side is None or side == -1 else int(side))
  if len(sides) != 2:
    raise ValueError(
      "local_window_size must be None, an integer w >= 0 (the window "
      "(w, w)) or a pair (left, right) of integers >= 0, where None or -1 "
      f"leaves a side unbounded; got {local_window_size!r}."
    )
  return None if sides == [None, None] else tuple(sides)


def _positive_number(name: str, x, what: str) -> float | None:
  if x is None:
    return None
  if isinstance(x, (bool, np.bool_)) or not isinstance(
    x, (int, float, np.integer, np.floating)
  ):
    raise ValueError(
      f"{name} must be None or a number > 0 ({what}), got {x!r}."
    )
  x = float(x)
  if not math.isfinite(x) or x <= 0:
    raise ValueError(f"{name} must be a finite number > 0 ({what}), got {x!r}.")
  return x


def _broadcast_4d(name, x, batch, heads, q_len, kv_len, kind, xp):
  """Checks a [B|1, H|1, T|1, S|1] array; returns it at [B|1, H|1, T, S]
  and (per example, per head)."""
  shape = getattr(x, "shape", None)
  full = (batch, heads, q_len, kv_len)
  fits = (
    shape is not None
    and len(shape) == 4
    and all(n in (1, f) for n, f in zip(shape, full))
  )
  if not fits:
    raise ValueError(
      f"{name} must be a 4-D array broadcastable to [batch, heads, q_len, "
      f"kv_len] = [{batch}, {heads}, {q_len}, {kv_len}] (any of them may be "
      f"1), got shape {shape}."
    )
  dtype = np.dtype(x.dtype)
  if kind == "bool" and dtype != np.bool_:
    raise ValueError(
      f"{name} must be boolean (True where the pair attends), got {dtype}; "
      "an additive mask goes in `bias`."
    )
  if kind == "float" and not np.issubdtype(dtype, np.floating):
    raise ValueError(f"{name} must have a floating dtype, got {dtype}.")
  x = xp.broadcast_to(xp.asarray(x), tuple(shape[:2]) + (q_len, kv_len))
  return x, (shape[0] > 1, shape[1] > 1)


def build(
  q_shape,
  kv_shape,
  *,
  causal=False,
  causal_alignment="top_left",
  local_window_size=None,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  segment_ids=None,
  bias=None,
  mask=None,
  sink=None,
  softcap=None,
  scale=None,
  xp=jnp,
) -> tuple[MaskSpec, MaskOperands]:
  """Validates the feature arguments; their static spec and operands.

  `xp` is the array module of the operands (jax.numpy for the kernels and
  the reference, numpy for the golden). Raises ValueError naming what was
  wrong and what is valid.
  """
  batch, q_len, heads, head_dim = q_shape
  kv_len = kv_shape[1]
  causal = check_flag("causal", causal)
  if causal_alignment not in ALIGNMENTS:
    raise ValueError(
      f"Unknown causal_alignment {causal_alignment!r}; valid: "
      f"{list(ALIGNMENTS)}."
    )
  window = check_window(local_window_size)
  scale = _positive_number("scale", scale, "the score scale")
  softcap = _positive_number("softcap", softcap, "e.g. 30 or 50")
  q_lengths = _lengths("query_seq_lengths", query_seq_lengths, batch, q_len, xp)
  kv_lengths = _lengths(
    "key_value_seq_lengths", key_value_seq_lengths, batch, kv_len, xp
  )
  q_segments = kv_segments = None
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2:
      q_segments, kv_segments = segment_ids
    elif q_len == kv_len:
      q_segments = kv_segments = segment_ids
    else:
      raise ValueError(
        "segment_ids must be one [batch, seq] array (self-attention, q_len "
        "== kv_len) or a pair (q_segment_ids [batch, q_len], "
        f"kv_segment_ids [batch, kv_len]); got {type(segment_ids).__name__} "
        f"with q_len {q_len} != kv_len {kv_len}."
      )
    q_segments = _int_array(
      "q segment_ids", q_segments, (batch, q_len), "[batch, q_len]", xp
    )
    kv_segments = _int_array(
      "kv segment_ids", kv_segments, (batch, kv_len), "[batch, kv_len]", xp
    )

  operands = {}
  token_ids = any(
    x is not None for x in (q_lengths, kv_lengths, q_segments, kv_segments)
  )
  if token_ids:
    operands["q_ids"] = _token_ids(
      q_segments, q_lengths, batch, q_len, xp, True
    )
    operands["kv_ids"] = _token_ids(
      kv_segments, kv_lengths, batch, kv_len, xp, False
    )
  bottom_right = causal_alignment == "bottom_right"
  key_offset = kv_len - q_len if bottom_right else 0
  per_example = q_lengths is not None or kv_lengths is not None
  key_positions = bottom_right and per_example
  if key_positions:
    q_n = xp.full((batch,), q_len, xp.int32) if q_lengths is None else q_lengths
    kv_n = (
      xp.full((batch,), kv_len, xp.int32) if kv_lengths is None else kv_lengths
    )
    offsets = (kv_n - q_n)[:, None]
    operands["kv_pos"] = xp.arange(kv_len, dtype=xp.int32)[None, :] - offsets
    key_offset = 0
  bias_form = mask_form = None
  if bias is not None:
    operands["bias"], bias_form = _broadcast_4d(
      "bias", bias, batch, heads, q_len, kv_len, "float", xp
    )
  if mask is not None:
    mask, mask_form = _broadcast_4d(
      "mask", mask, batch, heads, q_len, kv_len, "bool", xp
    )
    operands["mask"] = mask.astype(xp.int8)
  if sink is not None:
    shape = getattr(sink, "shape", None)
    if shape is None or tuple(shape) != (heads,):
      raise ValueError(
        f"sink must be a float array of shape [heads] = [{heads}] (one "
        f"logit per query head), got shape {shape}."
      )
    if not np.issubdtype(np.dtype(sink.dtype), np.floating):
      raise ValueError(f"sink must have a floating dtype, got {sink.dtype}.")
    operands["sink"] = xp.asarray(sink)
  spec = MaskSpec(
    scale=head_dim**-0.5 if scale is None else scale,
    causal=causal,
    alignment=causal_alignment,
    window=window,
    key_offset=key_offset if (causal or window is not None) else 0,
    token_ids=token_ids,
    key_positions=key_positions and (causal or window is not None),
    bias=bias_form,
    dense_mask=mask_form,
    sink=sink is not None,
    softcap=softcap,
  )
  if not spec.key_positions:
    operands.pop("kv_pos", None)
  return spec, MaskOperands(**operands)


def _token_ids(segments, lengths, batch, length, xp, is_query):
  ids = xp.zeros((batch, length), xp.int32) if segments is None else segments
  if lengths is not None:
    pad = QUERY_PAD_ID if is_query else KEY_PAD_ID
    valid = xp.arange(length, dtype=xp.int32)[None, :] < lengths[:, None]
    ids = xp.where(valid, ids, xp.asarray(pad, xp.int32))
  return ids


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


def scores(product, spec: MaskSpec, ar):
  """Scores from Q K^T (rounded to `matmul_accum`), rounded to `scores`.

  Without softcap: product * scale. With it: softcap * tanh(product *
  (scale / softcap)), FlashAttention's form; tanh is also returned (for
  the gradient), else None.
  """
  dtype = product.dtype
  if spec.softcap is None:
    return ar.round(product * jnp.asarray(spec.scale, dtype), "scores"), None
  tanh = jnp.tanh(product * jnp.asarray(spec.scale / spec.softcap, dtype))
  return ar.round(jnp.asarray(spec.softcap, dtype) * tanh, "scores"), tanh


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
