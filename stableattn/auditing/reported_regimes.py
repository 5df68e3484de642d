"""Edge regimes from the failures users reported against attention kernels
(2023-2026), each named after what broke and built from an audit shape.

- poisoned_padding: NaN or Inf in padding and unused cache slots leaking
  through the mask as 0 x NaN in P V (flash-attention #1745 and #2374,
  vLLM #936; tokamax's tests check NaN padding).
- small_logits: rows whose log-sum-exp is below FP32's -88.7, also at key
  lengths of 64 mod 128 with a mask (PyTorch #196678: cuDNN's backward
  NaN there; cudnn-frontend #1072).
- finite_mask: masks written as a large finite negative bias (the
  format's minimum, -1e9, FP16's minimum) instead of -inf, with fully
  masked rows and fully masked 64- and 128-key tiles (PyTorch #110213,
  #109517).
- score_ramp: scores rising along the keys, so the row max grows in every
  key block and every block rescales (flash-attention #2577, #2067).
- empty_splits: split-KV with splits that hold no key (flashinfer #4051,
  flash-attention #2842 and #978).
- sink_extremes: sink logits from -20 to 100, and d(sink) terms that
  cancel (jax #40128, flash-attention #2752, TransformerEngine #3551).
- gqa_groups: 8 to 64 query heads per KV head (TransformerEngine #3216).
- head_dims: a value head dim other than the query/key one (MLA: 192/128,
  absorbed 576/512; TransformerEngine #3249).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from stableattn.auditing.edge_case import EdgeCase, at, normal
from stableattn.numerics.formats import to_dtype

# How far below 0 the small-logits queries point: every row's log-sum-exp
# then lies below FP32's -88.7 at 64 keys; at the trigger's longer key
# lengths the queries point further (TRIGGER_LEVEL).
SMALL_LOGITS_LEVEL = 120.0
TRIGGER_LEVEL = 140.0
# PyTorch #196678's trigger: a key length of 64 mod 128.
TRIGGER_MODULUS, TRIGGER_REMAINDER = 128, 64
FP16_MIN = -65504.0
# Keys in the finite-mask case: a masked 64-key tile (64-127), a masked
# 128-key tile (128-255) and a partial tile at the end.
FINITE_MASK_KEYS = 320
RAMP_STEPS = (0.5, 4.0, 20.0)  # the row max's rise per 64 keys
SINKS = (-20.0, 0.0, 20.0, 100.0)
GROUPS = ((2, 16, 2), (1, 8, 1), (1, 64, 1))  # (batch, heads, kv_heads)


def _lengths_mask(lengths, s):
  """[B, S] bool: key positions at or past each example's length."""
  return np.arange(s)[None] >= np.asarray(lengths)[:, None]


def poisoned_padding(shape, rng, inputs_format):
  """NaN, then +Inf, in every K and V position no query may attend: past
  the key lengths, in a padded batch's tail, in a segment no query
  belongs to, and in a decode cache's unused slots. The output and
  gradients must be the clean run's (the rows say whether bitwise)."""
  t, s, h, hkv, d = (
    shape.q_len,
    shape.kv_len,
    shape.heads,
    shape.kv_heads,
    (shape.head_dim),
  )
  dv = shape.head_dim_v
  layouts = []
  short = np.array([s, max(1, s // 3)], np.int32)
  q, k, v = normal(rng, 2, t, s, h, hkv, d, dv)
  layouts.append((f"keys past the key length {short[1]}", q, k, v,
                  {"key_value_seq_lengths": short},
                  _lengths_mask(short, s), None))  # fmt: skip
  q_lengths = np.array([t, max(1, t // 2)], np.int32)
  q, k, v = normal(rng, 2, t, s, h, hkv, d, dv)
  layouts.append((f"a padded batch (lengths {q_lengths[1]}/{short[1]})", q,
                  k, v, {"query_seq_lengths": q_lengths,
                         "key_value_seq_lengths": short},
                  _lengths_mask(short, s),
                  _lengths_mask(q_lengths, t)))  # fmt: skip
  q_ids = (np.arange(t) >= t // 2).astype(np.int32)[None].repeat(2, 0)
  kv_ids = np.minimum(np.arange(s) * 3 // s, 2).astype(np.int32)
  kv_ids = kv_ids[None].repeat(2, 0)
  q, k, v = normal(rng, 2, t, s, h, hkv, d, dv)
  layouts.append(("a key segment no query belongs to", q, k, v,
                  {"segment_ids": (q_ids, kv_ids)}, kv_ids == 2,
                  None))  # fmt: skip
  used = np.array([s, max(1, s - 1), max(1, s // 2), 1], np.int32)
  q, k, v = normal(rng, 4, 1, s, h, hkv, d, dv)
  layouts.append(("a decode cache's unused slots", q, k, v,
                  {"key_value_seq_lengths": used}, _lengths_mask(used, s),
                  None))  # fmt: skip
  return [
    EdgeCase(
      "poisoned_padding",
      f"{name}: {label}",
      q,
      k,
      v,
      features,
      empty_rows=empty,
      poison=poison,
      poison_value=value,
    )  # fmt: skip
    for value, label in ((np.nan, "NaN"), (np.inf, "+Inf"))
    for name, q, k, v, features, poison, empty in layouts
  ]


def _against_one_direction(rng, shape, level=SMALL_LOGITS_LEVEL):
  """Keys share a direction u; queries point against it, so every score
  of a row is about -level (spread about 11 from the keys' noise; at
  level 120 over 64 keys every row's log-sum-exp is below -88.7).
  `shape`: (b, t, s, h, hkv, d, dv or None)."""
  b, t, s, h, hkv, d, dv = shape
  u = rng.standard_normal(d)
  u /= np.linalg.norm(u)
  k = np.sqrt(d) * u + 0.5 * rng.standard_normal((b, s, hkv, d))
  z = rng.standard_normal((b, t, h, d))
  z -= np.einsum("bthd,d->bth", z, u)[..., None] * u
  q = -level * u + z
  v = rng.standard_normal((b, s, hkv, d if dv is None else dv))
  return q, k, v


def _trigger_length(kv_len: int) -> int:
  """The key length of 64 mod 128 nearest below or at kv_len (at least
  64)."""
  if kv_len % TRIGGER_MODULUS == TRIGGER_REMAINDER:
    return kv_len
  below = (kv_len // TRIGGER_MODULUS) * TRIGGER_MODULUS + TRIGGER_REMAINDER
  return below if below <= kv_len else max(TRIGGER_REMAINDER, below - 128)


def _random_mask(rng, b, t, s, density=0.8):
  """[b, 1, t, s] bool with every row attending at least one key."""
  mask = rng.random((b, 1, t, s)) < density
  mask[..., np.arange(t), np.arange(t) % s] = True
  return mask


def small_logits(shape, rng, inputs_format):
  """Scores near -120 at the shape's lengths, then at a key length of 64
  mod 128 with each kind of mask (lengths, segments, boolean, bias)."""
  b, t, s, h, hkv, d = at(shape)
  dv = shape.head_dim_v
  q, k, v = _against_one_direction(rng, (b, t, s, h, hkv, d, dv))
  cases = [EdgeCase("small_logits", "scores near -120", q, k, v)]
  s = _trigger_length(s)
  lengths = np.array([s, s // 2 + 1], np.int32)
  ids = np.int32(np.arange(max(t, s)) >= max(t, s) // 2)[None].repeat(2, 0)
  mask = _random_mask(rng, 2, t, s)
  bias = np.where(mask, 0.0, -np.inf).astype(np.float32)
  for label, features in (
    ("key lengths", {"key_value_seq_lengths": lengths}),
    ("segments", {"segment_ids": (ids[:, :t], ids[:, :s])}),
    ("a boolean mask", {"mask": mask}),
    ("a -inf bias mask", {"bias": bias}),
  ):
    q, k, v = _against_one_direction(
      rng, (2, t, s, h, hkv, d, dv), TRIGGER_LEVEL
    )
    cases.append(EdgeCase("small_logits", f"S{s} (64 mod 128), {label}, "
                          "scores near -140", q, k, v, features))  # fmt: skip
  return cases


def finite_mask(shape, rng, inputs_format):
  """A mask passed as an additive bias of a large finite negative: the
  format's minimum, -1e9 and FP16's minimum. Two rows are fully masked
  (their value is a convention: 0, or the mean of V when every score
  moves by the same finite amount), so they are reported, not judged;
  keys 64-127 and 128-255 are masked for every row."""
  t, s, h, hkv, d = (
    shape.q_len,
    FINITE_MASK_KEYS,
    shape.heads,
    (shape.kv_heads),
    shape.head_dim,
  )
  # One query (decoding): two examples, the first's row fully masked, so
  # a judged row remains beside it.
  batch = 2 if t == 1 else 1
  allowed = rng.random((batch, 1, t, s)) < 0.7
  allowed[..., 64:256] = False
  allowed[..., 0] = True
  full = sorted({0, t // 2})
  masked_examples = slice(0, 1)
  allowed[masked_examples, :, full, :] = False
  unjudged = np.zeros((batch, t), bool)
  unjudged[masked_examples, full] = True
  where = " of the first example" if batch > 1 else ""
  dtype = to_dtype(inputs_format)
  values = (
    (f"the {inputs_format} minimum", float(ml_dtypes.finfo(dtype).min), dtype),
    ("-1e9", -1e9, np.float32),
    ("the FP16 minimum", FP16_MIN, np.float32),
  )
  cases = []
  for label, value, bias_dtype in values:
    q, k, v = normal(rng, batch, t, s, h, hkv, d, shape.head_dim_v)
    bias = np.where(allowed, 0.0, value).astype(bias_dtype)
    cases.append(EdgeCase("finite_mask", f"bias {label} ({value:.3g}), "
                          f"rows {full}{where} fully masked", q, k, v,
                          {"bias": bias}, unjudged_rows=unjudged))  # fmt: skip
  return cases


def score_ramp(shape, rng, inputs_format):
  """Scores N(0, 1) + step * j / 64 for key j: every key block raises the
  row max, so every block rescales what came before."""
  t, s = shape.q_len, max(shape.kv_len, 256)
  h, hkv, d = shape.heads, shape.kv_heads, shape.head_dim
  cases = []
  for step in RAMP_STEPS:
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    q, k, v = normal(rng, 1, t, s, h, hkv, d, shape.head_dim_v)
    q -= np.einsum("bthd,d->bth", q, u)[..., None] * u
    k -= np.einsum("bshd,d->bsh", k, u)[..., None] * u
    # q.u = sqrt(d) and k.u = ramp, so the score gains exactly the ramp.
    q += np.sqrt(d) * u
    k += (step * np.arange(s) / 64.0)[None, :, None, None] * u
    cases.append(EdgeCase("score_ramp", f"S{s}, max +{step:g} per 64 keys",
                          q, k, v))  # fmt: skip
  return cases


def empty_splits(shape, rng, inputs_format):
  """Split-KV decoding where splits hold no key: more splits than key
  blocks, splits past the length or in a segment no query belongs to,
  and a sequence of length 0 (its row must be 0)."""
  h, hkv, d, dv = (
    shape.heads,
    shape.kv_heads,
    shape.head_dim,
    (shape.head_dim_v),
  )
  cases = []
  q, k, v = normal(rng, 4, 1, 128, h, hkv, d, dv)
  cases.append(EdgeCase("empty_splits", "8 splits over 128 keys", q, k, v,
                        split={"num_splits": 8}))  # fmt: skip
  lengths = np.array([256, 40, 100, 1], np.int32)
  q, k, v = normal(rng, 4, 1, 256, h, hkv, d, dv)
  cases.append(EdgeCase("empty_splits", "4 splits, lengths [256 40 100 1]",
                        q, k, v, {"key_value_seq_lengths": lengths},
                        split={"num_splits": 4}))  # fmt: skip
  kv_ids = np.int32((np.arange(256) >= 64) & (np.arange(256) < 192))
  ids = (np.zeros((4, 1), np.int32), kv_ids[None].repeat(4, 0))
  q, k, v = normal(rng, 4, 1, 256, h, hkv, d, dv)
  cases.append(EdgeCase("empty_splits", "4 splits, keys 64-191 in another "
                        "segment", q, k, v, {"segment_ids": ids},
                        split={"num_splits": 4}))  # fmt: skip
  lengths = np.array([256, 0, 64, 17], np.int32)
  empty = (lengths == 0)[:, None]
  for split in ({"num_splits": 4}, {"split_size": 64}):
    q, k, v = normal(rng, 4, 1, 256, h, hkv, d, dv)
    name = ", ".join(f"{n}={x}" for n, x in split.items())
    cases.append(EdgeCase("empty_splits", f"{name}, lengths [256 0 64 17]",
                          q, k, v, {"key_value_seq_lengths": lengths},
                          empty_rows=empty, split=split))  # fmt: skip
  return cases


def sink_extremes(shape, rng, inputs_format):
  """Sink logits of -20, 0, 20 and 100 (at 20 and 100 the sink holds
  almost all of every row's weight), then rows whose d(sink) terms
  cancel: pairs of equal queries with opposite cotangents, equal to 1e-3
  of their size."""
  b, t, s, h, hkv, d = at(shape)
  dv = shape.head_dim_v
  cases = []
  for value in SINKS:
    q, k, v = normal(rng, b, t, s, h, hkv, d, dv)
    sink = np.full(h, value, np.float32)
    cases.append(EdgeCase("sink_extremes", f"sink {value:g}", q, k, v,
                          {"sink": sink}))  # fmt: skip
  if t >= 2:
    q, k, v = normal(rng, b, t, s, h, hkv, d, dv)
    pairs = t // 2 * 2
    q[:, 1:pairs:2] = q[:, 0:pairs:2]
    d_out = rng.standard_normal((b, t, h, v.shape[3]))
    d_out[:, 1:pairs:2] = -d_out[:, 0:pairs:2] * (
      1.0 + 1e-3 * rng.standard_normal(d_out[:, 0:pairs:2].shape)
    )
    sink = np.full(h, 2.0, np.float32)
    cases.append(EdgeCase("sink_extremes", "sink 2, d(sink) terms cancel to "
                          "1e-3", q, k, v, {"sink": sink},
                          d_out=d_out))  # fmt: skip
  return cases


def gqa_groups(shape, rng, inputs_format):
  """8, 16 (over 2 KV heads, batch 2: TransformerEngine #3216's layout)
  and 64 query heads per KV head; dK and dV sum over the group."""
  t, s, d = shape.q_len, shape.kv_len, shape.head_dim
  cases = []
  for b, h, hkv in GROUPS:
    q, k, v = normal(rng, b, t, s, h, hkv, d, shape.head_dim_v)
    cases.append(EdgeCase("gqa_groups", f"{h // hkv} query heads per KV "
                          f"head (H{h}/{hkv}, B{b})", q, k, v))  # fmt: skip
  return cases


def head_dims(shape, rng, inputs_format):
  """A value head dim other than the query/key one: DeepSeek-V2/V3's
  192/128 at the shape's lengths, and 576/512 of absorbed MLA decoding
  (every query head over one latent KV head). A kernel that refuses with
  a ValueError is n/a with its message."""
  b, t, s, h, _, _ = at(shape)
  q, k, v = normal(rng, b, t, s, h, 2 if h % 2 == 0 else 1, 192, 128)
  # Causal where queries and keys are one sequence; a query before its
  # keys (one query, top-left) would see one key, and dQ would be 0.
  features = {"causal": True} if t == s else {}
  cases = [EdgeCase("head_dims", "QK 192, V 128", q, k, v, features)]
  q, k, v = normal(rng, 2, 1, s, h, 1, 576, 512)
  cases.append(EdgeCase("head_dims", "QK 576, V 512 (absorbed MLA decode)",
                        q, k, v))  # fmt: skip
  return cases
