"""Training data: a generated corpus, the Python standard library's own
source (real text read from the running interpreter, with a held-out split),
and loaders for users' files.

Every batch is a pure function of (tokens, seed, step), so paired runs see
identical data in identical order and a resumed run continues the stream
exactly where it stopped. Tokens are bytes (vocabulary 256) for text.
"""

from __future__ import annotations

import pathlib
import sysconfig

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
  tokens: np.ndarray,
  *,
  seed: int,
  step: int,
  batch_size: int,
  seq_len: int,
  replicate: int = 0,
) -> np.ndarray:
  """Batch number `step`: int32 [batch_size, seq_len + 1] windows.

  Each replicate of an experiment reads the corpus in its own order.
  """
  check_length(tokens, seq_len)
  if replicate < 0:
    raise ValueError(f"replicate must be >= 0, got {replicate}.")
  rng = np.random.default_rng([seed, step, replicate])
  starts = rng.integers(0, tokens.size - seq_len, size=batch_size)
  index = starts[:, None] + np.arange(seq_len + 1)[None, :]
  return tokens[index].astype(np.int32)


def settings_batch(tokens: np.ndarray, s, step: int, replicate: int):
  """`batch_at` with an experiment's settings `s` (its `data_seed`,
  `batch_size` and `seq_len`)."""
  return batch_at(
    tokens,
    seed=s.data_seed,
    step=step,
    batch_size=s.batch_size,
    seq_len=s.seq_len,
    replicate=replicate,
  )


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


# Pure-Python modules of the standard library, present (as these files)
# from Python 3.10 to 3.13, in a fixed order: about 4 MB of real text that
# every machine running this project has, read at run time, no download.
STDLIB_FILES = (
  "argparse.py", "ast.py", "bdb.py", "calendar.py", "cmd.py", "code.py",
  "codecs.py", "configparser.py", "contextlib.py", "copy.py", "csv.py",
  "dataclasses.py", "datetime.py", "decimal.py", "difflib.py", "dis.py",
  "doctest.py", "email/message.py", "email/_header_value_parser.py",
  "email/feedparser.py", "enum.py", "fileinput.py", "fnmatch.py",
  "fractions.py", "ftplib.py", "functools.py", "getopt.py", "gettext.py",
  "glob.py", "gzip.py", "heapq.py", "hmac.py", "http/client.py",
  "http/cookiejar.py", "http/server.py", "imaplib.py", "inspect.py",
  "ipaddress.py", "json/decoder.py", "json/encoder.py", "locale.py",
  "logging/__init__.py", "logging/handlers.py", "mailbox.py", "numbers.py",
  "operator.py", "optparse.py", "os.py", "pdb.py", "pickle.py",
  "pickletools.py", "platform.py", "plistlib.py", "poplib.py", "pprint.py",
  "profile.py", "pstats.py", "pydoc.py", "queue.py", "random.py",
  "reprlib.py", "sched.py", "secrets.py", "selectors.py", "shlex.py",
  "shutil.py", "smtplib.py", "socket.py", "socketserver.py", "ssl.py",
  "statistics.py", "string.py", "subprocess.py", "symtable.py",
  "tabnanny.py", "tarfile.py", "tempfile.py", "textwrap.py", "threading.py",
  "timeit.py", "token.py", "tokenize.py", "trace.py", "traceback.py",
  "types.py", "typing.py", "unittest/case.py", "unittest/mock.py",
  "urllib/parse.py", "urllib/request.py", "uuid.py", "warnings.py",
  "wave.py", "weakref.py", "webbrowser.py", "zipapp.py",
)  # fmt: skip
# Every HELD_OUT_EVERY-th file of the list is held out for evaluation.
HELD_OUT_EVERY = 10


def stdlib_split(stdlib_dir: str | pathlib.Path | None = None):
  """(train files, held-out files) of the standard-library corpus.

  Files are split by position in `STDLIB_FILES`, so the two sets are
  disjoint and the same on every run. A file this interpreter lacks is
  left out of both.

  Raises:
    ValueError: if fewer than 90% of the files exist (not a CPython
      standard library).
  """
  root = pathlib.Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
  present = [name for name in STDLIB_FILES if (root / name).is_file()]
  if len(present) < 0.9 * len(STDLIB_FILES):
    raise ValueError(
      f"{root} holds only {len(present)} of the {len(STDLIB_FILES)} "
      "standard-library files the python_stdlib corpus reads; point "
      "data.path at your own corpus instead."
    )
  held_out = [
    name
    for i, name in enumerate(STDLIB_FILES)
    if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 and name in present
  ]
  train = [name for name in present if name not in held_out]
  return [root / n for n in train], [root / n for n in held_out]


def stdlib_corpus(stdlib_dir: str | pathlib.Path | None = None):
  """(train tokens, held-out tokens): the files' bytes as uint8 tokens."""

  def read(paths):
    return np.frombuffer(b"".join(p.read_bytes() for p in paths), np.uint8)

  train, held_out = stdlib_split(stdlib_dir)
  return read(train), read(held_out)
