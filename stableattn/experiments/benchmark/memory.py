"""Peak memory of one attention forward pass, measured in a fresh process.

  python -m stableattn.experiments.benchmark.memory --implementation=pallas \
      --seq_len=8192 --heads=8 --head_dim=64 --precision=fp32

Prints one JSON line. On a GPU it reports the device allocator's peak; on
the CPU the rise of the process's peak resident set (VmHWM) during the run,
after compilation and with the inputs already resident. Linux resets the
peak with /proc/self/clear_refs, which keeps compilation memory out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys


def measure(
  implementation: str,
  seq_len: int,
  *,
  heads: int,
  head_dim: int,
  precision: str,
  block_q: int,
  block_k: int,
) -> dict:
  """One memory row, from a fresh process running `main`."""
  cmd = [
    sys.executable,
    "-m",
    "stableattn.experiments.benchmark.memory",
    f"--implementation={implementation}",
    f"--seq_len={seq_len}",
    f"--heads={heads}",
    f"--head_dim={head_dim}",
    f"--precision={precision}",
    f"--block_q={block_q}",
    f"--block_k={block_k}",
  ]
  out = subprocess.run(
    cmd, check=True, capture_output=True, text=True, timeout=900
  ).stdout
  return {
    "kind": "memory",
    "head_dim": head_dim,
    "precision": precision,
    **json.loads(out.strip().splitlines()[-1]),
  }


def _status_kib(field: str) -> int:
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--implementation", required=True)
  parser.add_argument("--seq_len", type=int, required=True)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--precision", default="fp32")
  parser.add_argument("--block_q", type=int, default=64)
  parser.add_argument("--block_k", type=int, default=64)
  parser.add_argument("--causal", action="store_true")
  args = parser.parse_args()

  import jax

  from stableattn.experiments.benchmark.timing import attention_fn
  from stableattn.numerics.precision import Precision

  shape = (args.batch, args.seq_len, args.heads, args.head_dim)
  dtype = Precision.from_name(args.precision).dtype("inputs")
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, shape, dtype) for key in keys)
  fn = jax.jit(
    attention_fn(
      args.implementation,
      args.precision,
      args.causal,
      block_q=args.block_q,
      block_k=args.block_k,
    )
  )
  compiled = fn.lower(q, k, v).compile()
  jax.block_until_ready((q, k, v))
  device = jax.devices()[0]
  if device.platform == "gpu":
    before = device.memory_stats()["bytes_in_use"]
    jax.block_until_ready(compiled(q, k, v))
    peak = device.memory_stats()["peak_bytes_in_use"] - before
    source = "device allocator peak"
  else:
    resident = _status_kib("VmRSS")
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    jax.block_until_ready(compiled(q, k, v))
    peak = (_status_kib("VmHWM") - resident) * 1024
    source = "peak resident set rise (VmHWM)"
  print(
    json.dumps(
      {
        "implementation": args.implementation,
        "seq_len": args.seq_len,
        "peak_bytes": int(peak),
        "input_bytes": int(3 * q.size * q.dtype.itemsize),
        "source": source,
      }
    )
  )


if __name__ == "__main__":
  main()
