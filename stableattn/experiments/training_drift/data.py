"""The token streams of a drift run."""

from __future__ import annotations

import numpy as np

from stableattn.experiments.training_drift.settings import Settings
from stableattn.training import data as data_lib


def load_data(s: Settings) -> tuple[np.ndarray, np.ndarray]:
  """(training tokens, evaluation tokens).

  The standard-library corpus evaluates on held-out files; the generated
  corpus and users' files draw the evaluation batch from their one stream.
  """
  if s.data_path:
    train = held_out = data_lib.load_tokens(s.data_path, s.model.vocab_size)
  elif s.corpus == "python_stdlib":
    train, held_out = data_lib.stdlib_corpus()
  else:
    train = held_out = data_lib.generate_corpus(s.corpus_tokens, s.data_seed)
  data_lib.check_length(train, s.seq_len)
  data_lib.check_length(held_out, s.seq_len)
  return train, held_out


def batch_at(tokens, s: Settings, step: int, replicate: int) -> np.ndarray:
  """The training batch of one step of one replicate."""
  return data_lib.settings_batch(tokens, s, step, replicate)
