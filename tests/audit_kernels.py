"""Attention kernels with known defects, on the audit's calling contract
(imported by the audit as "audit_kernels:NAME")."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import stableattn as sa


def correct(q, k, v, *, causal=False):
  out = sa.attention(
    q, k, v, implementation="reference", precision="fp32", causal=causal
  )
  return out.astype(q.dtype)


def wrong_scale(q, k, v, *, causal=False):
  """The classic bug: scores scaled by 1/d instead of 1/sqrt(d)."""
  return correct(q * q.shape[-1] ** -0.5, k, v, causal=causal)


def _wrong_gradient_fwd(q, k, v, causal):
  out, vjp = jax.vjp(lambda q, k, v: correct(q, k, v, causal=causal), q, k, v)
  return out, vjp


def _wrong_gradient_bwd(causal, vjp, d_out):
  del causal
  return tuple(1.5 * g for g in vjp(d_out))  # a right forward, 1.5x grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _wrong_gradient(q, k, v, causal):
  return correct(q, k, v, causal=causal)


_wrong_gradient.defvjp(_wrong_gradient_fwd, _wrong_gradient_bwd)


def wrong_gradient(q, k, v, *, causal=False):
  return _wrong_gradient(q, k, v, causal)


def nondeterministic(q, k, v, *, causal=False):
  """A few FP32 ulps of run-to-run noise, as from atomics' order."""
  out = correct(q, k, v, causal=causal).astype(jnp.float32)
  noise = jax.pure_callback(
    lambda: (
      np.random.default_rng().uniform(-2, 2, out.shape).astype(np.float32)
    ),
    jax.ShapeDtypeStruct(out.shape, jnp.float32),
  )
  ulp = jnp.abs(out) * jnp.float32(2.0**-23)
  return (out + jax.lax.stop_gradient(noise * ulp)).astype(q.dtype)


def nan_rows(q, k, v, *, causal=False):
  """NaN in the last query row (as a fully masked row can give)."""
  out = correct(q, k, v, causal=causal)
  return out.at[:, -1].set(jnp.nan)


def wrong_shape(q, k, v, *, causal=False):
  return correct(q, k, v, causal=causal)[..., :8]


def no_causal_argument(q, k, v):
  return correct(q, k, v)


def integer_output(q, k, v, *, causal=False):
  return correct(q, k, v, causal=causal).astype(jnp.int32)


def jax_windowed(q, k, v, *, causal=False, local_window_size=None):
  """jax.nn.dot_product_attention with its own sliding window."""
  return jax.nn.dot_product_attention(
    q, k, v, is_causal=causal, local_window_size=local_window_size
  )


def ignores_window(q, k, v, *, causal=False, local_window_size=None):
  """Takes the window and drops it: full causal attention."""
  del local_window_size
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


def jax_segments(q, k, v, *, causal=False, segment_ids=None):
  """Packed sequences through jax.nn.dot_product_attention's mask."""
  q_ids, kv_ids = segment_ids
  mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, mask=mask)


def split_by_batch(
  q,
  k,
  v,
  *,
  causal=False,
  causal_alignment="top_left",
  key_value_seq_lengths=None,
):
  """Split-KV with a split count from the batch size, as a launch heuristic
  that fills the GPU picks it: more splits for fewer rows (one at batch
  64 and up). The arithmetic is right; a row's bits depend on its batch."""
  splits = max(1, 8 // max(1, q.shape[0] // 8))
  return sa.attention(
    q,
    k,
    v,
    precision="bf16-fa2",
    num_splits=splits,
    causal=causal,
    causal_alignment=causal_alignment,
    key_value_seq_lengths=key_value_seq_lengths,
  ).astype(q.dtype)


def decode_differs(
  q,
  k,
  v,
  *,
  causal=False,
  causal_alignment="top_left",
  key_value_seq_lengths=None,
):
  """A separate decode path: one query splits its keys in four, as
  flash-decoding does, while prefill runs one pass."""
  return sa.attention(
    q,
    k,
    v,
    precision="bf16-fa2",
    num_splits=4 if q.shape[1] == 1 else None,
    causal=causal,
    causal_alignment=causal_alignment,
    key_value_seq_lengths=key_value_seq_lengths,
  ).astype(q.dtype)


def raises_on_causal(q, k, v, *, causal=False):
  """A kernel that cannot mask (Keras's soft cap off a TPU, say): it
  raises on the causal cases and is right on the others."""
  if causal:
    raise NotImplementedError("causal masking is not implemented here")
  return correct(q, k, v)


def raises_on_bf16(q, k, v, *, causal=False):
  """A kernel that takes no BF16 inputs and raises a TypeError on them."""
  if q.dtype == jnp.bfloat16:
    raise TypeError(f"unsupported input dtype {q.dtype}")
  return correct(q, k, v, causal=causal)


def no_vjp(q, k, v, *, causal=False):
  """A right forward outside JAX's tracing (a host callback): no VJP, as
  decode kernels have none."""
  out = jax.ShapeDtypeStruct(q.shape, q.dtype)

  def host(q, k, v):
    return np.asarray(correct(q, k, v, causal=causal))

  return jax.pure_callback(host, out, q, k, v)


def bhsd_correct(q, k, v, *, causal=False):
  """`correct` in torch's layout, [batch, heads, length, head_dim]."""
  swap = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
  return swap(correct(swap(q), swap(k), swap(v), causal=causal))


def scales_q_and_k(q, k, v, *, causal=False):
  """Eager FP32 attention as PyTorch's math path computes it: q and k
  each times sqrt(scale), so its logits sit an ulp from others'."""
  root = q.shape[-1] ** -0.25
  return jax.nn.dot_product_attention(
    q * root, k * root, v, is_causal=causal, scale=1.0
  )
