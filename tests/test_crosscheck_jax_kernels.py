"""Our kernel against jax's own Pallas attention kernels (interpret mode)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_qkv
from jax.experimental.pallas.ops.gpu import attention as jax_gpu_attention

import stableattn as sa


@pytest.mark.parametrize("causal", [False, True])
def test_fp32_matches_jax_pallas_mha_values_and_gradients(causal):
  q, k, v = random_qkv(21, batch=2, q_len=128, heads=2, kv_heads=2, head_dim=32)
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  d_out = jnp.asarray(
    np.random.default_rng(22).standard_normal(q.shape), jnp.float32
  )
  block_sizes = jax_gpu_attention.BlockSizes(
    block_q=64,
    block_k=32,
    block_q_dkv=32,
    block_kv_dkv=32,
    block_q_dq=32,
    block_kv_dq=32,
  )
  theirs_fn = functools.partial(
    jax_gpu_attention.mha,
    segment_ids=None,
    sm_scale=32**-0.5,
    causal=causal,
    block_sizes=block_sizes,
    interpret=True,
  )
  ours_fn = functools.partial(
    sa.attention, precision="fp32", block_q=64, block_k=32, causal=causal
  )
  ours, ours_vjp = jax.vjp(ours_fn, q, k, v)
  ours_grads = ours_vjp(d_out)
  # jax's causal kernel mixes int32 and int64 indices under 64-bit mode.
  with jax.enable_x64(False):
    theirs, theirs_vjp = jax.vjp(theirs_fn, q, k, v)
    theirs_grads = theirs_vjp(d_out)
  # jax's kernel multiplies f32 tiles at default precision; on the CPU that
  # is full FP32, so both are FP32 computations in a different order.
  assert sa.compare(theirs, ours).max_abs <= 1e-5
  for ours_g, theirs_g in zip(ours_grads, theirs_grads):
    assert sa.compare(theirs_g, ours_g).rel_l2 <= 1e-4
