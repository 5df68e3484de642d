"""The JAX ecosystem's attention kernels on the registry's contract.

Each function takes q [batch, q_len, heads, head_dim] and k, v [batch,
kv_len, kv_heads, head_dim] with the contract's feature names, and runs
the kernel as its own project's CPU tests run it: Pallas interpret mode
off the hardware it was written for (TPU interpret mode for the Mosaic
kernels). Where a kernel lacks an argument the contract has, the wrapper
does what its users do, and says so:

* splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`,
  MaxText's kernel) has no scale argument: q is multiplied by
  1/sqrt(head_dim) in its own format first, as MaxText does. GQA runs its
  MQA kernel per KV head over that head's group of queries.
* TPU flash attention (`pallas.ops.tpu.flash_attention`) takes equal head
  counts: GQA's K and V heads are repeated.
* the GPU decode and paged kernels take one query per sequence, and
  lengths that are whole blocks or pages: the cache is padded past its
  valid length (the kernels' `kv_seq_len`/`lengths` mask the padding), and
  the paged kernel reads the keys through a shuffled page table.
* vLLM's ragged paged attention (`pallas.ops.tpu.ragged_paged_attention`)
  takes every sequence's queries concatenated and its cache in pages of K
  and V heads side by side.

Each module is imported on use: jax marks several of them deprecated or
experimental, and importing the registry should not warn.
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

DECODE_BLOCK_K = 64
PAGE_SIZE = 16
PAGES_PER_COMPUTE_BLOCK = 4
SPLASH_BLOCK = 128  # splash's default tiles; its KV tile must be a multiple


def _off(platform: str) -> bool:
  """Interpret mode: the kernel's platform is not this machine's."""
  return jax.default_backend() != platform


def _bhsd(x):
  return jnp.swapaxes(x, 1, 2)


def _scaled(q):
  """q / sqrt(head_dim) in q's own format (for kernels with no scale)."""
  return (q * q.shape[-1] ** -0.5).astype(q.dtype)


def _segment_pair(segment_ids):
  """(q ids [batch, q_len], kv ids [batch, kv_len]) of the contract's
  segment ids (one array for self-attention, or the pair)."""
  if isinstance(segment_ids, (tuple, list)):
    return tuple(jnp.asarray(s, jnp.int32) for s in segment_ids)
  ids = jnp.asarray(segment_ids, jnp.int32)
  return ids, ids


def _splash_mask(mask_lib, q_len, kv_len, causal, local_window_size):
  from stableattn.contract.features import check_window

  window = check_window(local_window_size)
  shape = (q_len, kv_len)
  if window is None:
    return mask_lib.CausalMask(shape) if causal else mask_lib.FullMask(shape)
  left, right = window
  if causal:
    right = 0 if right is None else min(right, 0)
  return mask_lib.LocalMask(shape, window_size=(left, right), offset=0)


def splash(
  q,
  k,
  v,
  *,
  causal: bool = False,
  local_window_size=None,
  segment_ids=None,
  softcap: float | None = None,
  sink=None,
):
  """jax's splash attention: masks for causal, a local window and segment
  ids, a logit soft cap and a sink logit per head."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_lib,
  )
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as mask_lib,
  )

  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = heads // kv_heads
  mask = _splash_mask(mask_lib, q_len, kv_len, causal, local_window_size)
  block_q = min(SPLASH_BLOCK, q_len)
  blocks = splash_lib.BlockSizes(
    block_q=block_q, block_kv=SPLASH_BLOCK, block_kv_compute=SPLASH_BLOCK,
    block_q_dkv=block_q, block_kv_dkv=SPLASH_BLOCK,
    block_kv_dkv_compute=SPLASH_BLOCK, block_q_dq=block_q,
    block_kv_dq=SPLASH_BLOCK,
  )  # fmt: skip
  make = (
    splash_lib.make_splash_mha if group == 1 else splash_lib.make_splash_mqa
  )
  kernel = make(
    mask_lib.MultiHeadMask([mask] * (heads if group == 1 else group)),
    block_sizes=blocks,
    head_shards=1,
    q_seq_shards=1,
    attn_logits_soft_cap=softcap,
    interpret=_off("tpu"),
  )
  ids = None
  if segment_ids is not None:
    ids = splash_lib.SegmentIds(*_segment_pair(segment_ids))
  qh = _bhsd(_scaled(q)).reshape(batch, kv_heads, group, q_len, head_dim)
  sinks = None if sink is None else jnp.asarray(sink).reshape(kv_heads, group)

  def one_example(q, k, v, ids):
    if group == 1:
      return kernel(q[:, 0], k, v, segment_ids=ids, sinks=sink)
    # MQA per KV head: its group of query heads over its one key head.
    per_head = jax.vmap(
      lambda q, k, v, s: kernel(q, k, v, segment_ids=ids, sinks=s),
      in_axes=(0, 0, 0, None if sinks is None else 0),
    )
    return per_head(q, k, v, sinks)

  out = jax.vmap(one_example)(qh, _bhsd(k), _bhsd(v), ids)
  return _bhsd(out.reshape(batch, heads, q_len, v.shape[-1]))


def _tpu_interpret_mode():
  """TPU interpret mode off a TPU (a context), nothing on one."""
  if not _off("tpu"):
    return contextlib.nullcontext()
  from jax.experimental.pallas import tpu as pltpu

  return pltpu.force_tpu_interpret_mode()


def _tpu_interpreted(fn):
  """fn, forward and backward, in TPU interpret mode off a TPU: the mode
  is a context, and a VJP's backward runs after the forward's context has
  closed, so both are wrapped."""
  if not _off("tpu"):
    return fn

  @jax.custom_vjp
  def run(*args):
    with _tpu_interpret_mode():
      return fn(*args)

  def forward(*args):
    with _tpu_interpret_mode():
      return jax.vjp(fn, *args)

  def backward(vjp, d_out):
    with _tpu_interpret_mode():
      return vjp(d_out)

  run.defvjp(forward, backward)
  return run


def tpu_flash(q, k, v, *, causal: bool = False, segment_ids=None):
  """jax's TPU flash attention (`pallas.ops.tpu.flash_attention`)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_lib

  group = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
  q_block, kv_block = min(128, q.shape[1]), min(128, k.shape[1])
  blocks = tpu_lib.BlockSizes(
    block_q=q_block, block_k_major=kv_block, block_k=kv_block, block_b=1,
    block_q_major_dkv=q_block, block_k_major_dkv=kv_block,
    block_k_dkv=kv_block, block_q_dkv=q_block, block_k_major_dq=kv_block,
    block_k_dq=kv_block, block_q_dq=q_block,
  )  # fmt: skip
  ids = None
  if segment_ids is not None:
    ids = tpu_lib.SegmentIds(*_segment_pair(segment_ids))

  def attend(q, k, v):
    return tpu_lib.flash_attention(
      q, k, v, segment_ids=ids, causal=causal,
      sm_scale=q.shape[-1] ** -0.5, block_sizes=blocks,
    )  # fmt: skip

  return _bhsd(_tpu_interpreted(attend)(_bhsd(q), _bhsd(k), _bhsd(v)))


def _one_query(q, kernel: str) -> None:
  if q.shape[1] != 1:
    raise ValueError(
      f"jax's {kernel} kernel takes one query per sequence (q_len 1), got "
      f"q_len {q.shape[1]}; audit it at decode shapes, e.g. "
      "--config=decode."
    )


def _lengths(key_value_seq_lengths, batch: int, kv_len: int):
  if key_value_seq_lengths is None:
    return jnp.full((batch,), kv_len, jnp.int32)
  return jnp.asarray(key_value_seq_lengths, jnp.int32)


def _padded(x, length: int):
  """x [batch, kv_len, ...] with zero keys appended to `length`."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, length - x.shape[1])
  return jnp.pad(x, pad)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def decode(q, k, v, *, key_value_seq_lengths=None):
  """jax's GPU split-KV decode kernel (`pallas.ops.gpu.decode_attention`
  `gqa`): one query per sequence over a cache of valid lengths."""
  from jax.experimental.pallas.ops.gpu import decode_attention

  _one_query(q, "decode")
  batch, kv_len = q.shape[0], k.shape[1]
  splits = int(np.clip(kv_len // 256, 1, 16))
  padded = _round_up(kv_len, splits * DECODE_BLOCK_K)
  out = decode_attention.gqa(
    q[:, 0],
    _padded(k, padded),
    _padded(v, padded),
    kv_seq_len=_lengths(key_value_seq_lengths, batch, kv_len),
    sm_scale=q.shape[-1] ** -0.5,
    block_k=DECODE_BLOCK_K,
    k_splits=splits,
    interpret=_off("gpu"),
  )
  return out[:, None]


def _pages(k, v, pages_per_sequence: int):
  """(k_pages, v_pages [pages, PAGE_SIZE, kv_heads, head_dim], the page
  table [batch, pages_per_sequence]): each sequence's keys in a shuffled
  pool, so a kernel that ignored the table would read other keys."""
  batch, _, kv_heads, _ = k.shape
  total = batch * pages_per_sequence
  where = np.random.default_rng(0).permutation(total)  # page i -> pool slot

  def pool(x):
    x = _padded(x, pages_per_sequence * PAGE_SIZE)
    pages = x.reshape(total, PAGE_SIZE, kv_heads, x.shape[-1])
    return jnp.zeros_like(pages).at[where].set(pages)

  table = jnp.asarray(where.reshape(batch, pages_per_sequence), jnp.int32)
  return pool(k), pool(v), table


def paged(q, k, v, *, key_value_seq_lengths=None, softcap=None):
  """jax's GPU paged attention (`pallas.ops.gpu.paged_attention`): one
  query per sequence over K and V pages found through a page table."""
  from jax.experimental.pallas.ops.gpu import paged_attention

  _one_query(q, "paged")
  batch, kv_len = q.shape[0], k.shape[1]
  pages = -(-kv_len // PAGE_SIZE)
  splits = 2 if pages > 2 * PAGES_PER_COMPUTE_BLOCK else 1
  per_sequence = _round_up(pages, splits * min(pages, PAGES_PER_COMPUTE_BLOCK))
  k_pages, v_pages, table = _pages(k, v, per_sequence)
  out = paged_attention.paged_attention(
    _scaled(q[:, 0]),  # like splash, the kernel takes no scale
    k_pages.transpose(2, 0, 1, 3),  # [kv_heads, pages, PAGE_SIZE, d]
    v_pages.transpose(2, 0, 1, 3),
    table,
    _lengths(key_value_seq_lengths, batch, kv_len),
    block_h=16,
    pages_per_compute_block=PAGES_PER_COMPUTE_BLOCK,
    k_splits=splits,
    attn_logits_soft_cap=softcap,
    interpret=_off("gpu"),
  )
  return out[:, None]


def ragged_paged(q, k, v, *, key_value_seq_lengths=None, causal=False):
  """vLLM's TPU ragged paged attention. Its queries are the last q_len
  positions of each sequence's keys (causal over them): the contract's
  causal self-attention, or one query over every key."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel

  batch, q_len, heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  if (q_len, causal) != (1, False) and (q_len != kv_len or not causal):
    raise ValueError(
      "ragged paged attention takes causal self-attention (q_len == "
      "kv_len, features 'causal') or one query over every key; got "
      f"q_len {q_len}, kv_len {kv_len}, causal {causal}."
    )
  k_pages, v_pages, table = _pages(k, v, -(-kv_len // PAGE_SIZE))
  # K and V heads side by side, interleaved: [pages, page, 2 kv_heads, d].
  kv_pages = jnp.stack([k_pages, v_pages], axis=3).reshape(
    *k_pages.shape[:2], 2 * kv_heads, head_dim
  )
  with _tpu_interpret_mode():  # it has no VJP to run later
    out = kernel.ragged_paged_attention(
      q.reshape(batch * q_len, heads, head_dim),
      kv_pages,
      _lengths(key_value_seq_lengths, batch, kv_len),
      table,
      jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
      jnp.array([batch], jnp.int32),
      sm_scale=head_dim**-0.5,
      # Explicit tiles: its tuned table reads the TPU's version.
      num_kv_pages_per_block=min(table.shape[1], PAGES_PER_COMPUTE_BLOCK),
      num_queries_per_block=min(q_len, 16),
    )
  return out.reshape(batch, q_len, heads, head_dim)


@functools.cache
def ragged_paged_unavailable() -> str | None:
  """Why ragged paged attention cannot run here (None: it can): off a
  TPU, whether TPU interpret mode runs one small case."""
  if not _off("tpu"):
    return None
  q = jnp.zeros((1, 16, 1, 128), jnp.float32)
  try:
    ragged_paged(q, q, q, causal=True)
  except Exception as e:  # noqa: BLE001 - the reason is the answer
    text = str(e).strip().splitlines()
    return (
      f"it needs a TPU: TPU interpret mode fails on it with jax "
      f"{jax.__version__} ({type(e).__name__}: {text[-1] if text else ''})"
    )
  return None


KERAS_INSTALL = "pip install 'stableattn[peers]' (or pip install keras)"


def _keras():
  """keras on its JAX backend, or a ValueError saying how to get it."""
  os.environ.setdefault("KERAS_BACKEND", "jax")
  try:
    import keras
  except ImportError as e:
    raise ValueError(
      f"keras is not installed: {KERAS_INSTALL} to audit its kernel ({e})."
    ) from e
  if keras.backend.backend() != "jax":
    raise ValueError(
      f"keras runs on its {keras.backend.backend()!r} backend here; set "
      "KERAS_BACKEND=jax before keras is first imported to audit it."
    )
  return keras


def keras_dpa(
  q, k, v, *, causal=False, bias=None, mask=None, scale=None, softcap=None
):
  """Keras's `ops.dot_product_attention` on the JAX backend (same layout
  as ours); the soft cap is its `attn_logits_soft_cap`."""
  keras = _keras()
  return keras.ops.dot_product_attention(
    q, k, v, bias=bias, mask=mask, scale=scale, is_causal=causal,
    attn_logits_soft_cap=softcap,
  )  # fmt: skip
