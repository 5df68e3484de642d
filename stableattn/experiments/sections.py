"""Config sections the training experiments share, as dataclasses built by
`config_values.from_section`; every value lives in the config file."""

from __future__ import annotations

import dataclasses

from stableattn.harness.config_values import spec
from stableattn.training.model import ModelSpec

CORPORA = ("generated", "python_stdlib")


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """The `model` section: a byte-level decoder's size."""

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


@dataclasses.dataclass(frozen=True)
class DataSection:
  """The `data` section: which corpus, its seed and size."""

  corpus: str = spec(choices=CORPORA)
  seed: int = spec(minimum=0)
  corpus_tokens: int = spec(minimum=1)


@dataclasses.dataclass(frozen=True)
class TileSection:
  """The tile sizes of the flash kernel in an `attention` section."""

  block_q: int = spec(minimum=1)
  block_k: int = spec(minimum=1)
