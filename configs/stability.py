"""Training-stability experiment (Wortsman et al. 2023's learning-rate
sensitivity, Flash against Baseline).

Run:
  python launch/stability.py --workdir=runs/stability
  python launch/stability.py --workdir=runs/stability_smoke \
      --config=smoke

Variants: default (5 replicates; 17 minutes on 2 CPU cores), `smoke`
(seconds; tests), `paper` (a wider grid, more replicates, every
mitigation), `gpu` (a larger model and context, for one GPU), `sizes`
(the sweep at three sizes spanning 8x the parameters, and a report
across them; about 40 minutes on 2 CPU cores), `sizes_smoke` (two tiny
sizes).
"""

import ml_collections

from stableattn.harness.config_values import with_variant


def _default() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Attention variants: baseline (reference, natural policy), flash (our
  # kernel, natural policy), flash_bf16 (every stage in BF16).
  c.variants = "baseline,flash,flash_bf16"
  # A registry kernel or "package.module:function" swept beside them.
  c.candidate = ""
  # A flash policy below 16 bits (e.g. "fp8-fa3") swept beside them.
  c.low_precision = ""
  # Devices of a ring (>= 2): the flash arm again with its attention
  # sharded by sequence over them (on CPU the launcher simulates them).
  c.context_parallel = 0
  # none, qk_norm, z_loss, or a name in `strengths` that is a field of
  # stableattn.Features (every kernel) or stableattn.Options (the flash
  # kernel only): each arm is swept with each.
  c.mitigations = "none,qk_norm"
  # How strong each mitigation is (a feature's or option's value).
  c.strengths = ml_collections.ConfigDict()
  c.strengths.z_loss = 1e-4  # Wortsman et al.'s weight
  c.strengths.softcap = 30.0  # attention logits capped at +-30
  c.strengths.tie_beta = 2.0  # Qiu & Yao's fix in the flash kernel

  # Model sizes, "w<width>-d<depth>" (heads: width / size_head_dim; the
  # context stays model.seq_len): each size is this whole sweep in
  # <workdir>/sizes/<size>, then a report across sizes. "": the one
  # model below.
  c.sizes = ""
  c.size_head_dim = 32
  # How a sweep over sizes spreads (never what it measures): "i/n" trains
  # share i of n of the sizes into one run directory; `workers` runs that
  # many shards as processes here.
  c.shard = "1/1"
  c.workers = 1

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 256  # bytes
  c.model.width = 64
  c.model.depth = 2
  c.model.heads = 2
  c.model.seq_len = 64
  c.model.mlp_ratio = 4

  c.attention = ml_collections.ConfigDict()
  c.attention.block_q = 32
  c.attention.block_k = 32

  c.train = ml_collections.ConfigDict()
  c.train.precision = "bf16"  # every variant trains in this format
  # "activations" (MaxText) or "autocast" (PyTorch): configs/training_drift.py
  c.train.mixed_precision = "activations"
  # Baseline is also trained in this format, the reference difference
  # ("": none).
  c.train.reference_precision = "fp32"
  # A log grid wide enough to reach divergence.
  c.train.learning_rates = "1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1"
  # Five replicates: a 95% interval over two rests on one degree of
  # freedom (t = 12.7) and moves several-fold from one machine to the next.
  c.train.replicates = 5
  c.train.steps = 100
  c.train.warmup_steps = 10
  c.train.batch_size = 8
  c.train.log_every = 25
  # A training loss above this times ln 256 (a uniform guess) diverged.
  c.train.divergence_factor = 1.5
  # The Baseline arms again, compiled for another machine (one CPU
  # instruction set down; on a GPU, no autotuning): the deviation a job
  # meets on other hardware, the reference for Flash's.
  c.train.machine_pair = True
  # Capture each flash arm's q, k, v, dO for the audit (docs/monitor.md)
  # at the first logging step whose largest logit reaches capture_logit
  # (> 0); or in every replicate at up to capture_map logging steps: the
  # first, and each where its heads move on the calibrated 2-D map.
  c.train.capture_logit, c.train.capture_map = 0.0, 0
  c.train.capture_rows = 2

  c.data = ml_collections.ConfigDict()
  c.data.corpus = "python_stdlib"
  c.data.seed = 0
  c.data.corpus_tokens = 1 << 18
  return c


SMOKE = {
  "variants": "baseline,flash",
  "train.reference_precision": "",
  "model.width": 32,
  "model.depth": 1,
  "model.seq_len": 32,
  "attention.block_q": 16,
  "attention.block_k": 16,
  "train.learning_rates": "1e-2,1",
  "train.replicates": 1,
  "train.steps": 6,
  "train.warmup_steps": 2,
  "train.batch_size": 4,
  "train.log_every": 3,
  "data.corpus": "generated",
}
PAPER = {
  "mitigations": "none,qk_norm,z_loss,softcap,tie_beta",
  "train.learning_rates": "3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1,3",
  "train.replicates": 5,
  "train.steps": 300,
  "train.warmup_steps": 30,
}
GPU = {
  "model.width": 256,
  "model.depth": 4,
  "model.heads": 4,
  "model.seq_len": 256,
  "attention.block_q": 64,
  "attention.block_k": 64,
  "train.replicates": 5,
  "train.steps": 1000,
  "train.warmup_steps": 100,
  "train.batch_size": 32,
  "train.log_every": 100,
}

# The sweep at three sizes spanning 8x the parameters (the drift-scaling
# sweep's context-64 sizes), Flash and Baseline without mitigations, the
# references beside them; 1e-3 left out of the grid (never the best rate
# at these sizes).
SIZES = {
  "sizes": "w64-d2,w96-d3,w128-d4",
  "variants": "baseline,flash",
  "mitigations": "none",
  "train.learning_rates": "3e-3,1e-2,3e-2,1e-1,3e-1,1",
}
# Two tiny sizes for tests.
SIZES_SMOKE = {**SMOKE, "sizes": "w16-d1,w32-d1", "size_head_dim": 16}

VARIANTS = {
  "default": {},
  "smoke": SMOKE,
  "paper": PAPER,
  "gpu": GPU,
  "sizes": SIZES,
  "sizes_smoke": SIZES_SMOKE,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return with_variant(_default(), arg, VARIANTS)
