"""Offsets shared by every key or value: two invariances and a regime.

Trained models' keys share a component (massive activations and attention
sinks, Sun et al. arXiv 2402.17762, Gu et al. arXiv 2410.10781; per-channel
offsets), and their values often do. Softmax ignores a component shared by
every key of a row: K + c moves each row of logits by the constant q.c, so
O, dQ, dK and dV are unchanged in exact arithmetic; V + c moves O by c and
leaves every gradient unchanged. FlashAttention-2's backward takes
delta = rowsum(dO * O) from the rounded O, so the rows of its dS no longer
sum to zero and the shared key component enters dQ in full (Qiu & Yao,
arXiv 2510.04212, Eq. 1: dQ_flash - dQ = scale diag(D_flash - D) P K);
a value offset makes |O|, and so D's rounding error, larger.

- `key_shift`, `value_shift`: the audit's first grid input with a shared
  c of norm 1, 10 and 100 times the rms key (value) norm added, judged
  by the rules against the same-format Baseline on the shifted input; a
  kernel whose error grows with |c| faster than the Baseline's fails.
  c points along each head's direction of least query energy, so the
  constant it adds to a row's logits stays small (a row constant in the
  hundreds would make the BF16 Baseline's stored scores, not the kernel,
  the story).
- `key_offset` (a regime): keys alpha u + sigma eps with alpha / sigma
  from 1 to 100, values with a shared offset and their own per-token
  draw, queries either orthogonal to u (near ties from sigma's part) or
  aligned so that the row constant reaches the hundreds: the geometry
  that made BF16 flash backwards miss on a model's captured layers.
"""

from __future__ import annotations

import numpy as np

from stableattn.auditing.edge_case import EdgeCase, at
from stableattn.auditing.inputs import Shape, make_inputs

SHIFT_INVARIANCES = ("key_shift", "value_shift")
DESCRIPTIONS = {
  "key_shift": "K + c, one c shared by every key of a head (|c| 1, 10, "
  "100 x the rms key): O, dQ, dK, dV unchanged in exact arithmetic; the "
  "kernel's error must not grow past the Baseline's",
  "value_shift": "V + c, one c shared by every value of a head (|c| 1, "
  "10, 100 x the rms value): O moves by c, the gradients are unchanged",
}
# |c| in units of the rms key (or value) norm.
SHIFTS = (1.0, 10.0, 100.0)
# (alpha / sigma, value offset / sigma, row-constant logit) of the regime.
KEY_OFFSET_CASES = (
  (1.0, 1.0, 0.0),
  (10.0, 3.0, 0.0),
  (100.0, 10.0, 0.0),
  (100.0, 3.0, 300.0),
)


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def least_query_direction(q, kv_heads: int):
  """[1, 1, kv_heads, D]: per KV head, the unit vector along which its
  queries (every query head of its group, every batch row) have the
  least energy: a shared key component there moves each row of logits
  the least."""
  b, t, h, d = q.shape
  grouped = q.reshape(b, t, kv_heads, h // kv_heads, d)
  out = np.empty((1, 1, kv_heads, d))
  for g in range(kv_heads):
    rows = grouped[:, :, g].reshape(-1, d)
    _, _, vt = np.linalg.svd(rows, full_matrices=True)
    out[0, 0, g] = vt[-1]
  return out


def _rms_norm(x) -> np.ndarray:
  """[1, 1, heads, 1]: the rms over tokens of each head's vector norm."""
  squared = np.sum(x**2, axis=-1, keepdims=True)
  return np.sqrt(np.mean(squared, axis=(0, 1), keepdims=True))


def shift_cases(
  name: str, shape: Shape, distribution: str, seed: int = 0
) -> list[EdgeCase]:
  """The cases of invariance `name` (`SHIFT_INVARIANCES`) at the audit's
  input of (shape, distribution, seed)."""
  if name not in SHIFT_INVARIANCES:
    raise ValueError(
      f"unknown shift invariance {name!r}; valid: {list(SHIFT_INVARIANCES)}."
    )
  q, k, v = make_inputs(distribution, seed, shape)
  rng = np.random.default_rng([seed, SHIFT_INVARIANCES.index(name)])
  if name == "key_shift":
    direction = least_query_direction(q, shape.kv_heads)
    target, unit = k, direction
  else:
    unit = _unit(rng.standard_normal((1, 1, shape.kv_heads, v.shape[-1])))
    target = v
  size = _rms_norm(target)
  cases = []
  for shift in SHIFTS:
    moved = target + shift * size * unit
    arrays = (q, moved, v) if name == "key_shift" else (q, k, moved)
    detail = (
      f"|c| = {shift:g} x rms {'key' if name == 'key_shift' else 'value'}"
    )
    cases.append(EdgeCase(name, detail, *arrays))
  return cases


def shift_cases_at(first, names) -> list[EdgeCase]:
  """The cases of the shift invariances `names` at the input of `first`,
  the grid's first case (`kernel_audit.Case`): judged rows, measured with
  the regimes' and captures' cases (`regimes.measure_cases`)."""
  return [
    case
    for name in names
    for case in shift_cases(name, first.shape, first.distribution, first.seed)
  ]


def key_offset(shape: Shape, rng, inputs_format) -> list[EdgeCase]:
  """The `key_offset` regime's cases at an audit shape (its batch, lengths,
  heads and head dims)."""
  del inputs_format
  b, t, s, h, hkv, d = at(shape)
  dv = shape.value_dim
  group = h // hkv
  cases = []
  for ratio, value_offset, row_logit in KEY_OFFSET_CASES:
    u = _unit(rng.standard_normal((1, 1, hkv, d)))
    w = _unit(rng.standard_normal((1, 1, hkv, dv)))
    # sigma = 1 per channel: the rms of K - mean is sqrt(d).
    k = ratio * np.sqrt(d) * u + rng.standard_normal((b, s, hkv, d))
    v = value_offset * np.sqrt(dv) * w + rng.standard_normal((b, s, hkv, dv))
    q = rng.standard_normal((b, t, h, d))
    u_q = np.repeat(u, group, axis=2)
    q -= np.sum(q * u_q, axis=-1, keepdims=True) * u_q
    # q.k / sqrt(d) gains row_logit from u: q's component along u is
    # row_logit / ratio.
    q += (row_logit / ratio) * u_q
    detail = (
      f"alpha/sigma {ratio:g}, value offset {value_offset:g}, row logit "
      f"{row_logit:g}"
    )
    cases.append(EdgeCase("key_offset", detail, q, k, v))
  return cases
