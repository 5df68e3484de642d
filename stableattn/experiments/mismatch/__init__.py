"""The training-inference mismatch experiment: how much of the sampler's
disagreement with the trainer does attention cause?

  python launch/mismatch.py --workdir=runs/mismatch \
      [--config=smoke]

It trains the byte-level model (or loads the one it trained before, from
the run directory), then for each pair (`pairs.PAIRS`) and seed samples
continuations of held-out prompts with the pair's sampler path (a KV
cache, one decode step per token) and scores the same tokens with its
trainer path, with identical weights. Each (pair, seed) is one row of
metrics.jsonl holding every sequence's metrics, so a stopped run resumes
where it stopped and a rerun redoes nothing. The report gives every pair's
mismatch with intervals over prompts and seeds, every subject divided by
every reference (paired by prompt and seed), and verdicts computed from
the rows.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx

from stableattn.contract.options import Options
from stableattn.experiments.mismatch import policy_gradient, report
from stableattn.experiments.mismatch.pairs import Pair, resolve
from stableattn.harness import environment
from stableattn.harness.config_values import field
from stableattn.harness.rundir import RunDir, opened
from stableattn.numerics import monitor
from stableattn.training import data, rollout
from stableattn.training.model import AttentionSpec, ModelSpec
from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer

MODEL_FILE = "checkpoints/mismatch_model.npz"


@dataclasses.dataclass(frozen=True)
class Settings:
  model: ModelSpec
  train_steps: int
  train_batch: int
  learning_rate: float
  prompts: int
  prompt_len: int
  new_tokens: int
  seeds: int
  pairs: tuple[Pair, ...]
  tis_threshold: float
  rl: RLSettings


@dataclasses.dataclass(frozen=True)
class RLSettings:
  """The policy-gradient run (`policy_gradient.py`)."""

  arms: tuple[policy_gradient.Arm, ...]
  replicates: int
  steps: int
  prompts: int  # per step; each sampled `group` times
  group: int
  prompt_len: int
  new_tokens: int
  learning_rate: float
  target_byte: int
  tis_cap: float


def settings_from_config(c) -> Settings:
  model = ModelSpec(
    width=field(c.model, "width", minimum=8),
    depth=field(c.model, "depth", minimum=1),
    heads=field(c.model, "heads", minimum=1),
    max_len=field(c.model, "max_len", minimum=2),
  )
  s = Settings(
    model=model,
    train_steps=field(c.train, "steps", minimum=0),
    train_batch=field(c.train, "batch", minimum=1),
    learning_rate=float(c.train.learning_rate),
    prompts=field(c.sample, "prompts", minimum=2),
    prompt_len=field(c.sample, "prompt_len", minimum=1),
    new_tokens=field(c.sample, "new_tokens", minimum=1),
    seeds=field(c.sample, "seeds", minimum=1),
    pairs=resolve(c.pairs),
    tis_threshold=float(c.tis_threshold),
    rl=RLSettings(
      arms=policy_gradient.resolve_arms(c.rl.arms),
      replicates=field(c.rl, "replicates", minimum=0),
      steps=field(c.rl, "steps", minimum=1),
      prompts=field(c.rl, "prompts", minimum=1),
      group=field(c.rl, "group", minimum=2),
      prompt_len=field(c.rl, "prompt_len", minimum=1),
      new_tokens=field(c.rl, "new_tokens", minimum=1),
      learning_rate=float(c.rl.learning_rate),
      target_byte=field(c.rl, "target_byte", minimum=0),
      tis_cap=float(c.tis_threshold),
    ),
  )
  if not s.tis_threshold > 1:
    raise ValueError(
      f"config.tis_threshold must be a cap > 1 on p_train / p_sample "
      f"(Yao et al. use 2), got {s.tis_threshold}."
    )
  for name, rate in (("train", s.learning_rate), ("rl", s.rl.learning_rate)):
    if not rate > 0:
      raise ValueError(f"config.{name}.learning_rate must be > 0, got {rate}.")
  if s.rl.target_byte > 255:
    raise ValueError(
      f"config.rl.target_byte must be a byte (0-255), got {s.rl.target_byte}."
    )
  if s.rl.prompt_len + s.rl.new_tokens > model.max_len:
    raise ValueError(
      f"config.rl: prompt_len {s.rl.prompt_len} + new_tokens "
      f"{s.rl.new_tokens} exceed model.max_len {model.max_len}."
    )
  if s.prompt_len + s.new_tokens > model.max_len:
    raise ValueError(
      f"config.sample: prompt_len {s.prompt_len} + new_tokens "
      f"{s.new_tokens} exceed model.max_len {model.max_len}."
    )
  return s


TRAINING_ATTENTION = AttentionSpec("reference", Options(precision="fp32"))


def trained_model(run_dir: RunDir, s: Settings):
  """The byte-level model, trained in FP32 on the standard library's
  source (the drift experiment's corpus), or loaded from this run."""
  trainer = Trainer(
    s.model,
    RunSpec(attention=TRAINING_ATTENTION),
    OptimizerSpec(
      learning_rate=s.learning_rate,
      warmup_steps=max(1, s.train_steps // 10),
      total_steps=max(1, s.train_steps),
    ),
    s.train_batch,
  )
  state = trainer.init_state(0)
  leaves, treedef = jax.tree.flatten(state.params)
  path = run_dir.path / MODEL_FILE
  if path.exists():
    stored = np.load(path)
    leaves = [stored[f"leaf_{i}"] for i in range(len(leaves))]
    params = jax.tree.unflatten(treedef, leaves)
    return nnx.merge(trainer.graphdef, params), json.loads(str(stored["log"]))
  tokens, _ = data.stdlib_corpus()
  losses = []
  for step in range(s.train_steps):
    batch = data.batch_at(
      tokens,
      seed=0,
      step=step,
      batch_size=s.train_batch,
      seq_len=s.model.max_len,
    )
    state, metrics = trainer.step(state, trainer.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  log = {
    "steps": s.train_steps,
    "first_loss": losses[:1],
    "last_loss": losses[-1:],
  }
  path.parent.mkdir(parents=True, exist_ok=True)
  arrays = {
    f"leaf_{i}": np.asarray(x)
    for i, x in enumerate(jax.tree.leaves(state.params))
  }
  # Written whole or not at all: a run killed here retrains on restart.
  partial = path.with_name(path.name + ".partial.npz")
  np.savez(partial, log=json.dumps(log), **arrays)
  os.replace(partial, path)
  return nnx.merge(trainer.graphdef, state.params), log


def attention_of(model, s: Settings, held_out) -> list[dict]:
  """The monitor's statistics per layer of the trained model on a held-out
  batch (FP32 attention, as it trained)."""
  batch = data.batch_at(
    held_out, seed=1, step=0, batch_size=s.train_batch, seq_len=s.model.max_len
  )
  _, layers = model(jax.numpy.asarray(batch[:, :-1]), collect_stats=True)
  return [monitor.plain(layer) for layer in layers]


def prompts_of(s: Settings, held_out, seed: int) -> np.ndarray:
  """Windows of the held-out corpus: the same prompts for every pair."""
  windows = data.batch_at(
    held_out,
    seed=1_000 + seed,
    step=0,
    batch_size=s.prompts,
    seq_len=s.prompt_len,
  )
  return windows[:, : s.prompt_len]


def measure(model, s: Settings, pair: Pair, prompts, seed: int) -> dict:
  """One (pair, seed): every sequence's mismatch metrics."""
  tokens, log_sample = rollout.generate(
    model,
    prompts,
    s.new_tokens,
    pair.sampler,
    key=jax.random.key(seed),
  )
  log_train = rollout.score(model, tokens, s.prompt_len, pair.trainer)
  per_sequence = [
    rollout.token_metrics(a, b, s.tis_threshold)
    for a, b in zip(np.asarray(log_sample), np.asarray(log_train))
  ]
  log_ratio = np.asarray(log_train, np.float64) - np.asarray(
    log_sample, np.float64
  )
  # Thinking Machines' measure: where greedy decoding with the two paths
  # first writes different bytes (new_tokens where it never does).
  greedy = [
    rollout.generate(
      model,
      prompts,
      s.new_tokens,
      dataclasses.replace(path, mode="decode"),
      greedy=True,
    )[0]
    for path in (pair.sampler, pair.trainer)
  ]
  divergence = rollout.first_divergence(*greedy, s.prompt_len)
  return {
    "pair": pair.name,
    "role": pair.role,
    "seed": seed,
    **{m: [row[m] for row in per_sequence] for m in report.SEQUENCE_METRICS},
    "greedy_divergence": divergence.tolist(),
    "new_tokens": s.new_tokens,
    "log_ratio_histogram": report.histogram(log_ratio.ravel()),
  }


# A rerun may add seeds, pairs, replicates and arms; nothing else.
EXTENDABLE = ("sample.seeds", "pairs", "rl.replicates", "rl.arms")


def run(config, workdir, *, restart: bool = False) -> dict:
  s = settings_from_config(config)
  with opened(workdir, config, restart=restart, extendable=EXTENDABLE) as (
    run_dir,
    _,
  ):
    rows = run_dir.read_metrics()
    done = {(r.get("pair"), r.get("seed")) for r in rows}
    runs_done = {(r.get("arm"), r.get("replicate")) for r in rows}
    model, training_log = trained_model(run_dir, s)
    measured, held_out = 0, None  # the corpus is read only if needed
    for pair in s.pairs:
      for seed in range(s.seeds):
        if (pair.name, seed) in done:
          continue
        if held_out is None:
          _, held_out = data.stdlib_corpus()
        row = measure(model, s, pair, prompts_of(s, held_out, seed), seed)
        run_dir.append_metrics([row])
        rows.append(row)
        measured += 1
    for arm in s.rl.arms:
      for replicate in range(s.rl.replicates):
        if (arm.name, replicate) in runs_done:
          continue
        row = policy_gradient.train_arm(model, arm, replicate, s.rl)
        run_dir.append_metrics([row])
        rows.append(row)
        measured += 1
    chosen = {p.name for p in s.pairs}
    pair_rows = [
      r for r in rows if r.get("pair") in chosen and r["seed"] < s.seeds
    ]
    arms = {a.name for a in s.rl.arms}
    rl_rows = [
      r
      for r in rows
      if r.get("arm") in arms and r["replicate"] < s.rl.replicates
    ]
    if held_out is None:
      _, held_out = data.stdlib_corpus()
    result = report.write_report(
      run_dir,
      s,
      pair_rows,
      training_log,
      rl_rows,
      attention_of(model, s, held_out),
    )
    return {
      "workdir": str(run_dir.path),
      "measured": measured,
      "environment": environment.summary_line(result["environment"]),
      "verdicts": result["verdicts"],
    }
