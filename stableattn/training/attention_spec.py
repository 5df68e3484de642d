"""How every layer of the model computes attention: a registry name, its
options and features, as one hashable value (`AttentionSpec`)."""

from __future__ import annotations

import dataclasses

from stableattn.contract.features import Features
from stableattn.contract.options import Options
from stableattn.ops import registry
from stableattn.ops.dispatch import FLASH_IMPLEMENTATIONS, attention
from stableattn.ops.flash_choice import always_triton, record_taken
from stableattn.ops.ring import ring_attention
from stableattn.ops.ring_plan import CONTEXT_AXIS, context_mesh

SHADOW = "shadow"
# Kinds that run as ring attention when sharded: the ring's per-shard
# kernel is the Triton path's, which "flash" takes for every request the
# Hopper path does not run.
RING_KINDS = ("pallas", "flash")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """How every layer computes attention: a registry name and its options.

  Attributes:
    kind: a name of `stableattn.ops.registry` ("reference", "pallas",
      "mosaic_gpu", "flash", "xla", a peer, "package.module:function"),
      or "shadow": the flash kernel `shadow_flash` under `options` and
      the baseline under `shadow_baseline`, both computed,
      `shadow_downstream` passed on.
    options: how `kind` computes (`stableattn.Options`); peers ignore it.
    features: what every layer computes (causal; a softcap, a window).
    shadow_baseline: the Options of "shadow"'s baseline (the reference).
    shadow_flash: which of our flash kernels "shadow" computes (the
      flash run's own kind).
    context_parallel: our flash kernel ("pallas" or "flash") runs as
      ring attention
      with the sequence sharded over this many devices (a mesh axis
      "context" of the first devices; `context_mesh`); 1: one device.
  """

  kind: str = "reference"
  options: Options = Options(precision="fp32")
  features: Features = Features(causal=True)
  shadow_baseline: Options = Options(precision="fp32")
  shadow_downstream: str = "reference"  # which output "shadow" passes on
  shadow_flash: str = "pallas"
  context_parallel: int = 1

  def __post_init__(self):
    if not isinstance(self.context_parallel, int) or self.context_parallel < 1:
      raise ValueError(
        f"context_parallel must be an int >= 1 (devices the sequence is "
        f"sharded over), got {self.context_parallel!r}."
      )
    if self.context_parallel > 1 and self.kind not in RING_KINDS:
      raise ValueError(
        f"context_parallel={self.context_parallel} shards our flash kernel "
        f"over a ring; it needs kind 'pallas' or 'flash', got "
        f"{self.kind!r}."
      )
    if self.shadow_flash not in FLASH_IMPLEMENTATIONS:
      raise ValueError(
        f"shadow_flash must be one of {list(FLASH_IMPLEMENTATIONS)}, got "
        f"{self.shadow_flash!r}."
      )
    if self.kind != SHADOW:
      try:
        registry.check_name(self.kind)
      except ValueError as e:
        raise ValueError(
          f"{e} Or {SHADOW!r} (flash beside baseline)."
        ) from None
    if self.shadow_downstream not in ("reference", "pallas"):
      raise ValueError(
        f"shadow_downstream must be 'reference' or 'pallas', got "
        f"{self.shadow_downstream!r}."
      )

  @property
  def kernel_monitors(self) -> bool:
    """Whether our kernel computes the flash output and can give the
    monitor's statistics from its own pass: one device, no split-KV, and
    uncentred keys (center_kv's scores are each row's less q.mean(K))."""
    flash = self.shadow_flash if self.kind == SHADOW else self.kind
    # The statistics come from the Triton path's pass, so only where the
    # run's own kernel is that path.
    triton = flash == "pallas" or (flash == "flash" and always_triton())
    return (
      triton
      and self.context_parallel == 1
      and self.options.num_splits is None
      and self.options.split_size is None
      and not self.options.center_kv
    )

  def flash_with_statistics(self, q, k, v):
    """Our kernel's output and its per-row statistics (lse, largest and
    second largest score; `sa.attention(..., return_statistics=True)`)."""
    return attention(
      q,
      k,
      v,
      implementation="pallas",
      options=self.options,
      features=self.features,
      return_statistics=True,
    )

  def call(self, q, k, v, kind: str | None = None, options=None):
    """Attention of `kind` (default: this spec's) on q, k, v."""
    kind = kind or self.kind
    if kind in RING_KINDS and self.context_parallel > 1:
      if kind == "flash":
        record_taken("pallas")  # the ring's per-shard kernel
      return ring_attention(
        q,
        k,
        v,
        mesh=context_mesh(self.context_parallel),
        axis=CONTEXT_AXIS,
        options=options or self.options,
        features=self.features,
      )
    fn = registry.resolve(kind, options or self.options)
    return fn(q, k, v, **self.features.kwargs())
