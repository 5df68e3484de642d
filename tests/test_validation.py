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
    (Q, KV, jnp.ones((1, 8, 2, 8)), r"same shape.*\(1, 8, 2, 8\)"),
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
  with pytest.raises(
    ValueError,
    match=r"block_k=48 cannot be compiled for a "
    r"GPU.*powers of two",
  ):
    sa.attention(Q, KV, KV, precision="bf16-fa2", block_k=48, interpret=False)


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
