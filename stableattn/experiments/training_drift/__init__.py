"""Training-drift experiment (Golden et al., Figs. 7-8).

Trains several runs of the same transformer in lockstep on one data stream
and, at every logging step, measures how far each pair's weights have
drifted apart. Runs are variants of one base run (`variants.py`); pairs
name two variants and a role (`pairs.py`): subjects (Flash vs Baseline)
are divided by every reference (another seed, low-precision training, one
device vs several) and judged by the paper's claims; controls (an
identical rerun) must drift exactly 0. Every pair is measured in several
replicates, each with its own shared initialization and data order, so a
ratio between pairs comes with an interval rather than resting on one
seed. Runs that coincide (the base run *is* the bf16 run when training in
BF16) are trained once. Replicates share each run's compiled step and
advance together, one step at a time (a vmap over replicates measured
2.5-4x slower on the CPU). All runs are checkpointed together with Orbax;
a restarted run resumes from the last checkpoint and continues bitwise
identically.
"""

from __future__ import annotations

from stableattn.experiments.training_drift.checkpoints import load_checkpoint
from stableattn.experiments.training_drift.data import load_data
from stableattn.experiments.training_drift.lockstep import Lockstep
from stableattn.experiments.training_drift.pairs import PAIRS, Pair
from stableattn.experiments.training_drift.settings import (
  Settings,
  settings_from_config,
)
from stableattn.harness.rundir import opened

__all__ = [
  "PAIRS",
  "Pair",
  "Settings",
  "load_checkpoint",
  "run",
  "settings_from_config",
]

# Fields whose change cannot change a result: a rerun may alter them.
EXTENDABLE = ("train.checkpoint_every", "train.stop_at_step")


def run(config, workdir, *, restart: bool = False) -> dict:
  """Trains every run, logs drift, writes the report; returns headlines.

  A rerun resumes from the last checkpoint. A config that would change a
  result is refused unless `restart` deletes the earlier run. Logged rows
  lost from metrics.jsonl are re-measured by training again from step 0.
  """
  settings = settings_from_config(config)
  tokens, eval_source = load_data(settings)
  with opened(workdir, config, restart=restart, extendable=EXTENDABLE) as (
    run_dir,
    _,
  ):
    return Lockstep(settings, tokens, eval_source, run_dir).train()
