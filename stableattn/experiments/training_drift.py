"""Training-drift experiment (Golden et al., Figs. 7-8).

Trains several runs of the same transformer in lockstep on one data stream
and, at every logging step, measures how far each pair's weights have
drifted apart. Every pair is measured in several replicates: each replicate
has its own shared initialization and its own data order, so a ratio
between pairs comes with an interval rather than resting on one seed.
Pairs:
  * flash_vs_baseline — same init and data, Flash vs Baseline attention;
  * different_seed — another initialization (the accepted lower reference);
  * bf16_vs_fp32, fp16_vs_fp32, fp16_vs_bf16 — low-precision training
    (the upper reference; the paper's Fig. 8 lists FP16 vs BF16);
  * identical_rerun — the same run twice: a control that must be 0;
  * flash_fix_vs_flash — Flash with and without Qiu & Yao's tie fix;
  * one_vs_n_devices — 1 device vs N (reduction order), when N > 1.
Runs that coincide (the base run *is* the bf16 run when training in BF16)
are trained once. Replicates share each run's compiled step and advance
together, one step at a time; a vmap over replicates would be one program,
but on the CPU it measured 2.5-4x slower than stepping them one after the
other. All runs are checkpointed together with Orbax; a restarted run
resumes from the last checkpoint and continues bitwise identically.
"""

from __future__ import annotations

import dataclasses
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from tqdm.auto import tqdm

from stableattn import data as data_lib
from stableattn.dispatch import check_tie_beta, xla_unsupported_reason
from stableattn.drift import attention_grad_error_rows, param_drift
from stableattn.experiments.config_values import as_tuple, field
from stableattn.experiments.drift_report import write_report
from stableattn.experiments.rundir import RunDir
from stableattn.model import ATTENTION_KINDS, AttentionSpec, ModelSpec
from stableattn.precision import Precision, natural_policy, preset_names
from stableattn.training import (
  COMPUTE_DTYPES,
  OptimizerSpec,
  RunSpec,
  Trainer,
  TrainState,
)

PAIRS = {
  "flash_vs_baseline": ("base", "flash"),
  "different_seed": ("base", "seed"),
  "bf16_vs_fp32": ("fp32", "bf16"),
  "fp16_vs_fp32": ("fp32", "fp16"),
  "fp16_vs_bf16": ("bf16", "fp16"),
  "identical_rerun": ("base", "rerun"),
  "one_vs_n_devices": ("base", "one_device"),
  "flash_fix_vs_flash": ("flash", "flash_fixed"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
  model: ModelSpec
  optimizer: OptimizerSpec
  runs: dict  # logical run name -> RunSpec
  pairs: tuple[str, ...]
  replicates: int
  batch_size: int
  seq_len: int
  log_every: int
  checkpoint_every: int
  stop_at_step: int
  data_seed: int
  data_path: str
  corpus: str  # "generated" or "python_stdlib" (when data_path is "")
  corpus_tokens: int
  grad_error: bool  # measure flash runs' attention-gradient error
  compare: str  # "natural": each kernel's own policy; "shared": Flash's

  @property
  def physical_runs(self) -> dict[str, RunSpec]:
    """One entry per distinct RunSpec (first logical name wins)."""
    out = {}
    for name, spec in self.runs.items():
      if spec not in out.values():
        out[name] = spec
    return out

  def physical_name(self, logical: str) -> str:
    spec = self.runs[logical]
    return next(n for n, s in self.physical_runs.items() if s == spec)


COMPARE_MODES = ("natural", "shared")


def _policy(
  name: str, implementation: str, precision: str, compare: str = "natural"
) -> str:
  """The attention policy of a run: `name`, or for 'auto' the kernel's
  natural policy at the training format ('shared': Flash's for both)."""
  if name != "auto":
    if name not in preset_names():
      raise ValueError(
        f"Unknown attention precision {name!r}; valid: 'auto' or "
        f"{preset_names()}."
      )
    return name
  kernel = (
    "flash" if implementation == "pallas" or compare == "shared" else "baseline"
  )
  return natural_policy(precision, kernel)


def settings_from_config(config) -> Settings:
  """Validates the ConfigDict (fails fast) and builds typed settings."""
  c = config
  precision = c.train.precision
  if precision not in COMPUTE_DTYPES:
    raise ValueError(
      f"Unknown training precision {precision!r}; valid: "
      f"{list(COMPUTE_DTYPES)}."
    )
  for kind in (c.attention.baseline, c.attention.flash):
    if kind not in ATTENTION_KINDS:
      raise ValueError(
        f"Unknown attention {kind!r}; valid: {', '.join(ATTENTION_KINDS)}."
      )
  devices = field(c, "train.devices", minimum=0) or jax.local_device_count()
  pairs = as_tuple(c.pairs)
  unknown = [p for p in pairs if p not in PAIRS]
  if unknown:
    raise ValueError(f"Unknown pairs {unknown}; valid: {list(PAIRS)}.")
  if devices == 1:
    pairs = tuple(p for p in pairs if p != "one_vs_n_devices")
  batch_size = field(c, "train.batch_size", minimum=1)
  if batch_size % devices:
    raise ValueError(
      f"train.batch_size {batch_size} is not divisible by the device count "
      f"{devices}."
    )
  seq_len = field(c, "model.seq_len", minimum=2)
  model = ModelSpec(
    vocab_size=field(c, "model.vocab_size", minimum=2),
    width=field(c, "model.width", minimum=1),
    depth=field(c, "model.depth", minimum=1),
    heads=field(c, "model.heads", minimum=1),
    max_len=seq_len,
    mlp_ratio=field(c, "model.mlp_ratio", minimum=1),
  )
  if model.width % model.heads:
    raise ValueError(
      f"model.width {model.width} is not divisible by "
      f"model.heads {model.heads}."
    )

  compare = str(c.attention.compare)
  if compare not in COMPARE_MODES:
    raise ValueError(
      f"config.attention.compare: unknown {compare!r}; valid: "
      f"{list(COMPARE_MODES)}."
    )
  flash_beta = field(c, "attention.tie_beta", float) or None
  fix_beta = field(c, "attention.fix_beta", float)
  try:
    check_tie_beta(flash_beta)
    check_tie_beta(fix_beta)
  except ValueError as e:
    raise ValueError(f"attention.tie_beta / attention.fix_beta: {e}") from None

  def run(implementation, run_precision, tie_beta=None, **kwargs) -> RunSpec:
    attention = AttentionSpec(
      kind=implementation,
      flash_precision=_policy(
        c.attention.flash_precision, "pallas", run_precision
      ),
      baseline_precision=_policy(
        c.attention.baseline_precision, "reference", run_precision, compare
      ),
      block_q=field(c, "attention.block_q", minimum=1),
      block_k=field(c, "attention.block_k", minimum=1),
      scheme=c.attention.scheme,
      tie_beta=tie_beta if implementation == "pallas" else None,
    )
    return RunSpec(
      attention=attention,
      precision=run_precision,
      devices=kwargs.pop("devices", devices),
      **kwargs,
    )

  base = c.attention.baseline
  runs = {
    "base": run(base, precision),
    "flash": run(c.attention.flash, precision, flash_beta),
    "flash_fixed": run(c.attention.flash, precision, fix_beta),
    "seed": run(base, precision, init_seed=1),
    "rerun": run(base, precision, replica=1),
    "fp32": run(base, "fp32"),
    "bf16": run(base, "bf16"),
    "fp16": run(base, "fp16"),
    "one_device": run(base, precision, devices=1),
  }
  needed = {r for p in pairs for r in PAIRS[p]}
  runs = {n: s for n, s in runs.items() if n in needed}
  for name, spec in runs.items():
    if spec.attention.kind == "xla":
      reason = xla_unsupported_reason(
        Precision.from_name(spec.attention.baseline_precision)
      )
      if reason:
        raise ValueError(
          f"run {name!r} ({spec.precision} training with attention 'xla', "
          f"needed by pairs {list(pairs)}): {reason}"
        )
  total = field(c, "train.total_steps", minimum=1)
  if total <= field(c, "train.warmup_steps", minimum=0):
    raise ValueError(
      f"train.total_steps ({total}) must exceed train.warmup_steps "
      f"({c.train.warmup_steps}): the cosine decay needs at least one step."
    )
  optimizer = OptimizerSpec(
    learning_rate=field(c, "train.learning_rate", float),
    warmup_steps=field(c, "train.warmup_steps", minimum=0),
    total_steps=total,
    weight_decay=field(c, "train.weight_decay", float),
    clip_norm=field(c, "train.clip_norm", float),
  )
  return Settings(
    model=model,
    optimizer=optimizer,
    runs=runs,
    pairs=pairs,
    replicates=field(c, "train.replicates", minimum=1),
    batch_size=batch_size,
    seq_len=seq_len,
    log_every=field(c, "train.log_every", minimum=1),
    checkpoint_every=field(c, "train.checkpoint_every", minimum=1),
    stop_at_step=field(c, "train.stop_at_step", minimum=0),
    data_seed=field(c, "data.seed", minimum=0),
    data_path=str(c.data.path),
    corpus=_corpus(c),
    corpus_tokens=field(c, "data.corpus_tokens", minimum=1),
    grad_error=bool(c.train.grad_error),
    compare=compare,
  )


CORPORA = ("generated", "python_stdlib")


def _corpus(c) -> str:
  corpus = str(c.data.corpus)
  if corpus not in CORPORA:
    raise ValueError(
      f"config.data.corpus: unknown {corpus!r}; valid: {list(CORPORA)} (or "
      "set data.path to your own tokens)."
    )
  return corpus


def load_data(s: Settings) -> tuple[np.ndarray, np.ndarray]:
  """(training tokens, evaluation tokens).

  The standard-library corpus evaluates on held-out files; the generated
  corpus and users' files draw the evaluation batch from their one stream.
  """
  if s.data_path:
    train = held_out = data_lib.load_tokens(s.data_path, s.model.vocab_size)
  elif s.corpus == "python_stdlib":
    train, held_out = data_lib.stdlib_corpus()
  else:
    train = held_out = data_lib.generate_corpus(s.corpus_tokens, s.data_seed)
  data_lib.check_length(train, s.seq_len)
  data_lib.check_length(held_out, s.seq_len)
  return train, held_out


def _checkpoint_manager(run_dir: RunDir) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
    (run_dir.path / "checkpoints").resolve(),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=2, create=True, enable_async_checkpointing=False
    ),
  )


def _leaf_key(run: str, replicate: int) -> str:
  return f"{run}.replicate{replicate}"


def _as_leaves(states: dict[tuple[str, int], TrainState]) -> dict:
  return {
    _leaf_key(*key): {
      f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(state))
    }
    for key, state in states.items()
  }


def _from_leaves(template: dict[tuple[str, int], TrainState], leaves: dict):
  out = {}
  for key, state in template.items():
    mine = leaves[_leaf_key(*key)]
    out[key] = jax.tree.unflatten(
      jax.tree.structure(state), [mine[k] for k in sorted(mine)]
    )
  return out


def load_checkpoint(workdir, template: dict[tuple[str, int], TrainState]):
  """(step, states) of the latest checkpoint in a workdir, or (None, None);
  states are keyed by (run, replicate) like `template`."""
  manager = _checkpoint_manager(RunDir(workdir))
  step = manager.latest_step()
  if step is None:
    return None, None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _as_leaves(template))
  restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  return step, _from_leaves(template, restored)


def _stats_rows(run: str, replicate: int, step: int, layer_stats) -> list[dict]:
  return [
    {
      "kind": "attention",
      "run": run,
      "replicate": replicate,
      "step": step,
      "layer": i,
      **{k: float(v) for k, v in stats.items()},
    }
    for i, stats in enumerate(layer_stats)
  ]


# Fields whose change cannot change a result: a rerun may alter them.
EXTENDABLE = ("train.checkpoint_every", "train.stop_at_step")


def expected_log_steps(settings: Settings, up_to: int) -> list[int]:
  """The steps at which a run logs, up to and including `up_to`."""
  total = settings.optimizer.total_steps
  steps = [s for s in range(0, up_to + 1, settings.log_every)]
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


def run(config, workdir, *, restart: bool = False) -> dict:
  """Trains every run, logs drift, writes the report; returns headlines.

  A rerun resumes from the last checkpoint. A config that would change a
  result is refused unless `restart` deletes the earlier run. Logged rows
  lost from metrics.jsonl are re-measured by training again from step 0.
  """
  settings = settings_from_config(config)
  tokens, eval_source = load_data(settings)
  run_dir = RunDir(workdir)
  with run_dir.lock():
    run_dir.bind_config(
      config.to_dict(), extendable=EXTENDABLE, restart=restart
    )
    return _run(settings, tokens, eval_source, run_dir)


def _run(settings: Settings, tokens, eval_source, run_dir: RunDir) -> dict:
  physical = settings.physical_runs
  replicates = range(settings.replicates)
  trainers = {
    name: Trainer(settings.model, spec, settings.optimizer, settings.batch_size)
    for name, spec in physical.items()
  }
  states = {
    (name, r): trainer.init_state(r)
    for name, trainer in trainers.items()
    for r in replicates
  }

  start, restored = load_checkpoint(run_dir.path, states)
  rows = [
    r
    for r in run_dir.read_metrics()
    if start is not None and r["step"] <= start
  ]
  if start is not None:
    missing = missing_log_steps(settings, rows, start)
    if missing:
      # Only the last checkpoints are kept, so the logged weights of those
      # steps exist nowhere else: train again, deterministically.
      logging.warning(
        "metrics.jsonl lacks the rows of logging steps %s before the "
        "checkpoint at step %d; re-measuring them by training again from "
        "step 0.",
        missing,
        start,
      )
      shutil.rmtree(run_dir.path / "checkpoints", ignore_errors=True)
      start, restored, rows = None, None, []
  run_dir.rewrite_metrics(rows)
  if restored is not None:
    states = {key: trainers[key[0]].place(s) for key, s in restored.items()}
  start = 0 if start is None else start
  manager = _checkpoint_manager(run_dir)

  eval_tokens = data_lib.eval_batch(
    eval_source,
    seed=settings.data_seed,
    batch_size=settings.batch_size,
    seq_len=settings.seq_len,
  )
  eval_batches = {n: t.shard_batch(eval_tokens) for n, t in trainers.items()}
  last_train = {}
  flash_runs = [
    n for n, spec in physical.items() if spec.attention.kind == "pallas"
  ]
  previous_errors: dict = {}  # (run, replicate) -> last logged grad errors

  def batch(step: int, replicate: int) -> np.ndarray:
    return data_lib.batch_at(
      tokens,
      seed=settings.data_seed,
      step=step,
      batch_size=settings.batch_size,
      seq_len=settings.seq_len,
      replicate=replicate,
    )

  def log(step: int):
    new = []
    for replicate in replicates:
      new += _log_replicate(step, replicate)
    run_dir.append_metrics(new)
    rows.extend(new)

  def _log_replicate(step: int, replicate: int) -> list[dict]:
    evals = {
      n: trainers[n].evaluate(states[n, replicate], eval_batches[n])
      for n in trainers
    }
    tag = {"replicate": replicate, "step": step}
    new = []
    for name, (_, loss, layer_stats) in evals.items():
      new.append(
        {
          "kind": "run",
          "run": name,
          **tag,
          "eval_loss": float(loss),
          **last_train.get((name, replicate), {}),
        }
      )
      new += _stats_rows(name, replicate, step, layer_stats)
    # Qiu & Yao's second ingredient: is the attention-gradient error of a
    # flash run aligned from one step to the next, and low-rank? Measured
    # on the batch the next update trains on.
    for name in flash_runs if settings.grad_error else ():
      grads = jax.device_get(
        trainers[name].attention_grad_error(
          states[name, replicate],
          trainers[name].shard_batch(batch(step + 1, replicate)),
        )
      )
      exact = {w: np.asarray(g, np.float64) for w, (_, g) in grads.items()}
      errors = {
        w: np.asarray(flash, np.float64) - exact[w]
        for w, (flash, _) in grads.items()
      }
      new += [
        {**row, "replicate": replicate}
        for row in attention_grad_error_rows(
          name, step, errors, exact, previous_errors.get((name, replicate))
        )
      ]
      previous_errors[name, replicate] = errors
    params = {n: jax.device_get(states[n, replicate].params) for n in trainers}
    for pair in settings.pairs:
      a, b = (settings.physical_name(r) for r in PAIRS[pair])
      logits_a, logits_b = np.asarray(evals[a][0]), np.asarray(evals[b][0])
      diff = logits_b.astype(np.float64) - logits_a
      new.append(
        {
          "kind": "pair",
          "pair": pair,
          **tag,
          "eval_loss_gap": float(evals[b][1]) - float(evals[a][1]),
          "logit_max_abs": float(np.max(np.abs(diff))),
          "logit_rel_l2": float(
            np.linalg.norm(diff) / np.linalg.norm(logits_a)
          ),
        }
      )
      new += [
        {"kind": "drift", "pair": pair, **tag, **row}
        for row in param_drift(params[a], params[b])
      ]
    return new

  started = time.time()
  if start == 0 and not rows:
    log(0)
  total = settings.optimizer.total_steps
  batch_shards = None
  for step in tqdm(
    range(start + 1, total + 1),
    desc="training drift",
    unit="step",
    mininterval=1.0,
    initial=start,
    total=total,
  ):
    for replicate in replicates:
      tokens_now = batch(step, replicate)
      for name, trainer in trainers.items():
        sharded = trainer.shard_batch(tokens_now)
        if name == "base":
          batch_shards = [
            tuple(s.data.shape) for s in sharded.addressable_shards
          ]
        key = (name, replicate)
        states[key], metrics = trainer.step(states[key], sharded)
        _check_finite(run_dir, physical[name], key, step, metrics)
        last_train[key] = {
          "train_loss": float(metrics["loss"]),
          "grad_norm": float(metrics["grad_norm"]),
          "loss_scale": float(metrics["loss_scale"]),
          "finite_grads": bool(metrics["finite_grads"]),
        }
    if step % settings.log_every == 0 or step == total:
      log(step)
    stop_here = step == settings.stop_at_step
    if step % settings.checkpoint_every == 0 or step == total or stop_here:
      manager.save(
        step, args=ocp.args.StandardSave(_as_leaves(states)), force=True
      )
      manager.wait_until_finished()
    if stop_here:
      return {"workdir": str(run_dir.path), "stopped_at_step": step}

  headline = write_report(run_dir, settings, rows)
  return {
    "workdir": str(run_dir.path),
    "seconds": time.time() - started,
    "runs": list(physical),
    "replicates": settings.replicates,
    "devices": {n: s.devices for n, s in physical.items()},
    "batch_shards": batch_shards,
    **headline,
  }


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
