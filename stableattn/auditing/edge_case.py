"""One input of an edge regime (`regimes.py`, `reported_regimes.py`): the
arrays, the features passed, what the case checks beyond the rules, and
why it does not apply where it does not."""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.auditing.inputs import Shape
from stableattn.auditing.measure import EdgeChecks


@dataclasses.dataclass(frozen=True)
class EdgeCase:
  """Arrays before rounding, the features passed (jax's names), the
  checks of `measure.EdgeChecks` (empty rows, poisoned keys, unjudged
  rows, a fixed cotangent), split-KV options the kernel must run with
  (`split`: num_splits or split_size; a kernel that takes none is n/a),
  and `not_applicable`: why the regime does not apply here."""

  regime: str
  detail: str
  q: np.ndarray | None = None
  k: np.ndarray | None = None
  v: np.ndarray | None = None
  features: dict = dataclasses.field(default_factory=dict)
  empty_rows: np.ndarray | None = None
  not_applicable: str | None = None
  poison: np.ndarray | None = None
  poison_value: float = float("nan")
  unjudged_rows: np.ndarray | None = None
  d_out: np.ndarray | None = None
  split: dict | None = None

  @property
  def shape(self) -> Shape:
    b, t, h, d = self.q.shape
    head_dim_v = self.v.shape[3]
    return Shape(
      b, t, self.k.shape[1], h, self.k.shape[2], d,
      None if head_dim_v == d else head_dim_v,
    )  # fmt: skip

  @property
  def checks(self) -> EdgeChecks:
    return EdgeChecks(
      self.empty_rows,
      self.poison,
      self.poison_value,
      self.unjudged_rows,
      self.d_out,
    )


def normal(rng, b, t, s, h, hkv, d, dv=None):
  """Standard normal q [b,t,h,d], k [b,s,hkv,d], v [b,s,hkv,dv or d]."""
  return (
    rng.standard_normal((b, t, h, d)),
    rng.standard_normal((b, s, hkv, d)),
    rng.standard_normal((b, s, hkv, d if dv is None else dv)),
  )


def at(shape: Shape, **changes) -> tuple:
  """(batch, q_len, kv_len, heads, kv_heads, head_dim) of `shape` with
  `changes`."""
  s = dataclasses.replace(shape, **changes)
  return s.batch, s.q_len, s.kv_len, s.heads, s.kv_heads, s.head_dim
