"""Training drift across model sizes, contexts and steps, with a fitted
trend.

Run:
  python launch/drift_scaling.py --workdir=runs/drift_scaling
  python launch/drift_scaling.py --workdir=runs/drift_scaling_smoke \
      --config=smoke

Each unit is a whole drift study (`configs/training_drift.py`, the
`drift` section below) with the pairs that carry the verdicts: Flash vs
Baseline against BF16-vs-FP32 training, another seed and the base run
compiled for another machine. Sizes are "w<width>-d<depth>-s<context>";
in the first arm each trains the same number of tokens per
(non-embedding) parameter with the same tokens per step, so every model
is at the same stage of training and the context axis changes nothing
but the context; the fixed-step arm trains its sizes the same steps, so
that size and steps can be told apart.

Default: three sizes at context 64 (width 64 to 128, depth 2 to 4; 8x the
parameters, 62x the training compute) and the middle size at contexts 128
and 256, all at 0.5 tokens per parameter (48 to 384 steps); and the
fixed-step arm, the three context-64 sizes at 162 steps each (the middle
one shared). 5 replicates each; 7 units, about 46 minutes on 2 CPU
cores alone (92 beside another sweep). A killed run resumes unit by
unit from the last checkpoint;
`--config.shard=i/n` runs one share of the units (on another core or
host, into the same run directory) and `--config.workers=N` runs N
shards here. `smoke`: tiny sizes on a generated corpus, five units (three
values of each axis), for tests (under a minute).
"""

import ml_collections

from stableattn.configs import training_drift
from stableattn.harness.config_values import with_variant


def _drift_config() -> ml_collections.ConfigDict:
  """The drift study's default config."""
  return training_drift.get_config()


def _default() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.scaling = ml_collections.ConfigDict()
  # Comma list of "w<width>-d<depth>-s<context>". The trend is fitted over
  # all of them at once (log ratio against log parameters and log
  # context), so each axis needs three distinct values, and the two axes
  # should not move together.
  c.scaling.sizes = "w64-d2-s64,w96-d3-s64,w128-d4-s64,w96-d3-s128,w96-d3-s256"
  # Training tokens per non-embedding parameter (Kaplan et al. 2020's N),
  # the same at every size: 0.5 trains the default drift study's model
  # 384 steps (5x its 75).
  c.scaling.tokens_per_parameter = 0.5
  # Tokens per optimizer step at every size: a longer context packs fewer
  # sequences in a batch.
  c.scaling.tokens_per_step = 1024
  # The fixed-step arm: these sizes trained this many steps each, beside
  # the tokens-per-parameter arm (whose steps grow with size: 48, 162 and
  # 384 at context 64), so the fit can tell the slope with parameters at
  # fixed steps from the slope with steps at fixed size. 162 is the middle
  # size's steps, so that size is one unit in both arms. "" for none.
  c.scaling.fixed_steps = 162
  c.scaling.fixed_step_sizes = "w64-d2-s64,w96-d3-s64,w128-d4-s64"
  c.scaling.head_dim = 32  # heads = width / head_dim
  c.scaling.logs = 5  # logging steps per run after step 0
  c.scaling.warmup_fraction = 0.1
  # The size the fitted trend is extrapolated to, labelled a prediction:
  # the drift study's `gpu` config (GPT-2-small-like).
  c.scaling.predict_at = "w768-d12-s1024"
  # ... trained this many steps (that config's 400), where the fit has
  # a steps axis; without the fixed-step arm the prediction follows the
  # tokens-per-parameter arm instead.
  c.scaling.predict_steps = 400
  c.scaling.metric = "wasserstein"  # the drift metric the ratios divide

  # How the sweep spreads (never what it measures): "i/n" trains share i
  # of n of the sizes, so n processes or hosts on one run directory
  # (a job array's tasks: i from its index) train each size once; the
  # last to finish writes the report. `workers` runs that many shards as
  # processes here.
  c.shard = "1/1"
  c.workers = 1

  c.drift = _drift_config()
  c.drift.pairs = "flash_vs_baseline,bf16_vs_fp32,different_seed,other_machine"
  c.drift.train.grad_error = False
  return c


SMOKE = {
  "scaling.sizes": "w16-d1-s16,w32-d1-s32,w32-d2-s64,w16-d1-s64",
  "scaling.tokens_per_step": 256,
  "scaling.fixed_steps": 6,  # the first size's steps
  "scaling.fixed_step_sizes": "w32-d1-s32",
  "scaling.head_dim": 16,
  "scaling.logs": 2,
  "drift.data.corpus": "generated",
  "drift.data.corpus_tokens": 1 << 14,
  "drift.train.replicates": 2,
  "drift.train.devices": 1,
  "drift.pairs": "flash_vs_baseline,bf16_vs_fp32",
}

VARIANTS = {"default": {}, "smoke": SMOKE}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return with_variant(_default(), arg, VARIANTS)
