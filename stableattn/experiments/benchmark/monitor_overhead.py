"""What the attention monitor costs a training run.

The monitor's statistics (`stableattn.numerics.monitor.attention_statistics`:
largest logit, smallest row LSE, near ties, FP16 underflow, outlier
channels) are computed at logging steps, on the evaluation batch, beside
the evaluation the run does anyway. Their cost per training step is the
evaluation's extra time spread over `log_every` steps; this module times
a training step and an evaluation with and without them, at the sizes
of the benchmark config's `monitor` block (the drift study's defaults:
`configs/training_drift.py`).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from stableattn.contract.options import Options
from stableattn.training.model import AttentionSpec, ModelSpec
from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer


def _median_seconds(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


# Where the statistics come from: our kernel's own pass (its row max,
# runner-up and log-sum-exp), or a second pass over q and k, as for any
# other kernel (here the materialized baseline).
SOURCES = {"kernel": "pallas", "q and k": "reference"}


def measure(sizes, repeats: int = 5, source: str = "kernel") -> dict:
  """One row: step and evaluation times of BF16 training with our flash
  kernel (`source` "kernel") or the baseline ("q and k"), and the
  monitor's share of a step at `sizes.log_every`. `sizes`: width, depth,
  heads, seq_len, batch_size, log_every."""
  model = ModelSpec(
    width=sizes.width, depth=sizes.depth, heads=sizes.heads,
    max_len=sizes.seq_len,
  )  # fmt: skip
  kind = SOURCES[source]
  policy = "bf16-fa2" if kind == "pallas" else "bf16-framework"
  flash = AttentionSpec(
    kind=kind, options=Options(precision=policy, block_q=64, block_k=32)
  )
  trainer = Trainer(
    model, RunSpec(flash, precision="bf16"), OptimizerSpec(), sizes.batch_size
  )
  state = trainer.init_state(0)
  rng = np.random.default_rng(0)
  tokens = trainer.shard_batch(
    rng.integers(0, model.vocab_size, (sizes.batch_size, sizes.seq_len + 1))
    .astype(np.int32)
  )  # fmt: skip

  def evaluate(collect_stats: bool):
    loss = jax.jit(
      lambda params, batch: trainer._next_token_loss(
        trainer.graphdef, params, batch, collect_stats=collect_stats
      )
    )
    return lambda: loss(state.params, tokens)

  step = jax.jit(trainer._step_impl)
  lr = np.float32(1.0)
  step_s = _median_seconds(lambda: step(state, tokens, lr), repeats)
  with_s = _median_seconds(evaluate(True), repeats)
  without_s = _median_seconds(evaluate(False), repeats)
  extra = max(with_s - without_s, 0.0)
  return {
    "kind": "monitor",
    "source": source,
    "device": jax.devices()[0].device_kind,
    "step_ms": 1e3 * step_s,
    "eval_ms_with_monitor": 1e3 * with_s,
    "eval_ms_without_monitor": 1e3 * without_s,
    "log_every": sizes.log_every,
    "overhead_per_step": extra / sizes.log_every / step_s,
    "overhead_at_every_step": extra / step_s,
  }


def overhead_line(row: dict) -> str:
  source = row.get("source", "kernel")
  return (
    f"The attention monitor (statistics from {source}) at the drift "
    f"study's default sizes: a training "
    f"step {row['step_ms']:.1f} ms; an evaluation "
    f"{row['eval_ms_without_monitor']:.1f} ms without the statistics and "
    f"{row['eval_ms_with_monitor']:.1f} ms with "
    f"them; logged every {row['log_every']} steps, "
    f"{100 * row['overhead_per_step']:.2f}% of training time "
    f"({100 * row['overhead_at_every_step']:.1f}% if logged at every step)."
  )
