"""Model sizes as data: their parameters, training plan and drift config.

Two arms of training plans: the tokens-per-parameter arm trains every
size the same tokens per parameter (so a larger model takes more optimizer
steps), the fixed-step arm trains the sizes it names the same number of
steps. A size whose two plans coincide is one unit of work in both arms.
"""

from __future__ import annotations

import dataclasses
import math
import re

from stableattn.harness.config_values import as_tuple

_SIZE = re.compile(r"^w(\d+)-d(\d+)-s(\d+)$")


@dataclasses.dataclass(frozen=True)
class ModelSize:
  """One decoder: width, depth (layers) and context (sequence length)."""

  width: int
  depth: int
  context: int
  mlp_ratio: int = 4

  @classmethod
  def parse(cls, text: str, mlp_ratio: int = 4) -> ModelSize:
    match = _SIZE.match(text.strip())
    if match is None:
      raise ValueError(
        f"size {text!r} is not 'w<width>-d<depth>-s<context>', e.g. "
        "'w128-d4-s64'."
      )
    width, depth, context = (int(g) for g in match.groups())
    if min(width, depth, context) < 1:
      raise ValueError(f"size {text!r}: width, depth and context must be >= 1")
    return cls(width, depth, context, mlp_ratio)

  @property
  def name(self) -> str:
    return f"w{self.width}-d{self.depth}-s{self.context}"

  @property
  def parameters(self) -> int:
    """Non-embedding parameters (Kaplan et al. 2020's N): per layer four
    width x width attention projections and two MLP matrices."""
    return self.depth * (4 + 2 * self.mlp_ratio) * self.width**2

  def flops_per_token(self) -> float:
    """Training FLOPs per token: 6N plus attention's scores and values,
    6 * depth * context * width (Kaplan et al. 2020, Table 1, x3 for the
    backward)."""
    return 6.0 * self.parameters + 6.0 * self.depth * self.context * self.width


TOKENS_PER_PARAMETER = "tokens_per_parameter"
FIXED_STEPS = "fixed_steps"


@dataclasses.dataclass(frozen=True)
class Plan:
  """How long and in what batches one size trains, and in which arms."""

  size: ModelSize
  batch_size: int
  steps: int
  warmup_steps: int
  log_every: int
  arms: tuple[str, ...] = (TOKENS_PER_PARAMETER,)

  @property
  def name(self) -> str:
    """The unit's name: the size's, with its steps where only the
    fixed-step arm trains it."""
    if TOKENS_PER_PARAMETER in self.arms:
      return self.size.name
    return f"{self.size.name}-steps{self.steps}"

  @property
  def tokens(self) -> int:
    return self.steps * self.batch_size * self.size.context

  @property
  def compute(self) -> float:
    """Training FLOPs of one run."""
    return self.tokens * self.size.flops_per_token()


def plan(size: ModelSize, scaling, steps: int | None = None) -> Plan:
  """The same tokens per step at every size, and the same tokens per
  parameter, or `steps` optimizer steps (the fixed-step arm)."""
  tokens_per_step = int(scaling.tokens_per_step)
  if tokens_per_step % size.context:
    raise ValueError(
      f"scaling.tokens_per_step ({tokens_per_step}) must be a multiple of "
      f"every size's context; {size.name} has {size.context}."
    )
  if size.width % int(scaling.head_dim):
    raise ValueError(
      f"size {size.name}: width must be a multiple of scaling.head_dim "
      f"({scaling.head_dim})."
    )
  arms = (TOKENS_PER_PARAMETER,)
  if steps is None:
    steps = math.ceil(
      float(scaling.tokens_per_parameter) * size.parameters / tokens_per_step
    )
  else:
    arms = (FIXED_STEPS,)
  logs = int(scaling.logs)
  if steps < logs:
    raise ValueError(
      f"size {size.name} trains {steps} steps, fewer than scaling.logs "
      f"({logs}); raise scaling.tokens_per_parameter."
    )
  return Plan(
    size=size,
    batch_size=tokens_per_step // size.context,
    steps=steps,
    warmup_steps=max(1, round(float(scaling.warmup_fraction) * steps)),
    log_every=max(1, steps // logs),
    arms=arms,
  )


def plans_of(scaling, mlp_ratio: int) -> list[Plan]:
  """Every unit of work: the tokens-per-parameter arm's sizes, then the
  fixed-step arm's (`scaling.fixed_steps` steps at each of
  `scaling.fixed_step_sizes`; a size already trained that long in the
  first arm is the same unit, in both)."""
  plans = [plan(size, scaling) for size in sizes_of(scaling, mlp_ratio)]
  steps = int(scaling.get("fixed_steps", 0) or 0)
  names = as_tuple(scaling.get("fixed_step_sizes", ""))
  if steps < 0 or (names and not steps):
    raise ValueError(
      f"scaling.fixed_steps={steps} with fixed_step_sizes={list(names)}: "
      "set fixed_steps >= 1 to train those sizes that many steps, or "
      "fixed_step_sizes='' for no fixed-step arm."
    )
  for size in [ModelSize.parse(n, mlp_ratio) for n in dict.fromkeys(names)]:
    shared = [i for i, p in enumerate(plans) if p.size == size]
    if shared and plans[shared[0]].steps == steps:
      plans[shared[0]] = dataclasses.replace(
        plans[shared[0]], arms=(TOKENS_PER_PARAMETER, FIXED_STEPS)
      )
    else:
      plans.append(plan(size, scaling, steps))
  return plans


def sizes_of(scaling, mlp_ratio: int) -> tuple[ModelSize, ...]:
  """The configured sizes, each once, in the configured order."""
  sizes = [ModelSize.parse(s, mlp_ratio) for s in as_tuple(scaling.sizes)]
  names = [s.name for s in sizes]
  repeated = sorted({n for n in names if names.count(n) > 1})
  if repeated:
    raise ValueError(f"scaling.sizes names {repeated} more than once.")
  if not sizes:
    raise ValueError("scaling.sizes is empty; name at least one size.")
  return tuple(sizes)


def drift_config(drift, p: Plan, head_dim: int):
  """The drift study's config for one size: model, batch, schedule and
  tile sizes set from the plan; everything else as configured."""
  c = drift.copy_and_resolve_references()
  size = p.size
  c.model.width = size.width
  c.model.depth = size.depth
  c.model.seq_len = size.context
  c.model.heads = size.width // head_dim
  c.train.batch_size = p.batch_size
  c.train.total_steps = p.steps
  c.train.warmup_steps = p.warmup_steps
  c.train.log_every = p.log_every
  c.train.checkpoint_every = p.log_every
  c.attention.block_q = min(int(c.attention.block_q), size.context)
  c.attention.block_k = min(int(c.attention.block_k), size.context)
  return c
