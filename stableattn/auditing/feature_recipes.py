"""Named features built per shape: the audit's `--config.features` and the
forward experiments' settings, as hashable recipes of `Features`."""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.auditing.inputs import Shape
from stableattn.contract.features import Features

# The named features the audit and the experiments build per shape.
RECIPE_NAMES = (
  "causal",
  "bottom_right",
  "window",
  "lengths",
  "segments",
  "softcap",
  "sink",
  "alibi",
)


@dataclasses.dataclass(frozen=True)
class FeatureRecipe:
  """Hashable settings that build a case's `Features` for its shape."""

  causal: bool = False
  causal_alignment: str = "top_left"
  window: tuple[int | None, int | None] | None = None
  softcap: float | None = None
  segments: int = 1  # equal packed segments per sequence
  sink: float | None = None  # one sink logit for every head
  alibi: bool = False  # ALiBi (Press et al. 2022) as a bias
  lengths: bool = False  # per-example key lengths: a padded batch

  @classmethod
  def from_names(cls, text) -> FeatureRecipe:
    """From "causal,window,segments,..." (`RECIPE_NAMES`), at the sizes an
    audit uses: a (32, 0) window, 2 segments, softcap 30, sink 1, ALiBi
    slopes, a quarter of the keys padded in odd examples."""
    chosen = [s.strip() for s in str(text).split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(RECIPE_NAMES))
    if unknown:
      raise ValueError(
        f"Unknown features {unknown}; valid: {list(RECIPE_NAMES)}."
      )
    return cls(
      causal="causal" in chosen,
      causal_alignment="bottom_right"
      if "bottom_right" in chosen
      else "top_left",
      window=(32, 0) if "window" in chosen else None,
      softcap=30.0 if "softcap" in chosen else None,
      segments=2 if "segments" in chosen else 1,
      sink=1.0 if "sink" in chosen else None,
      alibi="alibi" in chosen,
      lengths="lengths" in chosen,
    )

  @property
  def label(self) -> str:
    """The recipe's names ("causal,window"), or "none"."""
    on = dict(
      causal=self.causal,
      bottom_right=self.causal_alignment == "bottom_right",
      window=self.window is not None,
      lengths=self.lengths,
      segments=self.segments > 1,
      softcap=self.softcap is not None,
      sink=self.sink is not None,
      alibi=self.alibi,
    )
    return ",".join(name for name in RECIPE_NAMES if on[name]) or "none"

  def build(self, shape: Shape) -> Features:
    args = dict(causal=self.causal, causal_alignment=self.causal_alignment)
    if self.window is not None:
      args["local_window_size"] = self.window
    if self.softcap is not None:
      args["softcap"] = self.softcap
    if self.segments > 1:
      args["segment_ids"] = tuple(
        np.broadcast_to(
          (np.arange(n) * self.segments // n).astype(np.int32),
          (shape.batch, n),
        )
        for n in (shape.q_len, shape.kv_len)
      )
    if self.sink is not None:
      args["sink"] = np.full((shape.heads,), self.sink, np.float32)
    if self.alibi:
      args["bias"] = self._alibi(shape)
    if self.lengths:
      short = np.arange(shape.batch) % 2 * (shape.kv_len // 4)
      args["key_value_seq_lengths"] = (shape.kv_len - short).astype(np.int32)
    return Features(**args)

  def _alibi(self, shape: Shape):
    """-m_h |i - j| with m_h = 2^(-8h/H), positions aligned as the mask."""
    heads = np.arange(1, shape.heads + 1)
    slopes = 2.0 ** (-8.0 * heads / shape.heads)
    offset = (
      shape.kv_len - shape.q_len
      if self.causal_alignment == "bottom_right"
      else 0
    )
    i = np.arange(shape.q_len)[:, None] + offset
    j = np.arange(shape.kv_len)[None, :]
    bias = -slopes[:, None, None] * np.abs(i - j)[None]
    return bias[None].astype(np.float32)
