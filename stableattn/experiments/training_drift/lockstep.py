"""Every run of every replicate, one step at a time, logged together."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from stableattn.auditing import captures
from stableattn.experiments.training_drift import checkpoints, probes
from stableattn.experiments.training_drift.data import batch_at
from stableattn.experiments.training_drift.pairs import BY_NAME, MACHINE_RUN
from stableattn.experiments.training_drift.report import write_report
from stableattn.experiments.training_drift.settings import Settings
from stableattn.experiments.training_drift.snapshots import Snapshots
from stableattn.harness import environment
from stableattn.harness.rundir import RunDir
from stableattn.training import data as data_lib
from stableattn.training.trainer import RunSpec, Trainer


def expected_log_steps(settings: Settings, up_to: int) -> list[int]:
  """The steps at which a run logs, up to and including `up_to`."""
  total = settings.optimizer.total_steps
  steps = list(range(0, up_to + 1, settings.log_every))
  if up_to >= total and total not in steps:
    steps.append(total)
  return steps


def missing_log_steps(settings: Settings, rows, up_to: int) -> list[int]:
  """Logging steps <= up_to whose drift rows are not all in `rows`."""
  present = {
    (r["step"], r["pair"], r.get("replicate"))
    for r in rows
    if r.get("kind") == "drift" and r.get("scope") == "model"
  }
  return [
    step
    for step in expected_log_steps(settings, up_to)
    if any(
      (step, pair, replicate) not in present
      for pair in settings.pairs
      for replicate in range(settings.replicates)
    )
  ]


class Lockstep:
  """The trainers, their states keyed by (run, replicate), and the rows."""

  def __init__(self, settings: Settings, tokens, eval_source, run_dir: RunDir):
    self.s = settings
    self.tokens = tokens
    self.eval_source = eval_source
    self.run_dir = run_dir
    self.replicates = range(settings.replicates)
    self.trainers = {
      name: Trainer(
        settings.model,
        spec,
        settings.optimizer,
        settings.batch_size,
        eval_attention=probes.shadow_of(spec.attention)
        if name in settings.flash_runs
        else None,
      )
      for name, spec in settings.physical_runs.items()
    }
    # Runs that differ only in how they start (another seed, the identical
    # rerun) run one set of executables.
    programs: dict = {}
    for trainer in self.trainers.values():
      first = programs.setdefault(trainer.program_key(), trainer)
      if first is not trainer:
        trainer.share_programs(first)
    self.grad_error = {
      name: probes.AttentionGradError(self.trainers[name])
      for name in (settings.flash_runs if settings.grad_error else ())
    }
    self.states = {
      (name, r): trainer.init_state(r)
      for name, trainer in self.trainers.items()
      for r in self.replicates
    }
    eval_tokens = data_lib.eval_batch(
      eval_source,
      seed=settings.data_seed,
      batch_size=settings.batch_size,
      seq_len=settings.seq_len,
    )
    self.eval_batches = {
      n: t.shard_batch(eval_tokens) for n, t in self.trainers.items()
    }
    self.last_train: dict = {}  # (run, replicate) -> last step's metrics
    self.previous_errors: dict = {}  # (run, replicate) -> grad errors
    self.error_sums: dict = {}  # (run, replicate) -> summed grad errors
    self.batch_shards = None
    self.rows: list[dict] = []
    # The base run on another machine (pair other_machine), if asked for.
    self.machine = (
      Snapshots(run_dir, settings)
      if settings.machine_flags is not None
      else None
    )

  def restore(self) -> int:
    """The step to continue from; keeps the rows logged up to it."""
    start, restored = checkpoints.load_checkpoint(
      self.run_dir.path, self.states
    )
    rows = [
      r
      for r in self.run_dir.read_metrics()
      if start is not None and r["step"] <= start
    ]
    if start is not None:
      missing = missing_log_steps(self.s, rows, start)
      if missing:
        # Only the last checkpoints are kept, so the logged weights of
        # those steps exist nowhere else: train again, deterministically.
        logging.warning(
          "metrics.jsonl lacks the rows of logging steps %s before the "
          "checkpoint at step %d; re-measuring them by training again from "
          "step 0.",
          missing,
          start,
        )
        shutil.rmtree(self.run_dir.path / "checkpoints", ignore_errors=True)
        start, restored, rows = None, None, []
    self.run_dir.rewrite_metrics(rows)
    self.rows = rows
    if restored is not None:
      self.states = {
        key: self.trainers[key[0]].place(state)
        for key, state in restored.items()
      }
    return 0 if start is None else start

  def train(self) -> dict:
    start = self.restore()
    if self.machine is None:
      return self._train(start)
    # The other machine's run trains in a child while this process
    # compiles; a failure here stops it.
    self.machine.start(self.steps_to_log(start))
    try:
      result = self._train(start)
    except BaseException:
      self.machine.abandon()
      raise
    self.machine.wait()
    return result

  def _train(self, start: int) -> dict:
    manager = checkpoints.checkpoint_manager(self.run_dir)
    started = time.time()
    if start == 0 and not self.rows:
      self.log(0)
    if start == 0 and 0 in self.s.capture_steps:
      self.capture(0)
    total = self.s.optimizer.total_steps
    for step in tqdm(
      range(start + 1, total + 1),
      desc="training drift",
      unit="step",
      mininterval=1.0,
      initial=start,
      total=total,
    ):
      self.step(step)
      if step % self.s.log_every == 0 or step == total:
        self.log(step)
      if step in self.s.capture_steps:
        self.capture(step)
      stop_here = step == self.s.stop_at_step
      if step % self.s.checkpoint_every == 0 or step == total or stop_here:
        checkpoints.save(manager, step, self.states)
      if stop_here:
        return {"workdir": str(self.run_dir.path), "stopped_at_step": step}
    return self.finish(started)

  def steps_to_log(self, start: int) -> list[int]:
    """The logging steps a run resumed at `start` has still to log."""
    total = self.s.optimizer.total_steps
    return [
      step
      for step in expected_log_steps(self.s, total)
      if step > start or (step == 0 and not self.rows)
    ]

  def finish(self, started: float) -> dict:
    """The report and the headline of a finished run."""
    env = environment.describe(
      corpus=environment.corpus_digest(self.tokens, self.eval_source)
    )
    headline = write_report(self.run_dir, self.s, self.rows, env)
    if self.machine is not None:
      self.machine.remove()
    physical = self.s.physical_runs
    headline = {
      "workdir": str(self.run_dir.path),
      "runs": list(physical),
      "replicates": self.s.replicates,
      "devices": {n: spec.devices for n, spec in physical.items()},
      "batch_shards": self.batch_shards,
      **headline,
    }
    self.run_dir.write_text(
      "headline.json", json.dumps(headline, indent=2, default=str) + "\n"
    )
    return {**headline, "seconds": time.time() - started}

  def step(self, step: int) -> None:
    """One optimizer step of every run of every replicate."""
    for replicate in self.replicates:
      tokens_now = batch_at(self.tokens, self.s, step, replicate)
      for name, trainer in self.trainers.items():
        sharded = trainer.shard_batch(tokens_now)
        if name == "base":
          self.batch_shards = [
            tuple(s.data.shape) for s in sharded.addressable_shards
          ]
        key = (name, replicate)
        self.states[key], metrics = trainer.step(self.states[key], sharded)
        _check_finite(self.run_dir, trainer.run, key, step, metrics)
        self.last_train[key] = {
          "train_loss": float(metrics["loss"]),
          "grad_norm": float(metrics["grad_norm"]),
          "loss_scale": float(metrics["loss_scale"]),
          "finite_grads": bool(metrics["finite_grads"]),
        }

  def capture(self, step: int) -> None:
    """Saves every attention layer's q, k, v and dO of the flash run (the
    base run without one), first replicate, on the batch the next update
    trains on (its first `capture_rows` rows), under captures/."""
    name = next(iter(self.s.flash_runs), "base")
    trainer, replicate = self.trainers[name], self.replicates[0]
    tokens = batch_at(self.tokens, self.s, step + 1, replicate)
    tokens = tokens[: self.s.capture_rows]
    layers = trainer.capture(self.states[name, replicate], jnp.asarray(tokens))
    attention = trainer.run.attention
    captures.save_layers(
      self.run_dir.path / "captures",
      step,
      layers,
      keep=self.s.capture_layers,
      features={"causal": True},
      metadata={
        "run": name,
        "replicate": replicate,
        "attention": attention.kind,
        "policy": attention.options.precision.name,
        "training_format": trainer.run.compute_format.record(),
        "model": dataclasses.asdict(self.s.model),
        "batch_rows": len(tokens),
      },
    )

  def log(self, step: int) -> None:
    new = []
    for replicate in self.replicates:
      new += self.probe(step, replicate)
    self.run_dir.append_metrics(new)
    self.rows.extend(new)

  def probe(self, step: int, replicate: int) -> list[dict]:
    """Every row of one logging step of one replicate."""
    tag = {"replicate": replicate, "step": step}
    evals = {
      name: trainer.evaluate(
        self.states[name, replicate], self.eval_batches[name]
      )
      for name, trainer in self.trainers.items()
    }
    rows = []
    for name, (_, loss, layer_stats) in evals.items():
      last = self.last_train.get((name, replicate), {})
      rows += probes.run_rows(name, tag, loss, layer_stats, last)
    # Qiu & Yao's second ingredient: is the attention-gradient error of a
    # flash run aligned from one step to the next, and low-rank? Measured
    # on the batch the next update trains on.
    for name, probe in self.grad_error.items():
      trainer = self.trainers[name]
      batch = trainer.shard_batch(
        batch_at(self.tokens, self.s, step + 1, replicate)
      )
      new, errors = probes.grad_error_rows(
        probe,
        self.states[name, replicate],
        batch,
        name,
        tag,
        self.previous_errors.get((name, replicate)),
        self.error_sums.get((name, replicate)),
      )
      rows += new
      self.previous_errors[name, replicate] = errors
      earlier = self.error_sums.get((name, replicate), {})
      self.error_sums[name, replicate] = {
        w: e + earlier.get(w, 0.0) for w, e in errors.items()
      }
    params = {
      n: jax.device_get(self.states[n, replicate].params) for n in self.trainers
    }
    if self.machine is not None:
      evals[MACHINE_RUN], params[MACHINE_RUN] = self.machine.load(
        step, replicate, params["base"]
      )
    for pair in self.s.pairs:
      a, b = (self.s.physical_name(r) for r in BY_NAME[pair].runs)
      rows += probes.pair_rows(
        pair, tag, evals[a], evals[b], params[a], params[b]
      )
    return rows


def _check_finite(run_dir: RunDir, spec: RunSpec, key, step: int, metrics):
  """Stops the experiment at the first non-finite loss or parameter."""
  name, replicate = key
  loss = float(metrics["loss"])
  if np.isfinite(loss) and bool(metrics["finite_params"]):
    return
  row = {
    "kind": "nonfinite",
    "run": name,
    "replicate": replicate,
    "step": step,
    "loss": loss,
  }
  run_dir.append_metrics([row])
  what = (
    f"training loss is {loss} at step {step}, computed with the "
    f"parameters after step {step - 1}'s update"
    if not np.isfinite(loss)
    else f"the update of step {step} made the parameters non-finite "
    f"(its loss, {loss}, was still finite)"
  )
  raise FloatingPointError(
    f"Run {name!r} replicate {replicate} ({spec.precision}, attention "
    f"{spec.attention.kind}): {what}. The row is in {run_dir.metrics_path}."
  )
