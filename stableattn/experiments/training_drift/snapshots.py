"""The base run on another machine (pair other_machine): the parent's side.

A child process (`machine_twin`) trains the base run alone, with the
other machine's XLA_FLAGS, in `machine_twin/` of the run directory, and
at every logging step saves each replicate's parameters and evaluation
logits as a snapshot. The parent trains everything else as before and, at
each logging step, reads the snapshot of that step as the other side of
the pair. The child resumes from its own checkpoints; the snapshots are
deleted once the parent's report is written.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np

from stableattn.experiments.training_drift.settings import Settings
from stableattn.harness import machine_twin
from stableattn.harness.rundir import RunDir

TWIN_DIR = "machine_twin"
CHILD = "stableattn.experiments.training_drift.twin"


def snapshot_path(directory, step: int, replicate: int):
  return directory / "snapshots" / f"r{replicate}_s{step}.npz"


class Snapshots:
  """The parent's view of the other machine's base run."""

  def __init__(self, run_dir: RunDir, settings: Settings):
    self.run_dir = run_dir
    self.s = settings
    self.path = run_dir.path / TWIN_DIR

  def _missing(self, steps) -> list[tuple[int, int]]:
    return [
      (step, r)
      for step in steps
      for r in range(self.s.replicates)
      if not snapshot_path(self.path, step, r).exists()
    ]

  def ensure(self, steps) -> None:
    """Trains the other machine's run until a snapshot of every replicate
    exists at every step in `steps`."""
    if not self._missing(steps):
      return
    config = json.loads((self.run_dir.path / "config.json").read_text())
    for attempt in range(2):
      if attempt:  # its checkpoints are past the lost snapshots: anew
        shutil.rmtree(self.path)
      self.path.mkdir(parents=True, exist_ok=True)
      machine_twin.run_child(
        CHILD, config, self.path, self.s.machine_flags, self.s.machine
      )
      if not self._missing(steps):
        return
    raise RuntimeError(
      f"the other-machine run left no snapshot of (step, replicate) "
      f"{self._missing(steps)[:3]} in {self.path}/snapshots."
    )

  def load(self, step: int, replicate: int, like):
    """((logits, loss, None), params) of one replicate at one logging
    step; `like` gives the parameters' tree structure."""
    with np.load(snapshot_path(self.path, step, replicate)) as f:
      leaves = [f[f"p{i}"] for i in range(len(f.files) - 2)]
      evaluated = (f["logits"], float(f["loss"]), None)
    treedef = jax.tree_util.tree_structure(like)
    if treedef.num_leaves != len(leaves):
      raise RuntimeError(
        f"the other-machine snapshot at step {step} has {len(leaves)} "
        f"parameter arrays, this model {treedef.num_leaves}; delete "
        f"{self.path} and rerun."
      )
    return evaluated, jax.tree_util.tree_unflatten(treedef, leaves)

  def remove(self) -> None:
    shutil.rmtree(self.path / "snapshots", ignore_errors=True)
