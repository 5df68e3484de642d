"""A small decoder-only transformer (flax.nnx), attention chosen by name.

Pre-norm blocks (RMSNorm statistics in FP32), learned absolute positions,
a GELU MLP, and tied input/output embeddings, computing in the format a
`ComputeFormat` names: every module is given its dtype, so no tensor's
format is left to type promotion. Attention is one of:
  * any name of `stableattn.ops.registry`: "reference" (materialized
    baseline attention), "pallas" (our flash kernel), "xla"
    (`jax.nn.dot_product_attention`), a peer ("cudnn", "jax_mha", ...), or
    a user's kernel as "package.module:function",
  * "shadow": computes both flash and baseline on the same inputs, passes one
    of them downstream (`shadow_downstream`) and, when statistics are
    collected, reports their per-layer deviation (Golden et al. ran both
    attentions inside the model the same way).
With `collect_stats=True` every layer also reports the monitor's
statistics (`stableattn.numerics.monitor`): its largest attention logit,
row log-sum-exps, near ties (Qiu & Yao's biased rounding starts there),
per layer and per head; from our kernel's own pass where it computes the
flash output, else from q and k.

Stability options (Wortsman et al., arXiv 2309.14322): `ModelSpec.qk_norm`
normalizes each head's queries and keys (RMSNorm over the head dim, with
a learned scale) before attention, which bounds the logits;
a softcap among `AttentionSpec.features` caps them (softcap * tanh(s /
softcap), Gemma 2).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from stableattn.contract.options import Options
from stableattn.numerics.monitor import attention_statistics, kernel_statistics
from stableattn.ops import registry
from stableattn.training.attention_spec import SHADOW, AttentionSpec
from stableattn.training.compute_format import ComputeFormat

FP32 = Options(precision="fp32")
FP32_COMPUTE = ComputeFormat()  # a model computing in FP32 throughout
# The language-model head's formats: the model's compute format, FP32
# operands, or BF16 operands (FP32 accumulation) with the logits stored in
# BF16, as a BF16 inference engine computes them.
HEAD_FORMATS = ("compute", "fp32", "bf16")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  vocab_size: int = 256
  width: int = 128
  depth: int = 4
  heads: int = 4
  max_len: int = 128
  mlp_ratio: int = 4
  qk_norm: bool = False  # RMSNorm of each head's q and k (Wortsman et al.)


class RMSNorm(nnx.Module):
  def __init__(self, width: int):
    self.scale = nnx.Param(jnp.ones((width,), jnp.float32))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class SelfAttention(nnx.Module):
  def __init__(
    self,
    spec: ModelSpec,
    attention_spec: AttentionSpec,
    *,
    rngs: nnx.Rngs,
    compute: ComputeFormat,
  ):
    self.heads = spec.heads
    self.head_dim = spec.width // spec.heads
    self.attention_spec = attention_spec

    def linear(dtype):
      return nnx.Linear(
        spec.width, spec.width, use_bias=False, dtype=dtype, rngs=rngs
      )

    dtype = compute.dtype_of("attention_projections")
    self.query, self.key, self.value, self.out = (
      linear(dtype) for _ in range(4)
    )
    if spec.qk_norm:
      self.query_norm = RMSNorm(self.head_dim)
      self.key_norm = RMSNorm(self.head_dim)
    self.qk_norm = spec.qk_norm

  def project(self, x_BxTxW):
    """Queries, keys and values [B, T, H, D] of x."""
    batch, length, _ = x_BxTxW.shape
    shape = (batch, length, self.heads, self.head_dim)
    q = self.query(x_BxTxW).reshape(shape)
    k = self.key(x_BxTxW).reshape(shape)
    v = self.value(x_BxTxW).reshape(shape)
    if self.qk_norm:
      q, k = self.query_norm(q), self.key_norm(k)
    return q, k, v

  def extend(self, x_BxNxW, keys, values, lengths, spec: AttentionSpec):
    """Attention of N new tokens over a KV cache: their keys and values
    are written at positions lengths .. lengths + N - 1 of the cache
    buffers [B, max_len, H, D], and each new token attends to its prefix
    (bottom-right causal, the cache's valid length per example), as an
    inference engine's prefill (N > 1) or decode step (N = 1) does.

    Returns the output [B, N, W] and the updated buffers."""
    q, k, v = self.project(x_BxNxW)

    def write(buffer, new):
      def one(b, n, start):
        zero = jnp.zeros((), start.dtype)  # one index dtype, 64-bit or not
        return jax.lax.dynamic_update_slice(b, n, (start, zero, zero))

      return jax.vmap(one)(buffer, new.astype(buffer.dtype), lengths)

    keys, values = write(keys, k), write(values, v)
    features = spec.features.replace(
      causal=True,
      causal_alignment="bottom_right",
      key_value_seq_lengths=lengths + x_BxNxW.shape[1],
    )
    fn = registry.resolve(spec.kind, spec.options)
    out = fn(
      q, keys.astype(q.dtype), values.astype(q.dtype), **features.kwargs()
    )
    out = out.astype(x_BxNxW.dtype).reshape(x_BxNxW.shape)
    return self.out(out), keys, values

  def __call__(self, x_BxTxW, collect_stats: bool = False, probe_tap=None):
    """Output and statistics. `probe_tap` ([B, T, H, D], zeros) is added to
    the attention output, so its gradient is dO; with it the statistics
    hold q, k, v, this attention's output and FP32 attention's on them
    (arrays, for `Trainer.deltas` and `Trainer.capture`)."""
    batch, length, width = x_BxTxW.shape
    q, k, v = self.project(x_BxTxW)
    spec = self.attention_spec
    stats = {}
    from_kernel = collect_stats and spec.kernel_monitors
    if from_kernel:
      flash, rows = spec.flash_with_statistics(q, k, v)
    if spec.kind == SHADOW:
      if not from_kernel:
        flash = spec.call(q, k, v, spec.shadow_flash)
      base = spec.call(q, k, v, "reference", spec.shadow_baseline)
      out = flash if spec.shadow_downstream == "pallas" else base
      if collect_stats:
        diff = jnp.abs(flash.astype(jnp.float32) - base.astype(jnp.float32))
        stats["shadow_max_abs"] = jnp.max(diff)
        stats["shadow_rel_l2"] = jnp.linalg.norm(diff) / jnp.linalg.norm(
          base.astype(jnp.float32)
        )
    else:
      out = flash if from_kernel else spec.call(q, k, v)
    if collect_stats:
      inputs = spec.options.precision.dtype("inputs")
      if from_kernel:
        stats.update(kernel_statistics(rows, q, k, inputs, v))
      else:
        stats.update(attention_statistics(q, k, inputs, v_BxTxHxD=v))
    if probe_tap is not None:
      stats.update(q=q, k=k, v=v)  # as the kernel received them
      stats["out"] = out
      stats["out_fp32"] = spec.call(q, k, v, "reference", FP32)
      out = out + probe_tap.astype(out.dtype)
    out = out.astype(x_BxTxW.dtype).reshape(batch, length, width)
    return self.out(out), stats


class Block(nnx.Module):
  def __init__(
    self,
    spec: ModelSpec,
    attention_spec: AttentionSpec,
    *,
    rngs: nnx.Rngs,
    compute: ComputeFormat,
  ):
    self.attention_norm = RMSNorm(spec.width)
    self.attention = SelfAttention(
      spec, attention_spec, rngs=rngs, compute=compute
    )
    self.mlp_norm = RMSNorm(spec.width)
    hidden = spec.mlp_ratio * spec.width
    dtype = compute.dtype_of("mlp")
    self.mlp_in = nnx.Linear(spec.width, hidden, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(hidden, spec.width, dtype=dtype, rngs=rngs)

  def __call__(self, x, collect_stats: bool = False, probe_tap=None):
    attended, stats = self.attention(
      self.attention_norm(x), collect_stats, probe_tap
    )
    x = x + attended.astype(x.dtype)
    return self.mlp(x), stats

  def mlp(self, x):
    """x plus the MLP's output, rounded to x's format (the stream's)."""
    out = self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))
    return x + out.astype(x.dtype)

  def extend(self, x, keys, values, lengths, spec: AttentionSpec):
    attended, keys, values = self.attention.extend(
      self.attention_norm(x), keys, values, lengths, spec
    )
    return self.mlp(x + attended.astype(x.dtype)), keys, values


class DecodeCache(NamedTuple):
  """Every layer's key and value buffers [B, max_len, H, D] and how many
  tokens each example holds ([B] int32)."""

  keys: tuple
  values: tuple
  lengths: jax.Array


class Transformer(nnx.Module):
  def __init__(
    self,
    spec: ModelSpec,
    attention_spec: AttentionSpec,
    *,
    rngs: nnx.Rngs,
    compute: ComputeFormat = FP32_COMPUTE,
  ):
    self.spec = spec
    self.compute = compute
    # nnx.Embed's output takes its `dtype`, which defaults to the table's
    # (FP32): without it every layer after would promote to FP32.
    self.embed = nnx.Embed(
      spec.vocab_size,
      spec.width,
      dtype=compute.dtype_of("embedding"),
      rngs=rngs,
    )
    self.positions = nnx.Param(
      0.02
      * jax.random.normal(
        rngs.params(), (spec.max_len, spec.width), jnp.float32
      )
    )
    self.blocks = nnx.List(
      [
        Block(spec, attention_spec, rngs=rngs, compute=compute)
        for _ in range(spec.depth)
      ]
    )
    self.final_norm = RMSNorm(spec.width)

  def __call__(
    self,
    tokens_BxT,
    collect_stats: bool = False,
    probe_taps=None,
    head_format: str = "compute",
  ):
    """Logits [B, T, vocab] (FP32) and per-layer statistics; `probe_taps`:
    one per layer, see `SelfAttention`; `head_format`: see `head`."""
    states, layer_stats = self.residual_stream(
      tokens_BxT, collect_stats, probe_taps
    )
    return self.head(states[-1], head_format), layer_stats

  def residual_stream(self, tokens_BxT, collect_stats=False, probe_taps=None):
    """The residual stream [B, T, W] after the embedding and after each
    block (depth + 1 states, in the activation format), and per-layer
    statistics."""
    length = tokens_BxT.shape[1]
    if length > self.spec.max_len:
      raise ValueError(
        f"sequence length {length} exceeds the model's max_len "
        f"{self.spec.max_len}."
      )
    x = self.embed(tokens_BxT)
    x = x + self.positions[:length].astype(x.dtype)
    x = x.astype(self.compute.dtype_of("residual_stream"))
    states, layer_stats = [x], []
    taps = probe_taps or [None] * len(self.blocks)
    for block, tap in zip(self.blocks, taps):
      x, stats = block(x, collect_stats, tap)
      states.append(x)
      layer_stats.append(stats)
    return states, layer_stats

  @staticmethod
  def parameter_classes(path: tuple) -> frozenset:
    """The tensor classes (`compute_format.FP32_CLASSES`) that read the
    parameter at `path` (its nnx.State keys): the tied table is both the
    embedding's and the head's."""
    names = {str(getattr(key, "key", key)) for key in path}
    owners = {
      "embed": ("embedding", "head"),
      "positions": ("embedding",),
      "attention_norm": ("residual_stream",),
      "mlp_norm": ("residual_stream",),
      "query": ("attention_projections",),
      "key": ("attention_projections",),
      "value": ("attention_projections",),
      "out": ("attention_projections",),
      "query_norm": ("attention_projections",),
      "key_norm": ("attention_projections",),
      "mlp_in": ("mlp",),
      "mlp_out": ("mlp",),
      "final_norm": ("head",),
    }
    found = frozenset(c for name in names & owners.keys() for c in owners[name])
    if not found:
      raise ValueError(f"No tensor class reads parameter {path!r}.")
    return found

  def head(self, x, head_format: str = "compute"):
    """Logits (FP32) of hidden states x through the tied embedding: in the
    model's compute format ("compute": operands and logits in it, then
    FP32 for the loss, as MaxText casts logits), with FP32 operands
    ("fp32"), or in BF16 with FP32 accumulation and BF16 logits ("bf16",
    as a BF16 inference engine computes them); one of `HEAD_FORMATS`."""
    if head_format not in HEAD_FORMATS:
      raise ValueError(
        f"head_format must be one of {list(HEAD_FORMATS)}, got {head_format!r}."
      )
    hidden = self.final_norm(x)
    table = self.embed.embedding[...]
    if head_format != "bf16":
      dtype = jnp.float32
      if head_format == "compute":
        dtype = self.compute.dtype_of("head")
      logits = jnp.dot(hidden.astype(dtype), table.astype(dtype).T)
      return logits.astype(jnp.float32)
    logits = jnp.einsum(
      "...w,vw->...v",
      hidden.astype(jnp.bfloat16),
      table.astype(jnp.bfloat16),
      preferred_element_type=jnp.float32,
    )
    return logits.astype(jnp.bfloat16).astype(jnp.float32)

  def empty_cache(self, batch: int, dtype=jnp.float32) -> DecodeCache:
    """A KV cache of `max_len` tokens per example, holding none yet."""
    attention = self.blocks[0].attention
    shape = (batch, self.spec.max_len, attention.heads, attention.head_dim)
    buffers = tuple(jnp.zeros(shape, dtype) for _ in self.blocks)
    return DecodeCache(
      buffers,
      tuple(jnp.zeros(shape, dtype) for _ in self.blocks),
      jnp.zeros((batch,), jnp.int32),
    )

  def extend(
    self,
    tokens_BxN,
    cache: DecodeCache,
    attention: AttentionSpec,
    head_format: str = "compute",
  ):
    """Logits [B, N, vocab] of N new tokens appended to the cache, with
    `attention` over it (prefill for N > 1, a decode step for N = 1), and
    the cache holding them. Positions continue each example's length."""
    count = tokens_BxN.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(count)[None]
    x = self.embed(tokens_BxN)
    x = x + self.positions[...][positions].astype(x.dtype)
    x = x.astype(self.compute.dtype_of("residual_stream"))
    keys, values = [], []
    for block, k, v in zip(self.blocks, cache.keys, cache.values):
      x, k, v = block.extend(x, k, v, cache.lengths, attention)
      keys.append(k)
      values.append(v)
    cache = DecodeCache(tuple(keys), tuple(values), cache.lengths + count)
    return self.head(x, head_format), cache
