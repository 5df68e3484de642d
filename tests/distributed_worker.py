"""One process of the multi-process training test (see
test_distributed.py): trains a small model a few steps on one global
batch stream and, in process 0, saves its weights."""

import sys

import numpy as np


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
  from stableattn import distributed

  if num_processes > 1:
    distributed.initialize(f"localhost:{port}", num_processes, process_id)
  import jax

  from stableattn import data
  from stableattn.model import AttentionSpec, ModelSpec
  from stableattn.options import Options
  from stableattn.training import OptimizerSpec, RunSpec, Trainer

  model = ModelSpec(width=32, depth=1, heads=2, max_len=16)
  run = RunSpec(
    attention=AttentionSpec(
      kind="reference", options=Options(precision="bf16-framework")
    ),
    precision="bf16",
    devices=jax.device_count(),
  )
  trainer = Trainer(model, run, OptimizerSpec(total_steps=3, warmup_steps=1), 4)
  tokens = data.generate_corpus(4096, 0)
  state = trainer.init_state(0)
  for step in range(3):
    batch = data.batch_at(tokens, seed=0, step=step, batch_size=4, seq_len=16)
    state, _ = trainer.step(state, trainer.shard_batch(batch))
  leaves = jax.tree.leaves(jax.device_get(state.params))
  if distributed.is_writer():
    np.savez(
      out,
      *[np.asarray(x, np.float32) for x in leaves],
      mesh_devices=np.asarray(trainer.mesh.devices.size),
    )


if __name__ == "__main__":
  pid, n, port = (int(x) for x in sys.argv[1:4])
  main(pid, n, port, sys.argv[4])
