"""A small decoder-only transformer (flax.nnx), attention chosen by name.

Pre-norm blocks (RMSNorm computed in FP32), learned absolute positions, a
GELU MLP, and tied input/output embeddings. Attention is one of:
  * any name of `stableattn.attention_fns`: "reference" (materialized
    baseline attention), "pallas" (our flash kernel), "xla"
    (`jax.nn.dot_product_attention`), a peer ("cudnn", "jax_mha", ...), or
    a user's kernel as "package.module:function",
  * "shadow": computes both flash and baseline on the same inputs, passes one
    of them downstream (`shadow_downstream`) and, when statistics are
    collected, reports their per-layer deviation (Golden et al. ran both
    attentions inside the model the same way).
With `collect_stats=True` every layer also reports its largest attention
logit, the mean entropy of its attention rows and the share of rows whose
largest logit is tied (Qiu & Yao's biased rounding starts there).

Stability options (Wortsman et al., arXiv 2309.14322): `ModelSpec.qk_norm`
normalizes each head's queries and keys (RMSNorm over the head dim, with
a learned scale) before attention, which bounds the logits;
a softcap among `AttentionSpec.features` caps them (softcap * tanh(s /
softcap), Gemma 2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from stableattn import attention_fns
from stableattn.features import Features
from stableattn.options import Options

SHADOW = "shadow"
FP32 = Options(precision="fp32")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """How every layer computes attention: a registry name and its options.

  Attributes:
    kind: a name of `stableattn.attention_fns` ("reference", "pallas",
      "xla", a peer, "package.module:function"), or "shadow": the flash
      kernel under `options` and the baseline under `shadow_baseline`,
      both computed, `shadow_downstream` passed on.
    options: how `kind` computes (`stableattn.Options`); peers ignore it.
    features: what every layer computes (causal; a softcap, a window).
    shadow_baseline: the Options of "shadow"'s baseline (the reference).
  """

  kind: str = "reference"
  options: Options = Options(precision="fp32")
  features: Features = Features(causal=True)
  shadow_baseline: Options = Options(precision="fp32")
  shadow_downstream: str = "reference"  # which output "shadow" passes on

  def __post_init__(self):
    if self.kind != SHADOW:
      try:
        attention_fns.check_name(self.kind)
      except ValueError as e:
        raise ValueError(
          f"{e} Or {SHADOW!r} (flash beside baseline)."
        ) from None
    if self.shadow_downstream not in ("reference", "pallas"):
      raise ValueError(
        f"shadow_downstream must be 'reference' or 'pallas', got "
        f"{self.shadow_downstream!r}."
      )

  def call(self, q, k, v, kind: str | None = None, options=None):
    """Attention of `kind` (default: this spec's) on q, k, v."""
    fn = attention_fns.resolve(kind or self.kind, options or self.options)
    return fn(q, k, v, **self.features.kwargs())


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  vocab_size: int = 256
  width: int = 128
  depth: int = 4
  heads: int = 4
  max_len: int = 128
  mlp_ratio: int = 4
  qk_norm: bool = False  # RMSNorm of each head's q and k (Wortsman et al.)


def attention_statistics(q_BxTxHxD, k_BxTxHxD):
  """Largest logit, mean row entropy and the share of rows (with two keys
  or more) whose largest logit is tied, of causal attention; logits in
  FP32 from q and k as given (a flash kernel's FP32 scores)."""
  q = jax.lax.stop_gradient(q_BxTxHxD).astype(jnp.float32)
  k = jax.lax.stop_gradient(k_BxTxHxD).astype(jnp.float32)
  s = jnp.einsum("bthd,bshd->bhts", q, k) * q.shape[-1] ** -0.5
  length = s.shape[-1]
  causal = jnp.tril(jnp.ones((length, length), dtype=bool))
  s = jnp.where(causal, s, -jnp.inf)
  log_p = jax.nn.log_softmax(s, axis=-1)
  entropy = -jnp.sum(jnp.where(causal, jnp.exp(log_p) * log_p, 0.0), -1)
  at_max = jnp.sum(s == jnp.max(s, axis=-1, keepdims=True), axis=-1)
  tied = jnp.mean((at_max[..., 1:] > 1).astype(jnp.float32))
  return {
    "max_logit": jnp.max(s),
    "entropy": jnp.mean(entropy),
    "tied_max_share": tied,
  }


class RMSNorm(nnx.Module):
  def __init__(self, width: int):
    self.scale = nnx.Param(jnp.ones((width,), jnp.float32))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-6)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class SelfAttention(nnx.Module):
  def __init__(
    self, spec: ModelSpec, attention_spec: AttentionSpec, *, rngs: nnx.Rngs
  ):
    self.heads = spec.heads
    self.head_dim = spec.width // spec.heads
    self.attention_spec = attention_spec

    def linear():
      return nnx.Linear(spec.width, spec.width, use_bias=False, rngs=rngs)

    self.query, self.key, self.value, self.out = (linear() for _ in range(4))
    if spec.qk_norm:
      self.query_norm = RMSNorm(self.head_dim)
      self.key_norm = RMSNorm(self.head_dim)
    self.qk_norm = spec.qk_norm

  def __call__(self, x_BxTxW, collect_stats: bool = False, probe_tap=None):
    """Output and statistics. `probe_tap` ([B, T, H, D], zeros) is added to
    the attention output, so its gradient is dO; with it the statistics
    hold this attention's output and FP32 attention's on the same q, k, v
    (arrays, for `Trainer.deltas`)."""
    batch, length, width = x_BxTxW.shape
    shape = (batch, length, self.heads, self.head_dim)
    q = self.query(x_BxTxW).reshape(shape)
    k = self.key(x_BxTxW).reshape(shape)
    v = self.value(x_BxTxW).reshape(shape)
    if self.qk_norm:
      q, k = self.query_norm(q), self.key_norm(k)
    spec = self.attention_spec
    stats = {}
    if spec.kind == SHADOW:
      flash = spec.call(q, k, v, "pallas")
      base = spec.call(q, k, v, "reference", spec.shadow_baseline)
      out = flash if spec.shadow_downstream == "pallas" else base
      if collect_stats:
        diff = jnp.abs(flash.astype(jnp.float32) - base.astype(jnp.float32))
        stats["shadow_max_abs"] = jnp.max(diff)
        stats["shadow_rel_l2"] = jnp.linalg.norm(diff) / jnp.linalg.norm(
          base.astype(jnp.float32)
        )
    else:
      out = spec.call(q, k, v)
    if collect_stats:
      stats.update(attention_statistics(q, k))
    if probe_tap is not None:
      stats["out"] = out
      stats["out_fp32"] = spec.call(q, k, v, "reference", FP32)
      out = out + probe_tap.astype(out.dtype)
    out = out.astype(x_BxTxW.dtype).reshape(batch, length, width)
    return self.out(out), stats


class Block(nnx.Module):
  def __init__(
    self, spec: ModelSpec, attention_spec: AttentionSpec, *, rngs: nnx.Rngs
  ):
    self.attention_norm = RMSNorm(spec.width)
    self.attention = SelfAttention(spec, attention_spec, rngs=rngs)
    self.mlp_norm = RMSNorm(spec.width)
    hidden = spec.mlp_ratio * spec.width
    self.mlp_in = nnx.Linear(spec.width, hidden, rngs=rngs)
    self.mlp_out = nnx.Linear(hidden, spec.width, rngs=rngs)

  def __call__(self, x, collect_stats: bool = False, probe_tap=None):
    attended, stats = self.attention(
      self.attention_norm(x), collect_stats, probe_tap
    )
    x = x + attended
    x = x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))
    return x, stats


class Transformer(nnx.Module):
  def __init__(
    self, spec: ModelSpec, attention_spec: AttentionSpec, *, rngs: nnx.Rngs
  ):
    self.spec = spec
    self.embed = nnx.Embed(spec.vocab_size, spec.width, rngs=rngs)
    self.positions = nnx.Param(
      0.02 * jax.random.normal(rngs.params(), (spec.max_len, spec.width))
    )
    self.blocks = nnx.List(
      [Block(spec, attention_spec, rngs=rngs) for _ in range(spec.depth)]
    )
    self.final_norm = RMSNorm(spec.width)

  def __call__(self, tokens_BxT, collect_stats: bool = False, probe_taps=None):
    """Logits [B, T, vocab] (FP32) and per-layer statistics; `probe_taps`:
    one per layer, see `SelfAttention`."""
    length = tokens_BxT.shape[1]
    if length > self.spec.max_len:
      raise ValueError(
        f"sequence length {length} exceeds the model's max_len "
        f"{self.spec.max_len}."
      )
    x = self.embed(tokens_BxT)
    x = x + self.positions[:length].astype(x.dtype)
    layer_stats = []
    taps = probe_taps or [None] * len(self.blocks)
    for block, tap in zip(self.blocks, taps):
      x, stats = block(x, collect_stats, tap)
      layer_stats.append(stats)
    logits = self.embed.attend(self.final_norm(x))
    return logits.astype(jnp.float32), layer_stats
