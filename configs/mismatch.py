"""Training-inference mismatch experiment.

Run:
  python launch/mismatch.py --workdir=runs/mismatch
  python launch/mismatch.py --workdir=runs/mismatch_smoke \
      --config=smoke

Trains the byte-level model in FP32 (or loads it from the run directory),
then samples continuations of held-out prompts with each pair's sampler
path (a KV cache, one decode step per token) and scores the same tokens
with its trainer path, with identical weights. Variants: default (a few
minutes on 2 CPU cores), `smoke` (tests; under two minutes), `paper`
(more prompts and seeds), `gpu` (a larger model, for one GPU).

Pairs (`config.pairs`, "all" or a comma list; the control always runs):
see stableattn/experiments/mismatch/pairs.py.
"""

import ml_collections

from stableattn.harness.config_values import with_variant


def _default() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict()
  c.model.width = 64
  c.model.depth = 2
  c.model.heads = 2
  c.model.max_len = 128
  c.train = ml_collections.ConfigDict()
  c.train.steps = 200
  c.train.batch = 16
  c.train.learning_rate = 3e-3
  c.sample = ml_collections.ConfigDict()
  c.sample.prompts = 16  # held-out prompts per seed
  c.sample.prompt_len = 32
  c.sample.new_tokens = 64
  c.sample.seeds = 3
  c.pairs = "all"
  # Truncated importance sampling's cap on p_train / p_sample.
  c.tis_threshold = 2.0
  # Does it matter: a policy-gradient run (REINFORCE, group baseline)
  # rewarding the share of `target_byte` in what the model writes, with
  # the sampler and trainer of each arm (see policy_gradient.py).
  c.rl = ml_collections.ConfigDict()
  c.rl.arms = "all"
  c.rl.replicates = 3
  c.rl.steps = 30
  c.rl.prompts = 4  # per step, each sampled `group` times
  c.rl.group = 4
  c.rl.prompt_len = 16
  c.rl.new_tokens = 16
  c.rl.learning_rate = 1e-3
  c.rl.target_byte = 101  # "e"
  return c


SMOKE = {
  "model.width": 32,
  "model.max_len": 32,
  "train.steps": 10,
  "train.batch": 8,
  "sample.prompts": 4,
  "sample.prompt_len": 8,
  "sample.new_tokens": 8,
  "sample.seeds": 2,
  "rl.arms": "fp8_sampler,fp8_sampler_tis",
  "rl.replicates": 1,
  "rl.steps": 3,
  "rl.prompt_len": 8,
  "rl.new_tokens": 8,
}
PAPER = {
  "sample.prompts": 32,
  "sample.seeds": 5,
  "rl.replicates": 4,
  "rl.steps": 100,
}
GPU = {
  "model.width": 512,
  "model.depth": 8,
  "model.heads": 8,
  "model.max_len": 512,
  "train.steps": 2000,
  "train.batch": 32,
  "sample.prompts": 64,
  "sample.prompt_len": 128,
  "sample.new_tokens": 256,
  "sample.seeds": 5,
  "rl.replicates": 5,
  "rl.steps": 300,
  "rl.prompts": 16,
  "rl.group": 8,
  "rl.prompt_len": 64,
  "rl.new_tokens": 128,
}

VARIANTS = {"default": {}, "smoke": SMOKE, "paper": PAPER, "gpu": GPU}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return with_variant(_default(), arg, VARIANTS)
