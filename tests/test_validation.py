"""Every bad input gets a ValueError naming what was wrong and what is valid."""

import jax.numpy as jnp
import numpy as np
import pytest

import stableattn as sa

Q = jnp.ones((1, 8, 4, 16), jnp.float32)
KV = jnp.ones((1, 8, 2, 16), jnp.float32)


@pytest.mark.parametrize("implementation", sa.IMPLEMENTATIONS)
@pytest.mark.parametrize(
  "q, k, v, message",
  [
    (jnp.ones((8, 4, 16)), KV, KV, r"rank-4.*\(8, 4, 16\)"),
    (Q, jnp.ones((1, 8, 2)), KV, r"k must be a rank-4"),
    (
      Q,
      KV,
      jnp.ones((1, 6, 2, 16)),
      r"agree in \[batch, kv_len, kv_heads\].*\(1, 6, 2, 16\)",
    ),
    (
      Q,
      jnp.ones((2, 8, 2, 16)),
      jnp.ones((2, 8, 2, 16)),
      r"batch sizes differ: q batch 1, k/v batch 2",
    ),
    (
      Q,
      jnp.ones((1, 8, 2, 8)),
      jnp.ones((1, 8, 2, 8)),
      r"head dims differ: q head_dim 16, k/v head_dim 8",
    ),
    (
      Q,
      jnp.ones((1, 8, 3, 16)),
      jnp.ones((1, 8, 3, 16)),
      r"kv_heads must divide heads.*4 query heads and 3.*\[1, 2, 4\]",
    ),
    (Q.astype(jnp.int32), KV, KV, r"floating dtype.*int32"),
    (Q[:, :0], KV, KV, r"empty dimension"),
  ],
)
def test_bad_arrays(implementation, q, k, v, message):
  with pytest.raises(ValueError, match=message):
    sa.attention(q, k, v, implementation=implementation, precision="fp32")


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(implementation="cuda"), r"implementation 'cuda'.*'pallas'"),
    (dict(precision="fp8"), r"Unknown precision preset 'fp8'.*bf16-fa2"),
    (dict(scheme="fa3"), r"scheme 'fa3'.*\['fa2', 'fa1'\]"),
    (dict(block_q=0), r"block_q must be a positive integer, got 0"),
    (dict(block_k=-16), r"block_k must be a positive integer, got -16"),
    (dict(block_q=12.5), r"block_q must be a positive integer"),
    (dict(bwd_block_k=0), r"bwd_block_k must be a positive integer"),
  ],
)
@pytest.mark.parametrize("implementation", sa.IMPLEMENTATIONS)
def test_bad_options(kwargs, message, implementation):
  kwargs = {"implementation": implementation, "precision": "fp32", **kwargs}
  with pytest.raises(ValueError, match=message):
    sa.attention(Q, KV, KV, **kwargs)


def test_non_power_of_two_tile_for_gpu_raises_our_error():
  # 64 keys: a 48-key tile is not clamped (only tiles past the sequence are).
  q, kv = jnp.ones((1, 64, 4, 16)), jnp.ones((1, 64, 2, 16))
  with pytest.raises(
    ValueError,
    match=r"block_k=48 cannot be compiled for a "
    r"GPU.*powers of two",
  ):
    sa.attention(q, kv, kv, precision="bf16-fa2", block_k=48, interpret=False)


def test_fp64_for_gpu_raises_our_error():
  with pytest.raises(ValueError, match=r"FP64.*interpret=True"):
    sa.attention(Q, KV, KV, precision="fp64", interpret=False)


def test_return_lse_only_for_pallas():
  with pytest.raises(ValueError, match="only available for 'pallas'"):
    sa.attention(Q, KV, KV, implementation="reference", return_lse=True)


def test_numpy_inputs_are_accepted():
  out = sa.attention(
    np.ones((1, 8, 2, 16)),
    np.ones((1, 8, 2, 16)),
    np.ones((1, 8, 2, 16)),
    precision="fp32",
    implementation="reference",
  )
  assert out.shape == (1, 8, 2, 16) and out.dtype == jnp.float32


@pytest.mark.parametrize("name", ["causal", "interpret", "return_lse"])
@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_flags_are_booleans_not_strings_or_numbers(name, value):
  if name == "interpret" and value is None:
    return  # None means: interpret iff on the CPU
  with pytest.raises(ValueError, match=f"{name} must be True or False"):
    sa.attention(Q, KV, KV, **{name: value})


def test_numpy_flags_and_integers_are_accepted():
  q = np.random.default_rng(0).standard_normal((1, 40, 2, 16))
  kv = np.random.default_rng(1).standard_normal((1, 40, 1, 16))
  args = (q.astype(np.float32), kv.astype(np.float32), kv.astype(np.float32))
  plain = sa.attention(*args, precision="fp32", block_q=16, causal=True)
  numpy = sa.attention(
    *args, precision="fp32", block_q=np.int64(16), causal=np.bool_(True)
  )
  assert np.array_equal(np.asarray(plain), np.asarray(numpy))


def test_tiles_longer_than_the_sequence_are_clamped():
  q = np.random.default_rng(2).standard_normal((1, 40, 2, 16))
  args = tuple(q.astype(np.float32) for _ in range(3))
  # 10**9 rows would be 640 GB of padding; clamped to 64 (covers 40) it is
  # the same computation as the 64-row tile.
  huge = sa.attention(*args, precision="fp32", block_q=10**9, block_k=10**9)
  tile = sa.attention(*args, precision="fp32", block_q=64, block_k=64)
  assert np.array_equal(np.asarray(huge), np.asarray(tile))


def test_golden_attention_validates_like_attention():
  q = np.ones((1, 8, 4, 16))
  kv = np.ones((1, 8, 3, 16))
  with pytest.raises(ValueError, match="kv_heads must divide heads"):
    sa.golden_attention(q, kv, kv)
  with pytest.raises(ValueError, match="causal must be True or False"):
    sa.golden_attention(q, q[:, :, :2], q[:, :, :2], causal="no")
  with pytest.raises(ValueError, match="d_out must be shaped like the output"):
    sa.golden_attention_vjp(q, q, q, q[:, :4])


def test_readme_check_example_warns_nothing_with_x64_off():
  import subprocess
  import sys

  code = (
    "import warnings; warnings.simplefilter('error');"
    "import stableattn as sa;"
    "f = lambda q, k, v: sa.attention(q, k, v, precision='bf16-fa2',"
    " block_q=16, block_k=16);"
    "r = sa.check(f, precision='bf16-fa2', shapes=[(1, 32, 2, 16)]);"
    "assert r.passed, r"
  )
  subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_empty_workdir_is_refused():
  from stableattn.harness.rundir import RunDir

  with pytest.raises(ValueError, match="workdir is empty"):
    RunDir("")
