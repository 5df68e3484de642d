"""How the Hopper path's backward splits its work (`BackwardLayout`):
which column parts of dQ, dK and dV each thread block accumulates, the
chunks its contractions read, dQ's key block, and the shared memory each
kernel takes (`kernel_bytes`, as Mosaic GPU's lowering counts it).

A warpgroup holds a 64 x 256 FP32 accumulator in 128 registers per
thread, and wgmma's N is at most 256 (`mosaic_plan.VALUE_PART_MAX`). So:
- dK and dV share a thread block only where both fit in 256 columns
  (head dims up to 128); above that, one kernel computes dV and another
  dK, each recomputing S^T;
- a head dim over 256 (absorbed MLA's 576/512) is split into parts of at
  most 256 columns (3 x 192 and 2 x 256), one thread block per part, and
  the contractions over it (S = Q K^T, dP = dO V^T) are summed chunk by
  chunk in one accumulator, each chunk's operands copied by TMA in turn,
  so no operand of the full width sits in shared memory.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from stableattn.kernels.mosaic_plan import VALUE_PART_MAX, value_parts
from stableattn.kernels.mosaic_support import (
  BARRIER_BYTES,
  RANGE_WIDTH,
  REDUCTION_SCRATCH_BYTES,
  ROWS,
  SHARED_MEMORY_BYTES,
  MosaicPlan,
  buffer_bytes,
  stats_names,
)


@dataclasses.dataclass(frozen=True)
class Columns:
  """A head dim as `parts` column parts of `width` columns each."""

  parts: int
  width: int

  @property
  def padded(self) -> int:
    return self.parts * self.width

  @property
  def chunked(self) -> bool:
    """Whether a contraction over these columns runs chunk by chunk."""
    return self.parts > 1


@dataclasses.dataclass(frozen=True)
class BackwardLayout:
  key: Columns  # Q's and K's head dim: dQ's and dK's parts, S's chunks
  value: Columns  # V's and dO's: dV's parts, dP's chunks
  fused: bool  # dK and dV accumulated in one thread block
  block_k: int  # dQ's key block

  @property
  def dkdv_kernels(self) -> tuple[tuple[str, ...], ...]:
    """The outputs of each dK dV kernel launched."""
    return (("dk", "dv"),) if self.fused else (("dv",), ("dk",))

  def columns(self, output: str) -> Columns:
    return self.value if output == "dv" else self.key

  def parts(self, outputs) -> int:
    """Thread blocks per 64-row block of a kernel with `outputs`."""
    return 1 if len(outputs) > 1 else self.columns(outputs[0]).parts


def backward_layout(plan: MosaicPlan) -> BackwardLayout:
  """The plan's backward: the forward's key block for dQ where dQ's
  shared memory fits at it, else 64 keys."""
  key = Columns(*value_parts(plan.head_dim))
  value = Columns(plan.value_parts, plan.value_dim)
  fused = not key.chunked and key.width + value.width <= VALUE_PART_MAX
  layout = BackwardLayout(key, value, fused, plan.block_k)
  if plan.block_k != ROWS and dq_bytes(plan, layout) > SHARED_MEMORY_BYTES:
    layout = dataclasses.replace(layout, block_k=ROWS)
  return layout


Scratch = dict[str, tuple[str, tuple, object]]


def _feature_buffers(names, kv_rows: int, tile) -> Scratch:
  """The feature operands a kernel reads (`names`): per-token vectors,
  the additive tile of shape `tile`, block ranges."""
  i32 = jnp.int32
  every = {
    "q_ids": ("vector", (ROWS,), i32),
    "kv_ids": ("vector", (kv_rows,), i32),
    "kv_pos": ("vector", (kv_rows,), i32),
    "additive": ("tile", tile, jnp.float32),
    "ranges": ("vector", (RANGE_WIDTH,), i32),
    "query_ranges": ("vector", (RANGE_WIDTH,), i32),
  }
  return {n: every[n] for n in names}


# The dQ kernel's sums for d(sink) under sink_delta=probs: rowsum(P dP)
# and rowsum(P), [B, H, T] each.
SINK_SUMS = ("sink_delta", "sink_sums")


def _row_buffers(plan: MosaicPlan) -> Scratch:
  """The softmax residuals' and delta's row vectors."""
  names = (*stats_names(plan), "delta")
  return {n: ("vector", (ROWS,), jnp.float32) for n in names}


def dkdv_scopes(plan, layout, outputs, features) -> tuple[Scratch, ...]:
  """dK dV's shared memory in its three scopes, (for the whole kernel,
  for the loop over query blocks, for the store after it): the loop's
  and the store's buffers take the same bytes in turn. K (and V, for
  dK) stays for the whole kernel unless its contraction is chunked."""
  dtype, f32 = plan.operand_dtype, jnp.float32
  key, value = layout.key, layout.value
  wants_dk = "dk" in outputs
  streamed = {
    "k": ("tile", (ROWS, key.width), dtype),
    "qt": ("tile", (key.width, ROWS), dtype),
  }
  if wants_dk:
    streamed |= {
      "v": ("tile", (ROWS, value.width), dtype),
      "dot": ("tile", (value.width, ROWS), dtype),
      "q": ("tile", (ROWS, key.width), dtype),
    }
  if "dv" in outputs:
    streamed["do"] = ("tile", (ROWS, value.width), dtype)
  streamed["ds"] = ("tile", (ROWS, ROWS), dtype)  # P^T, then dS^T
  kept = {
    n: streamed.pop(n)
    for n, columns in (("k", key), ("v", value))
    if n in streamed and not columns.chunked
  }
  whole = {
    **kept,
    **_row_buffers(plan),
    **_feature_buffers(features, ROWS, (ROWS, ROWS)),
  }
  store = {n: ("tile", (ROWS, layout.columns(n).width), f32) for n in outputs}
  return whole, streamed, store


def dq_scopes(plan, layout, features) -> tuple[Scratch, ...]:
  """dQ's shared memory in the same three scopes: Q and dO stay for the
  whole kernel unless their contractions are chunked."""
  dtype, f32 = plan.operand_dtype, jnp.float32
  key, value, block_k = layout.key, layout.value, layout.block_k
  streamed = {
    "q": ("tile", (ROWS, key.width), dtype),
    "kt": ("tile", (key.width, block_k), dtype),
    "do": ("tile", (ROWS, value.width), dtype),
    "vt": ("tile", (value.width, block_k), dtype),
    "k": ("tile", (block_k, key.width), dtype),
    "ds": ("tile", (ROWS, block_k), dtype),
  }
  if plan.bias_grad:
    streamed["dbias"] = ("tile", (ROWS, block_k), f32)
  kept = {
    n: streamed.pop(n)
    for n, columns in (("q", key), ("do", value))
    if not columns.chunked
  }
  whole = {
    **kept,
    **_row_buffers(plan),
    **_feature_buffers(features, block_k, (ROWS, block_k)),
  }
  store = {"dq": ("tile", (ROWS, key.width), f32)}
  if plan.sink_sums:
    store |= {n: ("vector", (ROWS,), f32) for n in SINK_SUMS}
  return whole, streamed, store


def scoped_bytes(scopes, reduces_rows: bool = False) -> int:
  """A kernel's shared memory as Mosaic GPU's lowering counts it: the
  whole kernel's buffers, the larger of the two scopes that follow one
  another, one barrier, and the reduction scratch where the kernel sums
  a tile across its rows (only dQ's sums for d(sink) do; the forward's
  row maxima and sums always do)."""
  whole, *turns = (
    sum(buffer_bytes(shape, dtype) for _, shape, dtype in scope.values())
    for scope in scopes
  )
  scratch = REDUCTION_SCRATCH_BYTES if reduces_rows else 0
  return whole + max(turns) + BARRIER_BYTES + scratch


# The feature operands each backward kernel reads, as the forward passes
# them (`mosaic_backward.kernel_features`): every per-token vector and
# tile, dK dV's query ranges and dQ's key ranges.
_DKDV_FEATURES = ("q_ids", "kv_ids", "kv_pos", "additive", "query_ranges")
_DQ_FEATURES = ("q_ids", "kv_ids", "kv_pos", "additive", "ranges")


def _features(plan: MosaicPlan, names) -> tuple[str, ...]:
  present = {
    "q_ids": plan.token_ids,
    "kv_ids": plan.token_ids,
    "kv_pos": plan.key_positions,
    "additive": plan.additive is not None,
    "ranges": plan.block_ranges,
    "query_ranges": plan.block_ranges,
  }
  return tuple(n for n in names if present[n])


def dq_bytes(plan: MosaicPlan, layout: BackwardLayout) -> int:
  scopes = dq_scopes(plan, layout, _features(plan, _DQ_FEATURES))
  return scoped_bytes(scopes, reduces_rows=plan.sink_sums)


def kernel_bytes(plan: MosaicPlan) -> dict[str, int]:
  """{kernel: shared-memory bytes} of the plan's backward: "dkdv" (or
  "dv" and "dk" when split) and "dq"."""
  layout = backward_layout(plan)
  features = _features(plan, _DKDV_FEATURES)
  found = {
    "".join(outputs): scoped_bytes(dkdv_scopes(plan, layout, outputs, features))
    for outputs in layout.dkdv_kernels
  }
  return found | {"dq": dq_bytes(plan, layout)}
