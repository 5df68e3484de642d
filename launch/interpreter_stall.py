"""jax's GPU interpreter deadlocks on jax's own warp-specialized pipeline
under XLA:CPU's default schedule, on one core; with
`SEQUENTIAL_SCHEDULE_FLAG` it runs (docs/findings.md).

  python launch/interpreter_stall.py

The kernel is jax's `plgpu.emit_pipeline_warp_specialized`: a memory
warpgroup fills a two-slot ring by TMA, one compute warpgroup reads it
(a softmax-like body of `--branches` independent reductions), inside a
jitted program that also does `--beside` independent sums. Each run is a
fresh process pinned to `--cores` CPUs, given `--seconds` to finish,
`--runs` times under each schedule; this prints each run's outcome and
how many stalled, and exits 0 when every run with the flag finished (a
run under the default schedule stalls by a race: 4 of 6 here).
"""

import os
import subprocess
import sys
import time

from absl import app, flags

from stableattn.contract.options import SEQUENTIAL_SCHEDULE_FLAG

flags.DEFINE_integer("steps", 6, "Pipeline steps (ring slots: 2).")
flags.DEFINE_integer("branches", 32, "Independent reductions per step.")
flags.DEFINE_integer("beside", 16, "Independent sums beside the kernel.")
flags.DEFINE_integer("cores", 1, "CPUs each run is pinned to.")
flags.DEFINE_float("seconds", 30.0, "How long a run may take.")
flags.DEFINE_integer("runs", 5, "Runs under each schedule.")
flags.DEFINE_bool("child", False, "Run the kernel once, in this process.")

ROWS = COLS = 64


def _kernel_program(steps: int, branches: int, beside: int):
  """The jitted program: jax's warp-specialized pipeline in GPU
  interpret mode, and independent work beside it."""
  import jax
  import jax.numpy as jnp
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(indices, x_smem, carry):
    s = x_smem[...]
    rows, cols = (
      jax.lax.broadcasted_iota(jnp.int32, s.shape, d) for d in (0, 1)
    )
    total = carry
    for b in range(branches):
      t = s * (1.0 + b)
      p = jnp.exp(t - t.max(axis=1)[:, None])
      part = jnp.where(cols <= rows, p, 0.0).sum(axis=1)
      # Only the first branch counts; the rest are work XLA may interleave.
      total = total + (part if b == 0 else part * 0.0)
    return total

  def kernel(x_gmem, o_gmem):
    def scoped(o_smem):
      def compute_context(pipeline):
        o_smem[...] = pipeline(jnp.zeros((ROWS,), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

      plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=[plgpu.BlockSpec((ROWS, COLS), lambda i: (0, i))],
        wg_axis="wg",
        num_compute_wgs=1,
        max_concurrent_steps=2,
        compute_context=compute_context,
      )(x_gmem)

    pl.run_scoped(
      scoped, plgpu.SMEM((ROWS,), jnp.float32), collective_axes="wg"
    )

  run = plgpu.kernel(
    kernel,
    out_type=jax.ShapeDtypeStruct((ROWS,), jnp.float32),
    num_threads=2,
    thread_name="wg",
    interpret=InterpretGPUParams(detect_races=True),
  )

  @jax.jit
  def program(x):
    return run(x), [jnp.sin(x * (i + 1)).sum() for i in range(beside)]

  return program


def _child(f) -> int:
  import numpy as np

  x = np.random.default_rng(0).standard_normal((ROWS, COLS * f.steps))
  x = x.astype(np.float32)
  out = np.asarray(_kernel_program(f.steps, f.branches, f.beside)(x)[0])
  blocks = x.reshape(ROWS, f.steps, COLS).transpose(1, 0, 2)
  lower = np.tril(np.ones((ROWS, COLS)))
  want = sum(
    (np.exp(b - b.max(1, keepdims=True)) * lower).sum(1) for b in blocks
  )
  print(f"max relative error {np.abs(out - want).max() / want.max():.1e}")
  return 0


def _run(f, xla_flags: str) -> tuple[str, float]:
  """(outcome, seconds) of one pinned child process."""
  cpus = sorted(os.sched_getaffinity(0))[: f.cores]
  args = [sys.executable, __file__, "--child"] + [
    f"--{name}={getattr(f, name)}" for name in ("steps", "branches", "beside")
  ]
  env = {**os.environ, "XLA_FLAGS": xla_flags}
  started = time.perf_counter()
  try:
    done = subprocess.run(
      args,
      env=env,
      capture_output=True,
      text=True,
      timeout=f.seconds,
      preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
  except subprocess.TimeoutExpired:
    return f"stalled (no result in {f.seconds:.0f} s)", f.seconds
  seconds = time.perf_counter() - started
  if done.returncode:
    return f"failed: {done.stderr.strip().splitlines()[-1]}", seconds
  error = float(done.stdout.split()[-1])
  if not error < 1e-5:
    return f"wrong: max relative error {error:.1e}", seconds
  return f"finished, {done.stdout.strip().splitlines()[-1]}", seconds


def main(argv):
  del argv
  f = flags.FLAGS
  if f.child:
    return _child(f)
  counts = {n: getattr(f, n) for n in ("steps", "branches", "cores", "runs")}
  low = [f"--{n}={v}" for n, v in counts.items() if v < 1]
  low += [f"--beside={f.beside}"] * (f.beside < 0)
  low += [f"--seconds={f.seconds}"] * (f.seconds <= 0)
  if low:
    print(f"error: {', '.join(low)}: --steps, --branches, --cores and "
          "--runs must be at least 1, --beside at least 0, --seconds "
          "above 0")  # fmt: skip
    return 2
  base = os.environ.get("XLA_FLAGS", "").replace(SEQUENTIAL_SCHEDULE_FLAG, "")
  for name, xla_flags in (
    ("default schedule", base.strip()),
    (SEQUENTIAL_SCHEDULE_FLAG, f"{base} {SEQUENTIAL_SCHEDULE_FLAG}".strip()),
  ):
    outcomes = [_run(f, xla_flags) for _ in range(f.runs)]
    for outcome, seconds in outcomes:
      print(f"{name}: {outcome} ({seconds:.1f} s, {f.cores} core(s))")
    stalled = sum(o.startswith("stalled") for o, _ in outcomes)
    finished = sum(o.startswith("finished") for o, _ in outcomes)
    print(f"{name}: {stalled} of {f.runs} stalled, {finished} finished")
  # The default schedule's stall is a race (4 of 6 runs on one core): the
  # exit status says only whether every run with the flag finished.
  return 0 if finished == f.runs else 1


if __name__ == "__main__":
  app.run(main)
