"""The other machine's side of pair other_machine: the child process
(started by `snapshots.Snapshots`) that trains the base run alone and
saves a snapshot at every logging step."""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

from stableattn.experiments.training_drift.data import load_data
from stableattn.experiments.training_drift.lockstep import Lockstep
from stableattn.experiments.training_drift.settings import settings_from_config
from stableattn.experiments.training_drift.snapshots import snapshot_path
from stableattn.harness import machine_twin
from stableattn.harness.rundir import RunDir


class TwinLockstep(Lockstep):
  """The base run alone; a logging step writes snapshots, not rows."""

  def log(self, step: int) -> None:
    (name,) = self.trainers
    trainer = self.trainers[name]
    for replicate in self.replicates:
      state = self.states[name, replicate]
      logits, loss, _ = trainer.evaluate(state, self.eval_batches[name])
      leaves = jax.tree_util.tree_leaves(jax.device_get(state.params))
      target = snapshot_path(self.run_dir.path, step, replicate)
      target.parent.mkdir(exist_ok=True)
      partial = target.with_suffix(".partial")
      with open(partial, "wb") as f:
        np.savez(
          f,
          logits=np.asarray(logits),
          loss=np.asarray(loss),
          **{f"p{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)},
        )
      os.replace(partial, target)

  def finish(self, started: float) -> dict:
    return {"workdir": str(self.run_dir.path)}


def main(argv) -> None:
  config, workdir, _ = machine_twin.child_arguments(argv)
  settings = settings_from_config(config, twin=True)
  tokens, eval_source = load_data(settings)
  run_dir = RunDir(workdir)
  with run_dir.lock():
    TwinLockstep(settings, tokens, eval_source, run_dir).train()


if __name__ == "__main__":
  main(sys.argv)
