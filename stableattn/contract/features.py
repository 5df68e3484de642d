"""`Features`: what attention computes beyond softmax(Q K^T) V, as a value.

jax's names are kept (`jax.nn.dot_product_attention`'s `is_causal` is
`causal` here), so `features.kwargs()` can be handed to any kernel on the
registry's contract, `fn(q, k, v, **features)`. `split` (`to_masking`) is
the one validation of the features and their one conversion to the static
spec and array operands of `stableattn.contract.masking`, which defines
who attends whom.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from stableattn.contract import masking
from stableattn.contract.masking import (
  KEY_PAD_ID,
  QUERY_PAD_ID,
  MaskOperands,
  MaskSpec,
)
from stableattn.contract.tiling import check_flag

_STATIC = (type(None), bool, int, float, str)


@dataclasses.dataclass(frozen=True, eq=False)
class Features:
  """The mask and score features of one attention call.

  Hashable and comparable by value when it holds no arrays (a model's
  causal mask, window and softcap), so it can be a static argument;
  arrays (lengths, segments, bias, mask, sink) compare by identity.

  Attributes:
    causal: query i sees keys up to its own position.
    causal_alignment: "top_left" (query i sees keys 0..i; jax's) or
      "bottom_right" (the last query sees the last key, FlashAttention's
      and a KV cache's), per example when lengths are given. Also places
      the local window. The same when q_len == kv_len.
    local_window_size: None, w (the window (w, w)) or (left, right): query
      i sees keys at positions i - left .. i + right; None or -1 leaves a
      side unbounded (jax's argument; FlashAttention's `window_size`).
    query_seq_lengths, key_value_seq_lengths: int [batch]: valid (leading)
      queries and keys per example; padded query rows give 0.
    segment_ids: int [batch, seq] (self-attention) or a pair (q ids
      [batch, q_len], kv ids [batch, kv_len]): a query sees only keys of
      its own segment (packed sequences).
    bias: additive score bias [batch|1, heads|1, q_len, kv_len] (ALiBi,
      relative positions); it gets a gradient.
    mask: boolean [batch|1, heads|1, q_len, kv_len], True where a pair
      attends: the general fallback, combined with every other mask.
    scale: the score scale; None means 1/sqrt(head_dim).
    softcap: logits become softcap * tanh(logits / softcap) (Gemma 2; 30
      or 50 are typical), before the bias; None for none.
    sink: float [heads]: a learnable sink logit per head that joins each
      row's softmax denominator with a zero value (gpt-oss); it gets a
      gradient.
  """

  causal: bool = False
  causal_alignment: str = "top_left"
  local_window_size: int | tuple | None = None
  query_seq_lengths: object = None
  key_value_seq_lengths: object = None
  segment_ids: object = None
  bias: object = None
  mask: object = None
  scale: float | None = None
  softcap: float | None = None
  sink: object = None

  def __post_init__(self):
    check_flag("causal", self.causal)
    if self.causal_alignment not in masking.ALIGNMENTS:
      raise ValueError(
        f"Unknown causal_alignment {self.causal_alignment!r}; valid: "
        f"{list(masking.ALIGNMENTS)}."
      )
    window = self.local_window_size
    if window is not None:
      check_window(window)
      if isinstance(window, list):
        object.__setattr__(self, "local_window_size", tuple(window))

  @classmethod
  def of(cls, features: Features | dict | None = None, **keywords):
    """`features` (a Features, a dict of its fields, or None) with
    `keywords` over it; unknown names raise, listing the valid ones."""
    if isinstance(features, Features):
      base = features.kwargs()
    elif features is None:
      base = {}
    elif isinstance(features, dict):
      base = dict(features)
    else:
      raise ValueError(
        f"features must be a stableattn.Features, a dict or None, got "
        f"{type(features).__name__}."
      )
    values = {**base, **keywords}
    unknown = sorted(set(values) - set(names()))
    if unknown:
      raise ValueError(f"Unknown features {unknown}; valid: {names()}.")
    return cls(**values)

  def kwargs(self) -> dict:
    """The features that are set (differ from the defaults), by name."""
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if not _is_default(getattr(self, f.name), f.default)
    }

  def split(self, q_shape, kv_shape, xp=jnp):
    """The validated static spec (`masking.MaskSpec`) and array operands
    (`masking.MaskOperands`) of these features for these shapes."""
    return to_masking(self, q_shape, kv_shape, xp=xp)

  def replace(self, **changes) -> Features:
    return Features.of(self, **changes)

  def _key(self) -> tuple:
    return tuple(
      v if _is_static(v) else ("array", id(v))
      for v in (getattr(self, f.name) for f in dataclasses.fields(self))
    )

  def __eq__(self, other):
    return isinstance(other, Features) and self._key() == other._key()

  def __hash__(self):
    return hash(self._key())

  def __repr__(self):
    inner = ", ".join(
      f"{k}={v!r}" if _is_static(v) else f"{k}=<array>"
      for k, v in self.kwargs().items()
    )
    return f"Features({inner})"


def _is_static(value) -> bool:
  """A Python scalar, None or a tuple of them (hashable, compared by value)."""
  if isinstance(value, tuple):
    return all(map(_is_static, value))
  return isinstance(value, _STATIC)


def _is_default(value, default) -> bool:
  return _is_static(value) and value == default


def names() -> list[str]:
  return [f.name for f in dataclasses.fields(Features)]


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
  if kind == "float" and not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name} must have a floating dtype, got {dtype}.")
  x = xp.broadcast_to(xp.asarray(x), tuple(shape[:2]) + (q_len, kv_len))
  return x, (shape[0] > 1, shape[1] > 1)


def to_masking(f: Features, q_shape, kv_shape, *, xp=jnp):
  """Validates the features against the shapes; their static spec and
  operands.

  `xp` is the array module of the operands (jax.numpy for the kernels and
  the reference, numpy for the golden). Raises ValueError naming what was
  wrong and what is valid.
  """
  batch, q_len, heads, head_dim = q_shape
  kv_len = kv_shape[1]
  window = check_window(f.local_window_size)
  scale = _positive_number("scale", f.scale, "the score scale")
  softcap = _positive_number("softcap", f.softcap, "e.g. 30 or 50")
  q_lengths = _lengths(
    "query_seq_lengths", f.query_seq_lengths, batch, q_len, xp
  )
  kv_lengths = _lengths(
    "key_value_seq_lengths", f.key_value_seq_lengths, batch, kv_len, xp
  )
  operands = _id_operands(
    _segments(f.segment_ids, batch, q_len, kv_len, xp),
    (q_lengths, kv_lengths),
    (batch, q_len, kv_len),
    xp,
  )
  bottom_right = f.causal_alignment == "bottom_right"
  key_offset = kv_len - q_len if bottom_right else 0
  per_example = q_lengths is not None or kv_lengths is not None
  bounded = f.causal or window is not None
  key_positions = bottom_right and per_example and bounded
  if key_positions:
    full = (xp.full((batch,), n, xp.int32) for n in (q_len, kv_len))
    q_n, kv_n = (
      given if given is not None else default
      for given, default in zip((q_lengths, kv_lengths), full)
    )
    offsets = (kv_n - q_n)[:, None]
    operands["kv_pos"] = xp.arange(kv_len, dtype=xp.int32)[None, :] - offsets
    key_offset = 0
  forms = _dense_operands(f, operands, (batch, heads, q_len, kv_len), xp)
  spec = MaskSpec(
    scale=head_dim**-0.5 if scale is None else scale,
    causal=f.causal,
    alignment=f.causal_alignment,
    window=window,
    key_offset=key_offset if bounded else 0,
    token_ids="q_ids" in operands,
    key_positions=key_positions,
    bias=forms["bias"],
    dense_mask=forms["mask"],
    sink=f.sink is not None,
    softcap=softcap,
  )
  return spec, MaskOperands(**operands)


def _segments(segment_ids, batch, q_len, kv_len, xp):
  """(q segment ids [batch, q_len], kv segment ids [batch, kv_len])."""
  if segment_ids is None:
    return None, None
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
  return (
    _int_array(
      "q segment_ids", q_segments, (batch, q_len), "[batch, q_len]", xp
    ),
    _int_array(
      "kv segment_ids", kv_segments, (batch, kv_len), "[batch, kv_len]", xp
    ),
  )


def _id_operands(segments, lengths, sizes, xp) -> dict:
  """Lengths and segments as one integer id per token (q_ids, kv_ids)."""
  if all(x is None for x in (*segments, *lengths)):
    return {}
  batch, q_len, kv_len = sizes
  return {
    "q_ids": _token_ids(segments[0], lengths[0], batch, q_len, xp, True),
    "kv_ids": _token_ids(segments[1], lengths[1], batch, kv_len, xp, False),
  }


def _dense_operands(f: Features, operands: dict, full, xp) -> dict:
  """Adds bias, mask and sink to `operands`; the bias's and mask's forms
  (per example, per head), or None."""
  forms = {"bias": None, "mask": None}
  if f.bias is not None:
    operands["bias"], forms["bias"] = _broadcast_4d(
      "bias", f.bias, *full, "float", xp
    )
  if f.mask is not None:
    mask, forms["mask"] = _broadcast_4d("mask", f.mask, *full, "bool", xp)
    operands["mask"] = mask.astype(xp.int8)
  if f.sink is not None:
    heads = full[1]
    shape = getattr(f.sink, "shape", None)
    if shape is None or tuple(shape) != (heads,):
      raise ValueError(
        f"sink must be a float array of shape [heads] = [{heads}] (one "
        f"logit per query head), got shape {shape}."
      )
    if not jnp.issubdtype(np.dtype(f.sink.dtype), jnp.floating):
      raise ValueError(f"sink must have a floating dtype, got {f.sink.dtype}.")
    operands["sink"] = xp.asarray(f.sink)
  return forms


def _token_ids(segments, lengths, batch, length, xp, is_query):
  ids = xp.zeros((batch, length), xp.int32) if segments is None else segments
  if lengths is not None:
    pad = QUERY_PAD_ID if is_query else KEY_PAD_ID
    valid = xp.arange(length, dtype=xp.int32)[None, :] < lengths[:, None]
    ids = xp.where(valid, ids, xp.asarray(pad, xp.int32))
  return ids
