"""Input distributions for attention deviation studies.

Every generator returns float64 NumPy arrays q [B,T,H,D], k and v [B,S,Hkv,D]
from a seed. A study rounds them to its format before anything else, so the
golden value is computed on exactly the inputs the kernels see.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.numerics.formats import to_dtype

DISTRIBUTIONS = (
  "normal",
  "uniform",
  "outliers",
  "tied_maxima",
  "scaled",
  "key_bias",
)
DESCRIPTIONS = {
  "normal": "standard normal N(0, 1)",
  "uniform": "uniform [0, 1), what torch.rand gives",
  "outliers": "N(0,1) + N(0,100) * Bernoulli(0.001) (FlashAttention-3)",
  "tied_maxima": "rows won by bit-identical keys, one-sign V (Qiu & Yao)",
  "scaled": "N(0, 1) times a scale, to stress fp16 range",
  "key_bias": (
    "N(0, 1), K plus one offset per (batch, head, channel) shared by every "
    "token, N(0, 3^2) (the channel bias SageAttention finds in K)"
  ),
}
# Standard deviation of K's per-channel offsets in "key_bias".
KEY_BIAS_STD = 3.0


@dataclasses.dataclass(frozen=True)
class Shape:
  batch: int
  q_len: int
  kv_len: int
  heads: int
  kv_heads: int
  head_dim: int
  # The value head dim where it differs from the query/key head dim (MLA:
  # DeepSeek-V2/V3's 192/128); None: the same.
  head_dim_v: int | None = None

  @property
  def label(self) -> str:
    dims = f"D{self.head_dim}"
    if self.head_dim_v is not None:
      dims += f"/{self.head_dim_v}"
    return (
      f"B{self.batch} T{self.q_len} S{self.kv_len} "
      f"H{self.heads}/{self.kv_heads} {dims}"
    )

  @property
  def spec(self) -> tuple[int, ...]:
    """The six fields, and head_dim_v where it differs: what
    `shape_from_spec` reads back."""
    fields = dataclasses.astuple(self)
    return fields if self.head_dim_v is not None else fields[:6]

  @property
  def value_dim(self) -> int:
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  @property
  def v_shape(self):
    return (self.batch, self.kv_len, self.kv_heads, self.value_dim)

  @property
  def q_shape(self):
    return (self.batch, self.q_len, self.heads, self.head_dim)

  @property
  def kv_shape(self):
    return (self.batch, self.kv_len, self.kv_heads, self.head_dim)


@dataclasses.dataclass(frozen=True)
class TiedMaximaSpec:
  """Inputs that meet Qiu & Yao's conditions for biased BF16 rounding.

  Qiu & Yao (arXiv 2510.04212): where `ties` scores of a row are exactly
  equal at its maximum, flash attention's unnormalized probabilities there
  are exactly 1; adding the tied values of V (one sign) carries into a new
  binade, the dropped bit is often a half-ulp tie, and the small same-sign
  terms break it away from zero. The bias needs exact ties in one tile,
  one sign in V, and an untied probability mass (`margin`, relative to the
  tied mass) below about half a BF16 ulp (~1e-3) but above FP32
  resolution (~2e-8).

  Attributes:
    ties: number of bit-identical keys that hold every row's maximum.
    same_tile: put them in the first key tile; else one in each of the
      first `ties` tiles (needs kv_len >= ties * block_k).
    block_k: key tile width the positions refer to.
    margin: untied probability mass over tied mass, per row (nominal).
    v_mean, v_spread: V ~ v_mean + v_spread * N(0, 1), for every key;
      v_mean = 0 is zero-mean V.
  """

  ties: int = 2
  same_tile: bool = True
  block_k: int = 64
  margin: float = 1e-4
  v_mean: float = -1.5
  v_spread: float = 0.2

  def __post_init__(self):
    if not isinstance(self.ties, int) or self.ties < 1:
      raise ValueError(f"ties must be a positive integer, got {self.ties!r}.")
    if not self.margin > 0:
      raise ValueError(f"margin must be > 0, got {self.margin!r}.")
    if self.block_k < 1 or self.v_spread < 0:
      raise ValueError(
        f"block_k must be >= 1 and v_spread >= 0, got {self.block_k!r} and "
        f"{self.v_spread!r}."
      )


def _tied_maxima(rng, shape: Shape, spec: TiedMaximaSpec):
  """q, k, v whose rows are won by `spec.ties` bit-identical keys.

  Queries are z + t u with z orthogonal to a unit direction u; untied keys
  are orthogonal to u, so their scores are about N(0, 1); the tied key is
  sqrt(d) u, so its score is t. t = T + U(-1/2, 1/2) per row, with T set
  so the untied mass (S - n) e^(1/2 - T) is `margin` times the tied mass
  n; the spread keeps the rounding of each row's statistics independent.
  """
  d, kv_len, n = shape.head_dim, shape.kv_len, spec.ties
  if spec.same_tile and n > min(spec.block_k, kv_len):
    raise ValueError(
      f"ties={n} keys do not fit in one tile of {min(spec.block_k, kv_len)}."
    )
  if not spec.same_tile and n * spec.block_k > kv_len:
    raise ValueError(
      f"ties={n} in different tiles of {spec.block_k} keys need kv_len >= "
      f"{n * spec.block_k}, got {kv_len}."
    )
  u = rng.standard_normal(d)
  u /= np.linalg.norm(u)

  def orthogonal(x):
    return x - np.einsum("...d,d->...", x, u)[..., None] * u

  level = np.log((kv_len - n) * np.exp(0.5) / (n * spec.margin))
  t = level + rng.uniform(-0.5, 0.5, shape.q_shape[:-1])
  q = orthogonal(rng.standard_normal(shape.q_shape)) + t[..., None] * u
  k = orthogonal(rng.standard_normal(shape.kv_shape))
  if spec.same_tile:
    positions = rng.choice(min(spec.block_k, kv_len), size=n, replace=False)
  else:
    positions = np.arange(n) * spec.block_k + rng.integers(0, spec.block_k, n)
  k[:, positions] = np.sqrt(d) * u
  v = spec.v_mean + spec.v_spread * rng.standard_normal(shape.kv_shape)
  return q, k, v


def untied_mass_ratio(q, k) -> float:
  """Median over rows of (probability mass below the row max) / (mass at it)."""
  s = _grouped_scores(np.asarray(q, np.float64), np.asarray(k, np.float64))
  s = s / np.sqrt(q.shape[-1])
  top = s.max(axis=-1, keepdims=True)
  at_top = s == top
  untied = np.where(at_top, 0.0, np.exp(s - top)).sum(axis=-1)
  return float(np.median(untied / at_top.sum(axis=-1)))


def _grouped_scores(q, k):
  """Q K^T per (batch, kv head, group member): [B, Hkv, G, T, S]."""
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  q_g = q.reshape(b, t, kv_heads, h // kv_heads, d)
  return np.einsum("btkgd,bskd->bkgts", q_g, k)


def make_inputs(
  distribution: str,
  seed: int,
  shape: Shape,
  *,
  scale: float = 8.0,
  tied: TiedMaximaSpec | None = None,
  outlier_std: float = 10.0,
):
  """Random q, k, v (float64) from a named distribution.

  `outlier_std` is the standard deviation of the "outliers" spikes (10:
  FlashAttention-3's N(0, 100) read as variance 100).

  Raises:
    ValueError: for an unknown distribution name.
  """
  rng = np.random.default_rng(seed)
  if distribution == "normal":
    return tuple(
      rng.standard_normal(s)
      for s in (shape.q_shape, shape.kv_shape, shape.v_shape)
    )
  if distribution == "uniform":
    return tuple(
      rng.random(s) for s in (shape.q_shape, shape.kv_shape, shape.v_shape)
    )
  if distribution == "outliers":

    def draw(s):
      # N(0, 100) read as variance 100 (standard deviation 10).
      spikes = rng.standard_normal(s) * outlier_std * (rng.random(s) < 0.001)
      return rng.standard_normal(s) + spikes

    return draw(shape.q_shape), draw(shape.kv_shape), draw(shape.v_shape)
  if distribution == "tied_maxima":
    return _tied_maxima(rng, shape, tied or TiedMaximaSpec())
  if distribution == "key_bias":
    q, k, v = (
      rng.standard_normal(s)
      for s in (shape.q_shape, shape.kv_shape, shape.v_shape)
    )
    batch, _, kv_heads, head_dim = shape.kv_shape
    offsets = KEY_BIAS_STD * rng.standard_normal((batch, 1, kv_heads, head_dim))
    return q, k + offsets, v
  if distribution == "scaled":
    return tuple(
      scale * rng.standard_normal(s)
      for s in (shape.q_shape, shape.kv_shape, shape.v_shape)
    )
  raise ValueError(
    f"Unknown input distribution {distribution!r}; valid: "
    f"{list(DISTRIBUTIONS)}."
  )


def round_to(x: np.ndarray, fmt: str) -> np.ndarray:
  """x rounded to a number format, returned as float64."""
  return np.asarray(x).astype(to_dtype(fmt)).astype(np.float64)


def shape_from_spec(spec) -> Shape:
  """(batch, seq_len, heads, head_dim), or the six or seven fields of
  `Shape`."""
  spec = tuple(int(x) for x in spec)
  if len(spec) == 4:
    batch, length, heads, head_dim = spec
    return Shape(batch, length, length, heads, heads, head_dim)
  if len(spec) == 6:
    return Shape(*spec)
  if len(spec) == 7:
    head_dim_v = spec[6] if spec[6] != spec[5] else None
    return Shape(*spec[:6], head_dim_v)
  raise ValueError(
    f"shape {spec} must be (batch, seq_len, heads, head_dim), (batch, "
    "q_len, kv_len, heads, kv_heads, head_dim) or those and head_dim_v "
    "(the value head dim, MLA's 128 beside a query/key head dim of 192)."
  )
