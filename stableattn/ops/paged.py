"""Attention over a paged KV cache (vLLM's and FlashInfer's layout).

The keys and values of every sequence live in one pool of fixed-size pages
[num_pages, page_size, kv_heads, head_dim]; a page table [batch,
pages_per_sequence] lists, per sequence, which pool page holds its keys
0..page_size-1, page_size..2 page_size-1, and so on. The sequence a query
sees is its pages in table order, `pages_per_sequence * page_size` keys,
of which `key_value_seq_lengths` are valid (the rest of the last page is
padding). Our kernel reads the pages where they lie, through the table;
every other implementation gets the same keys gathered into one
contiguous cache (`gather_pages`), so all compute the same function.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from stableattn.contract.features import Features
from stableattn.contract.options import Options
from stableattn.contract.tiling import check_flag
from stableattn.kernels.flash_attention import (
  pad_operands,
  pad_to,
  padded_head_dim,
  tile_ranges,
)
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.kernels.pallas_forward import flash_forward
from stableattn.kernels.quantization import stored_inputs
from stableattn.numerics.precision import require_x64_if_needed
from stableattn.ops import dispatch
from stableattn.ops.flash_choice import record_taken


def check_pages(k_pages, v_pages, page_table) -> None:
  """Raises a ValueError saying what is wrong with a paged cache."""
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 4:
      raise ValueError(
        f"{name} must be a rank-4 page pool [num_pages, page_size, "
        f"kv_heads, head_dim], got shape {shape}."
      )
  if k_pages.shape != v_pages.shape:
    raise ValueError(
      f"k_pages and v_pages must have the same shape, got {k_pages.shape} "
      f"and {v_pages.shape}."
    )
  shape = getattr(page_table, "shape", None)
  if shape is None or len(shape) != 2 or min(shape) <= 0:
    raise ValueError(
      f"page_table must be an integer array [batch, pages_per_sequence], "
      f"got shape {shape}."
    )
  if not np.issubdtype(np.dtype(page_table.dtype), np.integer):
    raise ValueError(
      f"page_table must have an integer dtype, got {page_table.dtype}."
    )
  try:
    entries = np.asarray(page_table)
  except Exception:  # a tracer: values unknown until run time
    return
  num_pages = k_pages.shape[0]
  if entries.min() < 0 or entries.max() >= num_pages:
    raise ValueError(
      f"page_table entries must be pool pages in [0, {num_pages}), got "
      f"values from {entries.min()} to {entries.max()}."
    )


def gather_pages(pages, page_table):
  """The contiguous cache [batch, pages_per_sequence * page_size, kv_heads,
  head_dim] that a page table describes."""
  pages = jnp.asarray(pages)
  gathered = pages[jnp.asarray(page_table)]  # [B, P, page, Hkv, D]
  batch, per_sequence, page_size = gathered.shape[:3]
  return gathered.reshape(batch, per_sequence * page_size, *pages.shape[2:])


def paged_attention(
  q,
  k_pages,
  v_pages,
  page_table,
  *,
  implementation: str = "pallas",
  options: Options | None = None,
  features: Features | None = None,
  return_lse: bool = False,
  **keywords,
):
  """Attention of q [batch, q_len, heads, head_dim] over a paged cache.

  Args:
    k_pages, v_pages: the page pool [num_pages, page_size, kv_heads,
      head_dim].
    page_table: int [batch, pages_per_sequence]: pool pages per sequence.
    implementation, options, features, return_lse, **keywords: as
      `stableattn.attention`; the keys a query sees are its pages in table
      order (`key_value_seq_lengths` marks the valid ones). "pallas", and
      "flash" on any device, read the pages in place: the page size must
      be a multiple of block_k (a key block lies in one page); split-KV
      (num_splits, split_size) applies. Every other implementation
      ("mosaic_gpu" too) runs on the pages gathered. Forward only.

  Returns:
    As `stableattn.attention`.
  """
  check_pages(k_pages, v_pages, page_table)
  if implementation == "flash":
    # The Triton path reads the pages in place; the Hopper path reads a
    # contiguous cache (each page's unused slots would need zeroing in
    # shared memory: NaN there times P = 0 is NaN).
    implementation = record_taken("pallas")
  if implementation != "pallas":
    if return_lse:
      raise ValueError("return_lse=True is only available for 'pallas'.")
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    return dispatch.attention(
      q,
      k,
      v,
      implementation=implementation,
      options=options,
      features=features,
      **keywords,
    )
  options, features = dispatch.split_keywords(options, features, keywords)
  cfg, ops = _paged_config(q, k_pages, v_pages, page_table, options, features)
  check_flag("return_lse", return_lse)
  out, lse = _paged_forward(
    jnp.asarray(q),
    jnp.asarray(k_pages),
    jnp.asarray(v_pages),
    jnp.asarray(page_table).astype(jnp.int32),
    ops,
    cfg=cfg,
  )
  return (out, lse) if return_lse else out


def _paged_config(q, k_pages, v_pages, page_table, options, features):
  """(the kernel's config with its page size, the feature operands) of
  a paged call, each shape and option it cannot take refused."""
  # The kernel runs forward only: the backward tiles are the forward's.
  options = dataclasses.replace(options, bwd_block_q=None, bwd_block_k=None)
  require_x64_if_needed(options.precision)
  page_size = k_pages.shape[1]
  batch, per_sequence = page_table.shape
  kv_shape = (batch, per_sequence * page_size, *k_pages.shape[2:])
  dispatch.check_shapes(
    q,
    jax.ShapeDtypeStruct(kv_shape, k_pages.dtype),
    jax.ShapeDtypeStruct(kv_shape, v_pages.dtype),
  )
  if options.precision.quantizes:
    raise ValueError(
      f"paged_attention does not run precision {options.precision.name!r}: "
      "operands below 16 bits are scaled per key block of a contiguous "
      "cache. Gather the pages (stableattn.gather_pages) and call "
      "stableattn.attention, or use a policy of 16 bits or more."
    )
  spec, ops = features.split(q.shape, kv_shape)
  cfg = dispatch.kernel_config(options, q.shape, kv_shape, spec)
  if page_size % cfg.block_k:
    raise ValueError(
      f"page_size={page_size} must be a multiple of block_k={cfg.block_k} "
      "for the kernel: a key block is read from one page. Choose block_k "
      f"dividing {page_size} (e.g. block_k={page_size})."
    )
  return dataclasses.replace(cfg, page_size=page_size), ops


@functools.partial(jax.jit, static_argnames=("cfg",))
def _paged_forward(q, k_pages, v_pages, page_table, ops, *, cfg: KernelConfig):
  q, k_pages, v_pages = stored_inputs(q, k_pages, v_pages, cfg.policy)
  q_len_padded = cfg.padded_lengths[0]
  head_dim_padded = padded_head_dim(cfg.head_dim, cfg.interpret)
  num_pages, page_size, kv_heads, _ = k_pages.shape

  def pool(pages):
    flat = pages.reshape(1, num_pages * page_size, kv_heads, cfg.head_dim)
    return pad_to(flat, num_pages * page_size, head_dim_padded)

  q_p = pad_to(q, q_len_padded, head_dim_padded)
  ops_p = pad_operands(ops, cfg)
  ranges = tile_ranges(ops_p, cfg, cfg.block_q, cfg.block_k)
  out_p, lse = flash_forward(
    q_p,
    pool(k_pages),
    pool(v_pages),
    ops_p,
    None if ranges is None else ranges[0],
    cfg,
    page_table=page_table,
  )
  return out_p[:, : cfg.q_len, :, : cfg.head_dim], lse[:, :, : cfg.q_len]
