"""Every (run, replicate) state in one Orbax checkpoint, and back."""

from __future__ import annotations

import jax
import orbax.checkpoint as ocp

from stableattn.harness.rundir import RunDir
from stableattn.training.trainer import TrainState


def checkpoint_manager(run_dir: RunDir) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
    (run_dir.path / "checkpoints").resolve(),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=2, create=True, enable_async_checkpointing=False
    ),
  )


def _leaf_key(run: str, replicate: int) -> str:
  return f"{run}.replicate{replicate}"


def as_leaves(states: dict[tuple[str, int], TrainState]) -> dict:
  """States keyed by (run, replicate) as a flat tree Orbax can save."""
  return {
    _leaf_key(*key): {
      f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(state))
    }
    for key, state in states.items()
  }


def from_leaves(template: dict[tuple[str, int], TrainState], leaves: dict):
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
  manager = checkpoint_manager(RunDir(workdir))
  step = manager.latest_step()
  if step is None:
    return None, None
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, as_leaves(template))
  restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  return step, from_leaves(template, restored)


def save(manager: ocp.CheckpointManager, step: int, states) -> None:
  manager.save(step, args=ocp.args.StandardSave(as_leaves(states)), force=True)
  manager.wait_until_finished()
