"""Benchmark: our kernel vs reference, XLA (and on GPU cuDNN and jax's mha).

Run:
  python launch/benchmark.py --workdir=runs/benchmark
  python launch/benchmark.py --workdir=runs/bench_smoke \
      --config=smoke

Variants: default (CPU: lengths 256-4096, memory up to 8192; GPU: lengths
512-16384 with a tile search), `smoke` (CPU, under 2 minutes; tests).

Expected outcome on CPU: in interpret mode our fp32 forward is within
~1.5x of the reference's time, and its peak memory grows linearly with
length while the reference's grows quadratically.
"""

import ml_collections

from stableattn.harness.config_values import with_variant


def _default() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.implementations = "pallas,reference,xla"  # GPU adds cudnn and jax_mha
  c.modes = "forward,forward_backward"
  c.causal = (False, True)
  c.head_dims = "64,128"
  c.warmup = 2
  c.repeats = 5
  c.memory_implementations = "pallas,reference"
  c.tile_search = True  # GPU only
  # Block skipping: our kernel with each mask vs "full", at masks_seq_len.
  c.mask_settings = "full,causal,window_256,window_1024"
  # The attention monitor's cost to a training step, at the drift study's
  # default sizes (configs/training_drift.py).
  c.monitor_overhead = True
  c.monitor = ml_collections.ConfigDict(
    dict(width=128, depth=4, heads=4, seq_len=64, batch_size=16, log_every=15)
  )

  c.cpu = ml_collections.ConfigDict()
  c.cpu.dtypes = "fp32"  # each timed under its flash policy (bf16: bf16-fa2)
  c.cpu.policies = ""  # presets to time instead, e.g. "bf16-fa2,bf16"
  c.cpu.seq_lens = "256,512,1024,2048,4096"
  c.cpu.batch = 1
  c.cpu.heads = 8
  c.cpu.block_q = 64
  c.cpu.block_k = 64
  c.cpu.memory_seq_lens = "1024,2048,4096,8192"
  c.cpu.search_seq_len = 2048  # unused: the tile search runs on a GPU only
  c.cpu.masks_seq_len = 1024  # interpret mode: per-program copies dominate

  c.gpu = ml_collections.ConfigDict()
  c.gpu.dtypes = "bf16"
  c.gpu.policies = ""
  c.gpu.seq_lens = "1024,2048,4096,8192,16384"
  c.gpu.batch = 4
  c.gpu.heads = 16
  c.gpu.block_q = 64
  c.gpu.block_k = 64
  c.gpu.memory_seq_lens = "2048,8192,16384"
  c.gpu.search_seq_len = 8192  # length of the tile search
  c.gpu.masks_seq_len = 4096
  return c


SMOKE = {
  "head_dims": "64",
  "repeats": 3,
  "warmup": 1,
  "cpu.seq_lens": "256,512",
  "cpu.heads": 2,
  "cpu.memory_seq_lens": "512,1024",
  "cpu.masks_seq_len": 512,
  "mask_settings": "full,window_256",
  "monitor_overhead": False,
}

VARIANTS = {"default": {}, "smoke": SMOKE}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return with_variant(_default(), arg, VARIANTS)
