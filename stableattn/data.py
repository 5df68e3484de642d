"""Training data: a generated default corpus, and loaders for users' files.

Every batch is a pure function of (tokens, seed, step), so paired runs see
identical data in identical order and a resumed run continues the stream
exactly where it stopped. Tokens are bytes (vocabulary 256) for text.
"""

from __future__ import annotations

import pathlib

import numpy as np

BYTE_VOCAB = 256
_LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


def generate_corpus(
  num_tokens: int,
  seed: int = 0,
  *,
  num_words: int = 400,
  zipf_exponent: float = 1.1,
  copy_probability: float = 0.08,
) -> np.ndarray:
  """A deterministic byte corpus with structure attention can learn.

  Words (random letter strings) follow a Zipfian first-order Markov chain,
  so local n-gram statistics are learnable; with `copy_probability` a
  sentence is replaced by a copy span "<xyz...> ... =xyz...", where the
  random string must be recalled from earlier in the context.

  Returns:
    uint16 array of `num_tokens` byte values.
  """
  rng = np.random.default_rng([seed, 12345])
  lengths = rng.integers(2, 8, size=num_words)
  words = [bytes(rng.choice(_LETTERS, size=n)) for n in lengths]
  ranks = np.arange(1, num_words + 1, dtype=np.float64)
  zipf = ranks**-zipf_exponent
  zipf /= zipf.sum()
  # Each word prefers its own small set of successors (a bigram model),
  # the first of them most.
  successors = rng.choice(num_words, size=(num_words, 8))
  slot_p = 1.0 / np.arange(1, 9)
  slot_p /= slot_p.sum()
  out = bytearray()
  word = 0
  while len(out) < num_tokens:
    if rng.random() < copy_probability:
      secret = bytes(rng.choice(_LETTERS, size=rng.integers(6, 16)))
      filler = b" ".join(
        words[i] for i in rng.choice(num_words, size=3, p=zipf)
      )
      out += b"<" + secret + b"> " + filler + b" =" + secret + b". "
      continue
    sentence = []
    for _ in range(rng.integers(4, 12)):
      if rng.random() < 0.8:
        word = int(successors[word, rng.choice(8, p=slot_p)])
      else:
        word = int(rng.choice(num_words, p=zipf))
      sentence.append(words[word])
    out += b" ".join(sentence) + b". "
  return np.frombuffer(bytes(out[:num_tokens]), dtype=np.uint8).astype(
    np.uint16
  )


def load_tokens(path: str | pathlib.Path, vocab_size: int) -> np.ndarray:
  """Tokens from a file: `.npy` (integer array), `.bin` (raw uint16), or any
  other file read as text (its bytes are the tokens).

  Raises:
    ValueError: if the file is missing, empty, not integer, not 1-D, or has
      token ids outside [0, vocab_size).
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"Token file {str(path)!r} does not exist.")
  suffix = path.suffix.lower()
  if suffix == ".npy":
    try:
      tokens = np.load(path, allow_pickle=False)
    except Exception as e:
      raise ValueError(f"{path} is not a readable .npy file: {e}") from e
    if not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(
        f"{path} holds {tokens.dtype} values; token ids must be integers."
      )
    tokens = (
      tokens.reshape(-1) if tokens.ndim == 2 and 1 in tokens.shape else tokens
    )
    if tokens.ndim != 1:
      raise ValueError(f"{path} must hold a 1-D array, got {tokens.shape}.")
  elif suffix == ".bin":
    size = path.stat().st_size
    if size % 2:
      raise ValueError(
        f"{path} has {size} bytes, not a whole number of uint16 tokens."
      )
    tokens = np.fromfile(path, dtype=np.uint16)
  else:
    tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8)
  if tokens.size == 0:
    raise ValueError(f"{path} contains no tokens.")
  low, high = int(tokens.min()), int(tokens.max())
  if low < 0 or high >= vocab_size:
    raise ValueError(
      f"{path} has token ids in [{low}, {high}], outside the model's "
      f"vocabulary [0, {vocab_size})."
    )
  return tokens.astype(np.int32)


def check_length(tokens: np.ndarray, seq_len: int) -> None:
  if tokens.size < seq_len + 1:
    raise ValueError(
      f"The data has {tokens.size} tokens, fewer than seq_len + 1 = "
      f"{seq_len + 1} needed for one training sequence."
    )


def batch_at(
  tokens: np.ndarray, *, seed: int, step: int, batch_size: int, seq_len: int
) -> np.ndarray:
  """Batch number `step`: int32 [batch_size, seq_len + 1] windows."""
  check_length(tokens, seq_len)
  rng = np.random.default_rng([seed, step])
  starts = rng.integers(0, tokens.size - seq_len, size=batch_size)
  index = starts[:, None] + np.arange(seq_len + 1)[None, :]
  return tokens[index].astype(np.int32)


def eval_batch(
  tokens: np.ndarray, *, seed: int, batch_size: int, seq_len: int
) -> np.ndarray:
  """A fixed evaluation batch, disjoint in its random stream from training."""
  return batch_at(
    tokens,
    seed=seed + 1_000_003,
    step=0,
    batch_size=batch_size,
    seq_len=seq_len,
  )
