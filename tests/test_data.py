import numpy as np
import pytest

from stableattn.training import data


def test_generated_corpus_is_deterministic_and_structured():
  a = data.generate_corpus(20_000, seed=3)
  b = data.generate_corpus(20_000, seed=3)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, data.generate_corpus(20_000, seed=4))
  text = bytes(a.astype(np.uint8)).decode()
  assert text.count("<") > 5 and text.count("=") > 5  # copy spans
  assert a.max() < data.BYTE_VOCAB


def test_batches_depend_only_on_seed_step_and_replicate():
  tokens = data.generate_corpus(5_000, seed=0)
  a = data.batch_at(tokens, seed=1, step=7, batch_size=4, seq_len=16)
  b = data.batch_at(tokens, seed=1, step=7, batch_size=4, seq_len=16)
  np.testing.assert_array_equal(a, b)
  assert a.shape == (4, 17) and a.dtype == np.int32
  c = data.batch_at(tokens, seed=1, step=8, batch_size=4, seq_len=16)
  assert not np.array_equal(a, c)
  other = dict(seed=1, step=7, batch_size=4, seq_len=16, replicate=1)
  d = data.batch_at(tokens, **other)
  assert not np.array_equal(a, d)
  np.testing.assert_array_equal(d, data.batch_at(tokens, **other))
  with pytest.raises(ValueError, match="replicate must be >= 0"):
    data.batch_at(tokens, **{**other, "replicate": -1})


def test_loaders(tmp_path):
  ids = np.arange(100, dtype=np.int64) % 50
  np.save(tmp_path / "t.npy", ids)
  np.testing.assert_array_equal(data.load_tokens(tmp_path / "t.npy", 50), ids)
  ids.astype(np.uint16).tofile(tmp_path / "t.bin")
  np.testing.assert_array_equal(data.load_tokens(tmp_path / "t.bin", 50), ids)
  (tmp_path / "t.txt").write_text("hello")
  assert list(data.load_tokens(tmp_path / "t.txt", 256)) == list(b"hello")


@pytest.mark.parametrize(
  "name, content, message",
  [
    ("missing.npy", None, "does not exist"),
    ("odd.bin", b"\x01\x02\x03", "whole number of uint16"),
    ("empty.txt", b"", "no tokens"),
    (
      "big.bin",
      np.asarray([1, 300], np.uint16).tobytes(),
      r"token ids in \[1, 300\].*\[0, 256\)",
    ),
  ],
)
def test_loader_errors(tmp_path, name, content, message):
  path = tmp_path / name
  if content is not None:
    path.write_bytes(content)
  with pytest.raises(ValueError, match=message):
    data.load_tokens(path, 256)


def test_float_npy_is_rejected(tmp_path):
  np.save(tmp_path / "f.npy", np.ones(10))
  with pytest.raises(ValueError, match="must be integers"):
    data.load_tokens(tmp_path / "f.npy", 256)


def test_sequence_longer_than_data():
  with pytest.raises(ValueError, match="fewer than seq_len"):
    data.batch_at(
      np.zeros(10, np.int32), seed=0, step=0, batch_size=1, seq_len=10
    )


def test_stdlib_corpus_is_fixed_disjoint_and_local(monkeypatch):
  import socket

  def no_network(*args, **kwargs):
    raise AssertionError("the corpus must not touch the network")

  monkeypatch.setattr(socket, "socket", no_network)
  monkeypatch.setattr(socket, "create_connection", no_network)
  train, held_out = data.stdlib_split()
  again = data.stdlib_split()
  assert (train, held_out) == again  # the same files, in the same order
  assert not set(train) & set(held_out)
  assert len(held_out) >= len(data.STDLIB_FILES) // data.HELD_OUT_EVERY - 1
  train_tokens, held_out_tokens = data.stdlib_corpus()
  assert train_tokens.dtype == np.uint8 and train_tokens.size > 1_000_000
  assert held_out_tokens.size > 100_000
  assert bytes(train_tokens[:1000]) in b"".join(p.read_bytes() for p in train)


def test_stdlib_corpus_refuses_a_directory_that_is_not_one(tmp_path):
  (tmp_path / "ast.py").write_text("x = 1\n")
  with pytest.raises(ValueError, match="point data.path at your own corpus"):
    data.stdlib_split(tmp_path)
