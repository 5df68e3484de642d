"""One process of the multi-process tests (see test_distributed.py).

Mode "train": trains a small model a few steps on one global batch stream,
data parallel. Mode "ring": ring attention (output and gradients) with
the sequence sharded over every device, then a few training steps of a
model whose attention is context-parallel over them. Process 0 saves the
results."""

import sys

import numpy as np


def main(
  mode: str, process_id: int, num_processes: int, port: int, out: str
) -> None:
  from stableattn.training import distributed

  if num_processes > 1:
    distributed.initialize(f"localhost:{port}", num_processes, process_id)
  import jax

  from stableattn.contract.options import Options
  from stableattn.training.model import AttentionSpec

  if mode == "ring":
    results = ring_attention_and_gradients()
    attention = AttentionSpec(
      kind="pallas",
      options=Options(precision="bf16-fa2", block_q=8, block_k=8),
      context_parallel=jax.device_count(),
    )
    devices = 1
  else:
    results = {}
    attention = AttentionSpec(
      kind="reference", options=Options(precision="bf16-framework")
    )
    devices = jax.device_count()
  results |= train(attention, devices)
  if distributed.is_writer():
    np.savez(out, **results)


def ring_attention_and_gradients() -> dict:
  import jax
  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import stableattn as sa
  from stableattn.ops.ring_plan import context_mesh

  mesh = context_mesh(jax.device_count())
  rows = NamedSharding(mesh, P(None, "context"))
  rng = np.random.default_rng(0)
  shapes = [(2, 128, 4, 32), (2, 128, 2, 32), (2, 128, 2, 32)]
  inputs = [
    jax.make_array_from_callback(shape, rows, lambda index, x=x: x[index])
    for shape in shapes
    for x in [rng.standard_normal(shape).astype(np.float32)]
  ]

  def loss(q, k, v):
    out = sa.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis="context",
      precision="bf16-fa2",
      block_q=16,
      block_k=16,
      causal=True,
    )
    return jnp.sum(out.astype(jnp.float32) ** 2), out

  (_, out), grads = jax.jit(
    jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  )(*inputs)
  gathered = [
    multihost_utils.process_allgather(x, tiled=True) for x in (out, *grads)
  ]
  return {
    name: np.asarray(x, np.float32)
    for name, x in zip(("ring_out", "ring_dq", "ring_dk", "ring_dv"), gathered)
  }


def train(attention, devices: int) -> dict:
  import jax

  from stableattn.training import data
  from stableattn.training.model import ModelSpec
  from stableattn.training.trainer import OptimizerSpec, RunSpec, Trainer

  model = ModelSpec(width=32, depth=1, heads=2, max_len=16)
  run = RunSpec(attention=attention, precision="bf16", devices=devices)
  trainer = Trainer(model, run, OptimizerSpec(total_steps=3, warmup_steps=1), 4)
  tokens = data.generate_corpus(4096, 0)
  state = trainer.init_state(0)
  for step in range(3):
    batch = data.batch_at(tokens, seed=0, step=step, batch_size=4, seq_len=16)
    state, _ = trainer.step(state, trainer.shard_batch(batch))
  leaves = jax.tree.leaves(jax.device_get(state.params))
  return {
    **{f"param_{i}": np.asarray(x, np.float32) for i, x in enumerate(leaves)},
    "mesh_devices": np.asarray(trainer.mesh.devices.size),
  }


if __name__ == "__main__":
  pid, n, port = (int(x) for x in sys.argv[2:5])
  main(sys.argv[1], pid, n, port, sys.argv[5])
