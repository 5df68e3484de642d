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
    self.child: machine_twin.Child | None = None
    self.steps: list[int] = []

  def _missing(self, steps) -> list[tuple[int, int]]:
    return [
      (step, r)
      for step in steps
      for r in range(self.s.replicates)
      if not snapshot_path(self.path, step, r).exists()
    ]

  def start(self, steps) -> None:
    """Starts the other machine's run, unless a snapshot of every replicate
    exists at every step in `steps`; it trains while the parent compiles,
    and the first `load` waits for it."""
    self.steps = list(steps)
    if not self._missing(self.steps):
      return
    self.path.mkdir(parents=True, exist_ok=True)
    self.child = self._child()

  def _child(self) -> machine_twin.Child:
    config = json.loads((self.run_dir.path / "config.json").read_text())
    return machine_twin.Child(
      CHILD, config, self.path, self.s.machine_flags, self.s.machine
    )

  def wait(self) -> None:
    """Waits for the child, started again once if it left snapshots out."""
    if self.child is None:
      return
    self.child.wait()
    self.child = None
    if self._missing(self.steps):
      # Its checkpoints are past the lost snapshots: once more, anew.
      shutil.rmtree(self.path)
      self.path.mkdir(parents=True)
      self._child().wait()
    if self._missing(self.steps):
      raise RuntimeError(
        f"the other-machine run left no snapshot of (step, replicate) "
        f"{self._missing(self.steps)[:3]} in {self.path}/snapshots."
      )

  def load(self, step: int, replicate: int, like):
    """((logits, loss, None), params) of one replicate at one logging
    step; `like` gives the parameters' tree structure."""
    self.wait()
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

  def abandon(self) -> None:
    """Stops the child (the parent failed; a rerun resumes it)."""
    if self.child is not None:
      self.child.process.kill()
      self.child.process.communicate()
      self.child = None

  def remove(self) -> None:
    self.wait()
    shutil.rmtree(self.path / "snapshots", ignore_errors=True)
