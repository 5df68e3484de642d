"""Context-parallel (ring) attention: the sequence sharded over a mesh axis.

Each of the n devices on `axis` holds a shard of the queries, keys and
values. The key/value shards travel around the ring (`lax.ppermute`, n - 1
hops): at every step a device runs our flash kernel on its queries and the
shard it holds, getting a partial output and its log-sum-exp, and the
partials are merged through their log-sum-exps (Liu et al., "Ring
Attention with Blockwise Transformers", 2023; Llama 3's context
parallelism; TransformerEngine's and Megatron's `cp` groups).

The merge is a stage of the precision policy: each step's partial output
is stored in `partials`; exps, logs and the lse are in `softmax_stats`,
the weighted sum in `out_accum` (`split_merge.merge_splits`). Two
merge schedules:
  * "online" (ring-flash-attention, TransformerEngine): the running result
    is merged with each arriving partial, a partial itself between steps.
  * "final": every partial is kept and merged once, in arrival order
    (FlashAttention's split-KV combine).

Causal masking with load balance (`balanced=True`, the default for causal
attention): the sequence is cut into 2n chunks and device i holds chunks
i and 2n-1-i, so every device has the same share of the causal triangle
(Llama 3; TransformerEngine). The caller passes and gets arrays in natural
order; the reordering is done here. Unbalanced, device i holds the i-th
contiguous shard.

The backward is the ring backward: the key/value shards go around again
with their dK and dV accumulators, each device adds its queries'
contribution (in `grad_accum`), and after n hops the accumulators are home;
dQ accumulates where the queries live.

Features: causal (top-left), local window, softcap, scale, lengths and
segments (as token ids that travel with the keys). Not available: an
additive bias or dense mask (a [q_len, kv_len] matrix is not sharded by
sequence here), a sink, bottom-right alignment with per-example lengths,
split-KV options and policies below 16 bits; each raises a ValueError
saying so.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from stableattn.contract.features import Features
from stableattn.contract.masking import MaskOperands
from stableattn.contract.options import Options
from stableattn.contract.tiling import check_flag
from stableattn.kernels.flash_attention import (
  pad_operands,
  pad_to,
  padded_head_dim,
  tile_ranges,
)
from stableattn.kernels.pallas_backward import flash_backward
from stableattn.kernels.pallas_forward import flash_forward
from stableattn.kernels.quantization import stored_inputs
from stableattn.kernels.split_merge import merge_splits
from stableattn.numerics.precision import require_x64_if_needed
from stableattn.numerics.rounding import PolicyArithmetic
from stableattn.ops import dispatch
from stableattn.ops.ring_plan import (
  RingPlan,
  check_arguments,
  device_order,
  make_plan,
  ring_size,
)


def _step_operands(plan: RingPlan, q_ids, kv_ids, kv_positions, q_start):
  """The padded mask operands of one (query chunk, visiting shard) step."""
  batch = kv_positions.shape[0]
  ops = MaskOperands(
    q_ids=q_ids,
    kv_ids=kv_ids,
    kv_pos=jnp.broadcast_to(kv_positions - q_start, (batch, plan.kv_shard)),
  )
  return pad_operands(ops, plan.step)


def _chunks(plan: RingPlan, x, axis: int = 1):
  """A device's rows split into its chunks (axis `axis`)."""
  if x is None:
    return [None] * plan.chunks_per_device
  return jnp.split(x, plan.chunks_per_device, axis=axis)


def _padded(plan: RingPlan, x, length: int):
  cfg = plan.step
  return pad_to(x, length, padded_head_dim(cfg.head_dim, cfg.interpret))


def _visiting(plan: RingPlan, me, step: int, k, v):
  """The shard `me` holds at `step`: its keys' global positions [B, S]
  and its keys and values padded for the kernel."""
  positions = plan.positions(plan.source(me, step), plan.kv_shard)
  positions = jnp.broadcast_to(positions[None], (k.shape[0], plan.kv_shard))
  kv_len_padded = plan.step.kv_len_padded
  return (
    positions,
    _padded(plan, k, kv_len_padded),
    _padded(plan, v, kv_len_padded),
  )


def _forward_shard(q, k, v, q_ids, kv_ids, plan: RingPlan):
  """One device's queries against every shard: (out [B, Tq, H, D] in
  `output`, lse [B, H, Tq]; +inf where no key attends)."""
  cfg = plan.step
  q_len_padded = cfg.padded_lengths[0]
  me = lax.axis_index(plan.axis)
  q_chunks = [_padded(plan, c, q_len_padded) for c in _chunks(plan, q)]
  q_id_chunks = _chunks(plan, q_ids)
  starts = plan.chunk_starts(me, plan.q_shard)
  carried = [None] * len(q_chunks)  # online merge: running (out, lse)
  kept = [[] for _ in q_chunks]  # final merge: every partial
  for step in range(plan.devices):
    if step:
      k, v, kv_ids = lax.ppermute((k, v, kv_ids), plan.axis, plan.hop)
    positions, k_p, v_p = _visiting(plan, me, step, k, v)
    for c, q_p in enumerate(q_chunks):
      ops = _step_operands(plan, q_id_chunks[c], kv_ids, positions, starts[c])
      ranges = tile_ranges(ops, cfg, cfg.block_q, cfg.block_k)
      part = flash_forward(
        q_p,
        k_p,
        v_p,
        ops,
        None if ranges is None else ranges[0],
        cfg,
        merge=False,
      )
      if plan.merge == "final":
        kept[c].append(part)
      elif carried[c] is None:
        carried[c] = part
      else:
        both = [jnp.concatenate(x, axis=1) for x in zip(carried[c], part)]
        merged = merge_splits(*both, cfg, final=False)
        carried[c] = (merged[0][:, None], merged[1][:, None])
  outs, lses = [], []
  for c in range(len(q_chunks)):
    if plan.merge == "final":
      parts = [jnp.concatenate(x, axis=1) for x in zip(*kept[c])]
    else:
      parts = carried[c]
    out, lse = merge_splits(*parts, cfg, final=True)
    outs.append(out[:, : cfg.q_len, :, : cfg.head_dim])
    lses.append(lse[:, :, : cfg.q_len])
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_shard(q, k, v, q_ids, kv_ids, plan: RingPlan):
  return _forward_shard(q, k, v, q_ids, kv_ids, plan)[0]


def _ring_shard_fwd(q, k, v, q_ids, kv_ids, plan):
  out, lse = _forward_shard(q, k, v, q_ids, kv_ids, plan)
  return out, (q, k, v, q_ids, kv_ids, out, lse)


def _ring_shard_bwd(plan: RingPlan, saved, d_out):
  q, k, v, q_ids, kv_ids, out, lse = saved
  cfg = plan.step
  ar = PolicyArithmetic(cfg.policy)
  q_len_padded = cfg.padded_lengths[0]
  me = lax.axis_index(plan.axis)
  heads = q.shape[2]
  kv_heads = k.shape[2]
  group = heads // kv_heads

  def grad(x):
    return ar.round(x.astype(ar.carrier), "grad_accum")

  def add(a, b):
    return b if a is None else grad(a + b)

  def sum_groups(g):
    if group == 1:
      return g
    g = g.reshape(*g.shape[:2], kv_heads, group, g.shape[-1])
    return ar.sum(g, "grad_accum", axis=3)

  q_chunks = [_padded(plan, c, q_len_padded) for c in _chunks(plan, q)]
  out_chunks = [_padded(plan, c, q_len_padded) for c in _chunks(plan, out)]
  d_out_chunks = [
    _padded(plan, c.astype(out.dtype), q_len_padded)
    for c in _chunks(plan, d_out)
  ]
  lse_chunks = [
    jnp.pad(c, ((0, 0), (0, 0), (0, q_len_padded - cfg.q_len)))
    for c in _chunks(plan, lse, axis=2)
  ]
  q_id_chunks = _chunks(plan, q_ids)
  starts = plan.chunk_starts(me, plan.q_shard)
  d_q = [None] * len(q_chunks)
  d_k = d_v = None  # travel with the key/value shard they belong to
  for step in range(plan.devices):
    if step:
      k, v, kv_ids, d_k, d_v = lax.ppermute(
        (k, v, kv_ids, d_k, d_v), plan.axis, plan.hop
      )
    positions, k_p, v_p = _visiting(plan, me, step, k, v)
    for c, q_p in enumerate(q_chunks):
      ops = _step_operands(plan, q_id_chunks[c], kv_ids, positions, starts[c])
      ranges = tile_ranges(ops, cfg, cfg.bwd_block_q, cfg.bwd_block_k)
      dq_c, dk_c, dv_c, _, _ = flash_backward(
        q_p,
        k_p,
        v_p,
        (out_chunks[c], lse_chunks[c], {}),
        d_out_chunks[c],
        ops,
        ranges,
        cfg,
      )
      d_q[c] = add(d_q[c], dq_c[:, : cfg.q_len])
      d_k = add(d_k, sum_groups(dk_c)[:, : plan.kv_shard])
      d_v = add(d_v, sum_groups(dv_c)[:, : plan.kv_shard])
  # One more hop brings each shard's dK and dV home.
  d_k, d_v = lax.ppermute((d_k, d_v), plan.axis, plan.hop)
  d_q = jnp.concatenate(d_q, axis=1)
  head_dim = cfg.head_dim
  grads = tuple(
    ar.stored(g[..., :head_dim], "inputs").astype(x.dtype)
    for g, x in ((d_q, q), (d_k, k), (d_v, v))
  )
  no_id_gradient = tuple(
    None if x is None else np.zeros(x.shape, jax.dtypes.float0)
    for x in (q_ids, kv_ids)
  )
  return (*grads, *no_id_gradient)


_ring_shard.defvjp(_ring_shard_fwd, _ring_shard_bwd)


@functools.partial(
  jax.jit, static_argnames=("plan", "mesh", "return_lse", "with_ids")
)
def _ring(q, k, v, q_ids, kv_ids, *, plan, mesh, return_lse, with_ids):
  q, k, v = stored_inputs(q, k, v, plan.step.policy)
  q_order = device_order(plan.devices, q.shape[1], plan.balanced)
  kv_order = device_order(plan.devices, k.shape[1], plan.balanced)
  q, k, v = q[:, q_order], k[:, kv_order], v[:, kv_order]
  if with_ids:
    q_ids, kv_ids = q_ids[:, q_order], kv_ids[:, kv_order]
  rows = P(None, plan.axis)
  ids_spec = rows if with_ids else None

  def shard(q, k, v, q_ids, kv_ids):
    if return_lse:
      return _forward_shard(q, k, v, q_ids, kv_ids, plan)
    return _ring_shard(q, k, v, q_ids, kv_ids, plan)

  out_specs = (rows, P(None, None, plan.axis)) if return_lse else rows
  result = jax.shard_map(
    shard,
    mesh=mesh,
    in_specs=(rows, rows, rows, ids_spec, ids_spec),
    out_specs=out_specs,
    check_vma=False,
  )(q, k, v, q_ids, kv_ids)
  back = np.argsort(q_order)
  if return_lse:
    out, lse = result
    return out[:, back], lse[:, :, back]
  return result[:, back]


def ring_attention(
  q,
  k,
  v,
  *,
  mesh: Mesh,
  axis: str,
  options: Options | None = None,
  features: Features | None = None,
  balanced: bool | None = None,
  reverse: bool = False,
  merge: str = "online",
  return_lse: bool = False,
  **keywords,
):
  """Attention with the sequence sharded over `axis` of `mesh` (a ring).

  Args:
    q: [batch, q_len, heads, head_dim]; k, v: [batch, kv_len, kv_heads,
      head_dim], in natural sequence order (any sharding: they are laid out
      over the ring here).
    mesh, axis: the `jax.sharding.Mesh` and the name of the axis whose
      devices form the ring; other axes see the whole sequence.
    options, features, **keywords: as `stableattn.attention` (our flash
      kernel computes each step); see the module docstring for the
      features the ring supports.
    balanced: two opposite chunks per device (default: True for causal
      attention, else False).
    reverse: the shards travel the other way round the ring.
    merge: "online" (running merge per step) or "final" (all partials at
      once), in a policy's `partials`, `softmax_stats` and `out_accum`.
    return_lse: also return the log-sum-exp [batch, heads, q_len] (not
      differentiable; +inf for a row no key attends).

  Returns:
    [batch, q_len, heads, head_dim] in the policy's `output` format, in
    natural order (and the lse with `return_lse`); differentiable in q, k
    and v by the ring backward.
  """
  devices = ring_size(mesh, axis, merge, reverse, return_lse)
  options, features = dispatch.split_keywords(options, features, keywords)
  if balanced is None:
    balanced = bool(features.causal)
  check_flag("balanced", balanced)
  require_x64_if_needed(options.precision)
  q, k, v = dispatch.validate_inputs(q, k, v)
  if v.shape[3] != k.shape[3]:
    raise ValueError(
      f"ring_attention takes k and v of one head dim, got {k.shape[3]} and "
      f"{v.shape[3]}; MLA's value head dim runs in stableattn.attention "
      "(pallas or reference)."
    )
  spec, ops = features.split(q.shape, k.shape)
  check_arguments(features, spec, options, q, k, devices, balanced)
  plan = make_plan(
    options,
    spec,
    q.shape,
    k.shape,
    axis=axis,
    devices=devices,
    balanced=balanced,
    reverse=reverse,
    merge=merge,
  )
  with_ids = spec.token_ids
  return _ring(
    q,
    k,
    v,
    ops.q_ids if with_ids else None,
    ops.kv_ids if with_ids else None,
    plan=plan,
    mesh=mesh,
    return_lse=return_lse,
    with_ids=with_ids,
  )
