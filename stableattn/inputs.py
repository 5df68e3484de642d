"""Input distributions for attention deviation studies.

Every generator returns float64 NumPy arrays q [B,T,H,D], k and v [B,S,Hkv,D]
from a seed. A study rounds them to its format before anything else, so the
golden value is computed on exactly the inputs the kernels see.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.precision import to_dtype

DISTRIBUTIONS = ("normal", "uniform", "outliers", "tied_maxima", "scaled")
DESCRIPTIONS = {
  "normal": "standard normal N(0, 1)",
  "uniform": "uniform [0, 1), what torch.rand gives",
  "outliers": "N(0,1) + N(0,100) * Bernoulli(0.001) (FlashAttention-3)",
  "tied_maxima": "rows with several keys tied at the row maximum",
  "scaled": "N(0, 1) times a scale, to stress fp16 range",
}


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int

  @property
  def q_shape(self):
    return (self.batch, self.q_len, self.heads, self.head_dim)

  @property
  def kv_shape(self):
    return (self.batch, self.kv_len, self.kv_heads, self.head_dim)


def _tied_maxima(rng, shape: Shape, copies: int):
  """Keys holding `copies` identical copies of one key that wins most rows.

  Queries lean along a direction u; the key a*u is placed at `copies`
  random positions, so its score is bit-identical at every copy. The length
  a is set so that this key has the row's largest score in about 90% of
  rows; those rows then hold several softmax entries exactly at the
  maximum, where Qiu & Yao (arXiv 2510.04212) locate biased BF16 rounding.
  `tied_row_fraction` measures the share of such rows.
  """
  d = shape.head_dim
  u = rng.standard_normal(d)
  u /= np.linalg.norm(u)
  q = rng.standard_normal(shape.q_shape) + 4.0 * u
  k = rng.standard_normal(shape.kv_shape)
  v = rng.standard_normal(shape.kv_shape)
  positions = rng.choice(
    shape.kv_len, size=min(copies, shape.kv_len), replace=False
  )
  k[:, positions] = 0.0
  rowmax = _grouped_scores(q, k).max(axis=-1)  # [B, Hkv, G, T]
  along_u = np.einsum("bthd,d->bht", q, u)
  along_u = along_u.reshape(rowmax.shape[0], shape.kv_heads, -1, shape.q_len)
  ratio = rowmax / np.maximum(along_u, 1e-3)
  k[:, positions] = 1.05 * np.quantile(ratio, 0.9) * u
  return q, k, v


def _grouped_scores(q, k):
  """Q K^T per (batch, kv head, group member): [B, Hkv, G, T, S]."""
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  q_g = q.reshape(b, t, kv_heads, h // kv_heads, d)
  return np.einsum("btkgd,bskd->bkgts", q_g, k)


def tied_row_fraction(q, k) -> float:
  """Share of (query, head) rows whose maximum score occurs more than once."""
  s = _grouped_scores(np.asarray(q, np.float64), np.asarray(k, np.float64))
  ties = (s == s.max(axis=-1, keepdims=True)).sum(axis=-1)
  return float(np.mean(ties > 1))


def make_inputs(
  distribution: str,
  seed: int,
  shape: Shape,
  *,
  scale: float = 8.0,
  tied_copies: int = 4,
):
  """Random q, k, v (float64) from a named distribution.

  Raises:
    ValueError: for an unknown distribution name.
  """
  rng = np.random.default_rng(seed)
  if distribution == "normal":
    return tuple(
      rng.standard_normal(s)
      for s in (shape.q_shape, shape.kv_shape, shape.kv_shape)
    )
  if distribution == "uniform":
    return tuple(
      rng.random(s) for s in (shape.q_shape, shape.kv_shape, shape.kv_shape)
    )
  if distribution == "outliers":

    def draw(s):
      # N(0, 100) read as variance 100 (standard deviation 10).
      spikes = rng.standard_normal(s) * 10.0 * (rng.random(s) < 0.001)
      return rng.standard_normal(s) + spikes

    return draw(shape.q_shape), draw(shape.kv_shape), draw(shape.kv_shape)
  if distribution == "tied_maxima":
    return _tied_maxima(rng, shape, tied_copies)
  if distribution == "scaled":
    return tuple(
      scale * rng.standard_normal(s)
      for s in (shape.q_shape, shape.kv_shape, shape.kv_shape)
    )
  raise ValueError(
    f"Unknown input distribution {distribution!r}; valid: "
    f"{list(DISTRIBUTIONS)}."
  )


def round_to(x: np.ndarray, fmt: str) -> np.ndarray:
  """x rounded to a number format, returned as float64."""
  return np.asarray(x).astype(to_dtype(fmt)).astype(np.float64)
