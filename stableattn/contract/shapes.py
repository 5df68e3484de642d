"""The shapes every attention call takes: q, k, v as [batch, length, heads,
head_dim], checked once for every implementation and the golden value."""

import jax.numpy as jnp


def check_shapes(q, k, v) -> None:
  """Raises a ValueError saying what is wrong with q, k, v (any arrays)."""
  arrays = {"q": q, "k": k, "v": v}
  for name, x in arrays.items():
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 4:
      raise ValueError(
        f"{name} must be a rank-4 array [batch, seq, heads, head_dim], got "
        f"shape {shape}."
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(
        f"{name} must have a floating dtype (float16, bfloat16, float32, "
        f"float64), got {x.dtype}."
      )
    if min(shape) <= 0:
      raise ValueError(f"{name} has an empty dimension: shape {shape}.")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(
      f"k and v must agree in [batch, kv_len, kv_heads] (their head dims "
      f"may differ, as MLA's 192/128), got k {k.shape} and v {v.shape}."
    )
  if q.shape[0] != k.shape[0]:
    raise ValueError(
      f"q and k/v batch sizes differ: q batch {q.shape[0]}, k/v batch "
      f"{k.shape[0]}."
    )
  if q.shape[3] != k.shape[3]:
    raise ValueError(
      f"q and k/v head dims differ: q head_dim {q.shape[3]}, k/v head_dim "
      f"{k.shape[3]}."
    )
  heads, kv_heads = q.shape[2], k.shape[2]
  if heads % kv_heads != 0:
    raise ValueError(
      f"kv_heads must divide heads (GQA/MQA): got {heads} query heads and "
      f"{kv_heads} key/value heads; valid kv_heads are "
      f"{[n for n in range(1, heads + 1) if heads % n == 0]}."
    )
