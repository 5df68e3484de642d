"""A small flash-style attention kernel: keys in blocks, an online softmax
with a running max, FP32 accumulation, and the probabilities rounded to
the input format before they multiply V (as FlashAttention-2 does)."""

import jax
import jax.numpy as jnp

BLOCK = 64


def attention(q, k, v, *, causal=False):
  """q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, heads,
  head_dim]; kv_len a multiple of BLOCK."""
  batch, q_len, heads, head_dim = q.shape
  kv_len = k.shape[1]
  if kv_len % BLOCK:
    raise ValueError(f"kv_len {kv_len} must be a multiple of {BLOCK}")
  scale = head_dim**-0.5
  qf = q.astype(jnp.float32) * scale
  blocks = kv_len // BLOCK
  kb = k.reshape(batch, blocks, BLOCK, heads, head_dim).swapaxes(0, 1)
  vb = v.reshape(batch, blocks, BLOCK, heads, head_dim).swapaxes(0, 1)
  rows = jnp.arange(q_len)[:, None] + (kv_len - q_len)

  def step(carry, block):
    acc, row_max, row_sum = carry
    index, k_block, v_block = block
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, k_block.astype(jnp.float32))
    if causal:
      cols = index * BLOCK + jnp.arange(BLOCK)[None, :]
      s = jnp.where(cols <= rows, s, -jnp.inf)
    new_max = jnp.maximum(row_max, s.max(-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.exp(s - safe_max[..., None])
    rescale = jnp.exp(row_max - safe_max)
    row_sum = row_sum * rescale + p.sum(-1)
    pv = jnp.einsum(
      "bhqk,bkhd->bhqd",
      p.astype(q.dtype),
      v_block,
      preferred_element_type=jnp.float32,
    )
    acc = acc * rescale[..., None] + pv
    return (acc, new_max, row_sum), None

  init = (
    jnp.zeros((batch, heads, q_len, head_dim), jnp.float32),
    jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32),
    jnp.zeros((batch, heads, q_len), jnp.float32),
  )
  (acc, _, row_sum), _ = jax.lax.scan(step, init, (jnp.arange(blocks), kb, vb))
  out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
  return out.swapaxes(1, 2).astype(q.dtype)
