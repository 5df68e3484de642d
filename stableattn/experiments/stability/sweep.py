"""Training the cells of the sweep: one arm, one learning rate, one
replicate each. A cell is short, so a stopped sweep resumes cell by cell:
cells with a final row are not trained again."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from stableattn.auditing import captures, thresholds
from stableattn.experiments.stability.settings import Arm, Settings
from stableattn.numerics.metrics import signed_share
from stableattn.ops.dispatch import FLASH_IMPLEMENTATIONS
from stableattn.training import data as data_lib
from stableattn.training.trainer import Trainer


def load_tokens(s: Settings) -> tuple[np.ndarray, np.ndarray]:
  """(training tokens, held-out tokens)."""
  if s.corpus == "python_stdlib":
    train, held_out = data_lib.stdlib_corpus()
  else:
    train = held_out = data_lib.generate_corpus(s.corpus_tokens, s.data_seed)
  data_lib.check_length(train, s.seq_len)
  data_lib.check_length(held_out, s.seq_len)
  return train, held_out


def spectral_norms(params, heads: int) -> list[list[float]]:
  """Largest singular value of each head's block of W_Q, per layer."""
  out = []
  for block in params["blocks"].values():
    w = np.asarray(block.attention.query.kernel[...], np.float64)
    per_head = w.reshape(w.shape[0], heads, -1).transpose(1, 0, 2)
    out.append([float(np.linalg.norm(h, 2)) for h in per_head])
  return out


def delta_signed_shares(trainer, state, batch) -> list[float]:
  """Per layer, the signed share of delta's error (+1: every error points
  away from zero, Qiu & Yao's bias; about 0: unbiased)."""
  return [
    signed_share(np.asarray(exact), np.asarray(ours))
    for exact, ours in jax.device_get(trainer.deltas(state, batch))
  ]


def _log_row(trainer, state, eval_batch, heads: int, calibration=None) -> dict:
  logits, loss, layer_stats = trainer.evaluate(state, eval_batch)
  log_z = np.asarray(jax.nn.logsumexp(logits, axis=-1), np.float64)
  stats = jax.device_get(layer_stats)
  extra = {}
  if calibration is not None:
    # The calibrated kernels whose 2-D map holds one of the heads.
    extra["map_kernels"] = sorted(
      {
        kernel
        for layer in stats
        for logit, share in zip(
          layer["max_logit_per_head"], layer["near_tied_share_per_head"]
        )
        for kernel in thresholds.kernels_missing_at(
          float(logit), calibration, float(share)
        )
      }
    )
  spectral = spectral_norms(state.params, heads)
  shares = delta_signed_shares(trainer, state, eval_batch)
  return {
    "delta_signed_share": shares,
    "delta_signed_share_mean": float(np.mean(shares)),
    "eval_loss": float(loss),
    "max_logit": max(float(x["max_logit"]) for x in stats),
    "tied_max_share": float(np.mean([x["tied_max_share"] for x in stats])),
    "near_tied_share": max(float(x["near_tied_share"]) for x in stats),
    "log_z_mean": float(np.mean(log_z)),
    "log_z_max": float(np.max(log_z)),
    "wq_spectral": spectral,
    "wq_spectral_max": max(max(layer) for layer in spectral),
    # Per layer, one value per head: the monitor's verdict reads them.
    **{
      f"{name}_per_head": [
        np.asarray(layer[f"{name}_per_head"], np.float64).tolist()
        for layer in stats
      ]
      for name in ("max_logit", "near_tied_share")
    },
    **extra,
  }


def _capture(trainer, state, s: Settings, tokens, step, replicate, folder):
  """Every layer's q, k, v and dO on the batch of the next update."""
  batch = data_lib.settings_batch(tokens, s, step, replicate)[: s.capture_rows]
  layers = trainer.capture(state, jnp.asarray(batch))
  attention = trainer.run.attention
  captures.save_layers(
    folder,
    step,
    layers,
    features={"causal": True},
    metadata={
      "attention": attention.kind,
      "policy": attention.options.precision.name,
      "training_format": trainer.run.compute_format.record(),
      "model": dataclasses.asdict(s.model),
      "batch_rows": len(batch),
    },
  )


class _CapturePlan:
  """When a cell saves its tensors to `folder` (none: never): once, at
  the first logging step whose largest logit reaches `logit` (> 0); or
  at up to `map_steps` logging steps, the first and each where the
  calibrated kernels whose 2-D map holds one of its heads change."""

  def __init__(self, folder, logit: float, map_steps: int):
    self.folder, self.logit, self.map_steps = folder, logit, map_steps
    self.calibration = thresholds.load() if map_steps else None
    self.taken, self.last_map = 0, None

  def due(self, row: dict) -> bool:
    if self.folder is None:
      return False
    on_map, last = row.get("map_kernels"), self.last_map
    self.last_map = on_map
    if self.map_steps and self.taken < self.map_steps:
      if last is None or on_map != last:
        self.taken += 1
        return True
    if self.logit and row["max_logit"] >= self.logit:
      self.folder = None  # once per cell
      return True
    return False


def train_cell(
  trainer,
  s: Settings,
  arm: Arm,
  lr: float,
  replicate: int,
  tokens,
  eval_batch,
  capture_dir=None,
):
  """Rows of one cell: a "log" row every `log_every` steps and a "final"
  row. A run whose training loss is not finite or exceeds the divergence
  threshold stops there; it is a row (diverged, with its step), not an
  error, and its final loss is the clip value. With `capture_dir`, the
  first logging step whose largest logit reaches `s.capture_logit` saves
  the attention tensors there (`_capture`); with `s.capture_map`, the
  first logging step and each one where the calibrated kernels whose 2-D
  map holds one of the heads change, up to `s.capture_map` of them."""
  tag = {
    "arm": arm.name,
    "variant": arm.variant,
    "precision": arm.precision,
    "mitigation": arm.mitigation,
    "lr": lr,
    "replicate": replicate,
  }
  heads = s.model.heads
  start = time.perf_counter()
  state = trainer.init_state(replicate)
  rows, diverged_at, train_loss = [], None, float("nan")
  plan = _CapturePlan(capture_dir, s.capture_logit, s.capture_map)
  for step in range(s.steps):
    batch = data_lib.settings_batch(tokens, s, step, replicate)
    state, metrics = trainer.step(state, trainer.shard_batch(batch), lr)
    train_loss = float(metrics["loss"])
    if not math.isfinite(train_loss) or train_loss > s.divergence_loss:
      diverged_at = step + 1
      break
    if (step + 1) % s.log_every == 0 or step + 1 == s.steps:
      row = _log_row(trainer, state, eval_batch, heads, plan.calibration)
      if plan.due(row):
        _capture(trainer, state, s, tokens, step + 1, replicate, capture_dir)
      rows.append(
        {
          "kind": "log",
          **tag,
          "step": step + 1,
          "train_loss": train_loss,
          **row,
        }
      )
  logs = list(rows)
  final_loss = s.clip_loss if diverged_at else rows[-1]["eval_loss"]
  if not math.isfinite(final_loss):
    final_loss, diverged_at = s.clip_loss, diverged_at or s.steps
  rows.append(
    {
      "kind": "final",
      **tag,
      "diverged": diverged_at is not None,
      "diverged_at": diverged_at,
      "last_train_loss": train_loss if math.isfinite(train_loss) else None,
      "final_loss": min(final_loss, s.clip_loss),
      "max_logit_max": max((r["max_logit"] for r in logs), default=None),
      "log_z_max": max((r["log_z_max"] for r in logs), default=None),
      "tied_max_share_max": max(
        (r["tied_max_share"] for r in logs), default=None
      ),
      "near_tied_share_max": max(
        (r["near_tied_share"] for r in logs), default=None
      ),
      "wq_spectral_max": max(
        (r["wq_spectral_max"] for r in logs), default=None
      ),
      # At the last logged step, mean over layers.
      "delta_signed_share": logs[-1]["delta_signed_share_mean"]
      if logs
      else None,
      "steps_trained": diverged_at or s.steps,
      "seconds": time.perf_counter() - start,
    }
  )
  return rows


def sweep(s: Settings, arms, run_dir, done: set) -> None:
  """Trains every cell of `arms` not in `done` ((arm name, lr,
  replicate)); one compiled trainer per arm, shared by its learning rates
  and replicates."""
  tokens, held_out = load_tokens(s)
  eval_batch = data_lib.eval_batch(
    held_out, seed=s.data_seed, batch_size=s.batch_size, seq_len=s.seq_len
  )
  todo = [
    (arm, lr, r)
    for arm in arms
    for r in range(s.replicates)
    for lr in s.learning_rates
    if (arm.name, lr, r) not in done
  ]
  bar = tqdm(total=len(todo), desc="stability sweep", unit="run")
  trainers = {}
  for arm, lr, replicate in todo:
    if arm not in trainers:
      trainers.clear()  # one arm's compiled programs at a time
      model, run = s.runs[arm]
      trainers[arm] = Trainer(model, run, s.optimizer(), s.batch_size)
    trainer = trainers[arm]
    eval_sharded = trainer.shard_batch(eval_batch)
    capture_dir = None
    flash = trainer.run.attention.kind in FLASH_IMPLEMENTATIONS
    name = arm.name.replace("/", "_")
    if s.capture_logit and replicate == 0 and flash:
      capture_dir = run_dir.path / "captures" / f"{name}-lr{lr:g}"
    if s.capture_map and flash:
      cell = f"{name}-lr{lr:g}-r{replicate}"
      capture_dir = run_dir.path / "captures" / cell
    run_dir.append_metrics(
      train_cell(
        trainer, s, arm, lr, replicate, tokens, eval_sharded, capture_dir
      )
    )
    bar.update()
  bar.close()
