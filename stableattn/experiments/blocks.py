"""Config blocks the training experiments share, as dataclasses built by
`config_values.from_block`; every value lives in the config file."""

from __future__ import annotations

import dataclasses

from stableattn.experiments.config_values import spec
from stableattn.training.model import ModelSpec

CORPORA = ("generated", "python_stdlib")


@dataclasses.dataclass(frozen=True)
class ModelBlock:
  """The `model` block: a byte-level decoder's size."""

  vocab_size: int = spec(minimum=2)
  width: int = spec(minimum=1)
  depth: int = spec(minimum=1)
  heads: int = spec(minimum=1)
  seq_len: int = spec(minimum=2)
  mlp_ratio: int = spec(minimum=1)

  def __post_init__(self):
    if self.width % self.heads:
      raise ValueError(
        f"model.width {self.width} is not divisible by model.heads "
        f"{self.heads}."
      )

  def spec(self) -> ModelSpec:
    return ModelSpec(
      vocab_size=self.vocab_size,
      width=self.width,
      depth=self.depth,
      heads=self.heads,
      max_len=self.seq_len,
      mlp_ratio=self.mlp_ratio,
    )
