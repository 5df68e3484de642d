"""The plan of a ring-attention call: which chunks each device holds (with
or without load balance), which shard it sees at each step, the kernel
configuration of one step, and the checks of a call's arguments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from stableattn.contract.features import Features
from stableattn.contract.options import Options
from stableattn.contract.tiling import check_flag
from stableattn.kernels.kernel_config import KernelConfig
from stableattn.numerics.quant_options import changed_stability_options
from stableattn.ops import dispatch

MERGES = ("online", "final")
# The mesh axis of `context_mesh`, the ring a context-parallel model uses.
CONTEXT_AXIS = "context"


def context_mesh(devices: int) -> Mesh:
  """The 1-D mesh (axis "context") of the first `devices` devices: the
  ring a context-parallel model or study shards its sequence over."""
  available = jax.devices()
  if devices > len(available):
    raise ValueError(
      f"context_parallel={devices} needs {devices} devices, but only "
      f"{len(available)} are available (on CPU, simulate more with "
      f"jax.config.update('jax_num_cpu_devices', {devices}) before JAX "
      "starts, or XLA_FLAGS=--xla_force_host_platform_device_count="
      f"{devices})."
    )
  return Mesh(np.asarray(available[:devices]), (CONTEXT_AXIS,))


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """Everything static about one ring-attention call (hashable).

  Attributes:
    step: the kernel configuration of one step: one query chunk against
      one visiting key/value shard, key positions as an operand, one split
      (so the kernel writes a partial and -inf for an empty row).
    axis: the mesh axis the sequence is sharded over.
    devices: the ring's length (the axis size).
    balanced: device i holds chunks i and 2n-1-i of 2n (else the i-th of n).
    reverse: the key/value shards travel to device i-1 instead of i+1.
    merge: "online" or "final".
    q_shard, kv_shard: queries and keys per device.
  """

  step: KernelConfig
  axis: str
  devices: int
  balanced: bool
  reverse: bool
  merge: str
  q_shard: int
  kv_shard: int

  @property
  def chunks_per_device(self) -> int:
    return 2 if self.balanced else 1

  @property
  def hop(self):
    """The ppermute pairs of one hop around the ring."""
    n, d = self.devices, -1 if self.reverse else 1
    return [(j, (j + d) % n) for j in range(n)]

  def source(self, device, step):
    """Whose key/value shard `device` holds at `step`."""
    d = -1 if self.reverse else 1
    return (device - d * step) % self.devices

  def chunk_starts(self, device, shard: int):
    """Global positions of the first row of each chunk `device` holds, for
    a shard of `shard` rows."""
    if not self.balanced:
      return [device * shard]
    chunk = shard // 2
    return [device * chunk, (2 * self.devices - 1 - device) * chunk]

  def positions(self, device, shard: int):
    """int32 [shard]: the global positions of a device's rows."""
    chunk = shard // self.chunks_per_device
    rows = jnp.arange(chunk, dtype=jnp.int32)
    return jnp.concatenate(
      [rows + start for start in self.chunk_starts(device, shard)]
    )


def device_order(n: int, length: int, balanced: bool) -> np.ndarray:
  """Sequence indices in device order: device i's rows, then i+1's."""
  if not balanced:
    return np.arange(length)
  chunk = length // (2 * n)
  blocks = [
    np.arange(c * chunk, (c + 1) * chunk)
    for i in range(n)
    for c in (i, 2 * n - 1 - i)
  ]
  return np.concatenate(blocks)


def ring_size(mesh, axis: str, merge: str, reverse, return_lse) -> int:
  """The devices on `axis`, after checking the ring's own arguments."""
  # An AbstractMesh lowers the ring for devices this machine lacks.
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise ValueError(
      f"mesh must be a jax.sharding.Mesh (or AbstractMesh), got "
      f"{type(mesh).__name__}."
    )
  if axis not in mesh.axis_names:
    raise ValueError(
      f"Unknown mesh axis {axis!r}; the mesh has axes {list(mesh.axis_names)}."
    )
  if merge not in MERGES:
    raise ValueError(f"Unknown merge {merge!r}; valid: {list(MERGES)}.")
  check_flag("reverse", reverse)
  check_flag("return_lse", return_lse)
  return mesh.shape[axis]


def check_arguments(
  features: Features, spec, options: Options, q, k, n, balanced
):
  policy = options.precision
  if policy.quantizes:
    raise ValueError(
      f"ring_attention cannot run precision {policy.name!r}: operands "
      "below 16 bits need scales that travel with the shards, which are "
      "not implemented; use a 16- or 32-bit policy."
    )
  stable = changed_stability_options(policy)
  if stable:
    raise ValueError(
      f"ring_attention cannot run {', '.join(stable)} (precision "
      f"{policy.name!r}): its steps merge partial outputs by their lse, "
      "and the residuals of a stable backward are not merged; use the "
      "base preset (e.g. bf16-fa2 for bf16-fa2-stable)."
    )
  unsupported = [
    name
    for name, used in (
      ("bias", spec.bias is not None),
      ("mask", spec.dense_mask is not None),
      ("sink", spec.sink),
      ("num_splits", options.num_splits is not None),
      ("split_size", options.split_size is not None),
    )
    if used
  ]
  if unsupported:
    raise ValueError(
      f"ring_attention does not support {', '.join(unsupported)}: a dense "
      "[q_len, kv_len] bias or mask is not sharded by sequence here, a sink "
      "would count once per ring step, and the ring is itself the split of "
      "the keys. Supported: causal, local_window_size, softcap, scale, "
      "query/key_value_seq_lengths, segment_ids."
    )
  if spec.key_positions or spec.key_offset:
    raise ValueError(
      "ring_attention places keys top-left (key j at query position j): "
      "causal_alignment='bottom_right' shifts them per example here "
      "(q_len != kv_len, or per-example lengths with causal or a window), "
      f"which the ring does not carry; got q_len {q.shape[1]}, kv_len "
      f"{k.shape[1]}. Use causal_alignment='top_left' (the same when "
      "q_len == kv_len and lengths are equal)."
    )
  parts = 2 * n if balanced else n
  for name, length in (("q", q.shape[1]), ("k/v", k.shape[1])):
    if length % parts:
      raise ValueError(
        f"{name} length {length} must be divisible by {parts}: "
        f"{'2 x ' if balanced else ''}{n} devices"
        f"{' (balanced: two chunks per device)' if balanced else ''} "
        "hold equal shards. Pad the sequence (with lengths) to a multiple."
      )
  if balanced and q.shape[1] != k.shape[1]:
    raise ValueError(
      "balanced=True pairs chunk i with chunk 2n-1-i of one sequence; it "
      f"needs q_len == kv_len, got {q.shape[1]} and {k.shape[1]}."
    )


def make_plan(
  options: Options,
  spec,
  q_shape,
  kv_shape,
  *,
  axis: str,
  devices: int,
  balanced: bool,
  reverse: bool,
  merge: str,
) -> RingPlan:
  q_shard, kv_shard = q_shape[1] // devices, kv_shape[1] // devices
  chunk = q_shard // (2 if balanced else 1)
  step_spec = dataclasses.replace(spec, key_positions=True, key_offset=0)
  batch, _, heads, head_dim = q_shape
  step = dispatch.kernel_config(
    options,
    (batch, chunk, heads, head_dim),
    (batch, kv_shard, kv_shape[2], head_dim),
    step_spec,
  )
  # One split over the whole visiting shard: the kernel then writes a
  # partial output (in `partials`) and -inf for a row with no key.
  step = dataclasses.replace(
    step, options=step.options.replace(split_size=step.kv_len_padded)
  )
  return RingPlan(
    step=step,
    axis=axis,
    devices=devices,
    balanced=balanced,
    reverse=reverse,
    merge=merge,
    q_shard=q_shard,
    kv_shard=kv_shard,
  )
