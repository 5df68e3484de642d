"""Audit any attention kernel (forward, gradients, determinism, NaN).

Run:
  python launch/audit.py --workdir=runs/audit_xla --config.kernel=xla
  python launch/audit.py --workdir=runs/audit_mine \
      --config.kernel=my_package.my_module:my_attention
  python launch/audit.py --workdir=runs/audit_smoke \
      --config=smoke --config.kernel=jax_mha

  python launch/audit.py --workdir=runs/audit_window --config.kernel=xla \
      --config.features=causal,window

The kernel follows the contract of `stableattn/ops/registry.py`:
fn(q, k, v, **features) -> out, layout [batch, length, heads, head_dim];
it is passed only the features the config names, under jax's names.
Variants: default (two shapes, FP32 and BF16, causal and not; about two
minutes on 2 CPU cores for a jitted kernel), `smoke` (one small shape;
under a minute), `paper` (GQA, ragged lengths, head dim 128, more inputs),
`edges` (one small shape, every edge regime and every invariance probe,
invariance gated), `search` (60 drawn cases, the smallest failure shrunk
to one reproducing command), `decode` (single-query shapes for decode and
paged kernels). `--config.regimes=all` adds the edge regimes to any
variant.

Expected outcome: XLA's `jax.nn.dot_product_attention`, jax's Pallas `mha`
and ours pass (10-25 seconds each on 2 CPU cores). With uniform [0, 1)
inputs (`--config.distributions=uniform`) the flash kernels' dQ, ours and
jax's `mha`, misses FlexAttention's 1.1x of eager BF16's mean error by
12-16x: delta = rowsum(dO * O) is computed from the BF16-rounded O. A
kernel with a wrong scale, a wrong gradient, a NaN row or nondeterministic
output fails, and the report names the rule, tensor, shape and numbers.
The exit code is 1 when the kernel fails.
"""

import ml_collections

from stableattn.harness.config_values import with_variant


def _default() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # A registry name (pallas, reference, xla, cudnn, jax_mha, jax_splash,
  # keras_dpa, tokamax_xla, ...) or an import path
  # "package.module:function".
  c.kernel = "xla"
  # The kernel's tensor layout: "bshd" ([batch, length, heads, head_dim],
  # ours and jax.nn's) or "bhsd" (torch's and the TPU kernels'); the audit
  # transposes around a "bhsd" kernel and says so.
  c.layout = "bshd"
  # Our implementations' own policy; "auto": Flash's natural policy for
  # pallas, eager attention's for reference/xla, at each input format;
  # "stable": our kernel's stable preset at each format (fp32-stable,
  # bf16-fa2-stable, fp16-fa2-stable).
  c.kernel_precision = "auto"
  # More options of our implementations, "name=value,..." (fields of
  # stableattn.Options), e.g. "split_size=64" or "num_splits=4,block_k=32".
  c.kernel_options = ""
  # Input format and the same-policy baseline of the FlashAttention and
  # FlexAttention rules: eager attention in BF16, and FP32.
  c.precisions = "fp32,bf16-framework"
  # (batch, seq_len, heads, head_dim) or (batch, q_len, kv_len, heads,
  # kv_heads, head_dim); lengths that are multiples of 64 suit kernels
  # that need whole tiles.
  c.shapes = ((1, 128, 2, 64), (2, 256, 2, 64))
  # The peers' own tests draw standard-normal inputs; :paper adds uniform
  # [0, 1) (positive) and outlier inputs.
  c.distributions = "normal"
  c.seeds = 1
  # Feature sets, each audited: ';' between sets, each "none" or a comma
  # list of causal, bottom_right, window, lengths, segments, softcap, sink,
  # alibi (the kernel is called with them under jax's names).
  c.features = "none;causal"
  c.repeats = 3  # identical runs that must agree bit for bit
  # Rules deciding `passed` (all four are reported); add "invariance" to
  # fail a kernel whose invariance probes are not bitwise equal.
  c.gate = "flashattention,flexattention"
  # Inference's ways of computing the same rows, compared bitwise (opt-in;
  # "all" or a comma list of batch, decode, chunked_prefill, padded_cache,
  # splits): see stableattn/auditing/invariance.py.
  c.invariances = ""
  # Edge regimes, built from every shape (opt-in; "all" or a comma list of
  # large_logits, small_logits, outlier_channels, tied_maxima, empty_rows,
  # remainders, single_query, zero_length, mixed_dtypes, head_dims, and
  # from users' reports poisoned_padding, finite_mask, score_ramp,
  # empty_splits, sink_extremes, gqa_groups): see
  # stableattn/auditing/regimes.py. Rows no key may attend must be 0.
  c.regimes = ""
  # > 0: instead of the grid, draw this many cases (shapes, a causal mask,
  # inputs, regimes) and shrink a failure to the smallest failing case,
  # printed as one launcher command that reproduces it.
  c.search_budget = 0
  # A model's own tensors, audited beside the grid: a training run with
  # capture_steps set, its captures/ folder or one step's folder.
  c.inputs = ""
  # CI: JUnit XML written here (""); a baseline of known findings: with
  # update_baseline the current failures are recorded, without it only a
  # new failure or one worse than recorded fails (docs/audit.md).
  c.junit = ""
  c.baseline = ""
  c.update_baseline = False
  return c


SMOKE = {
  "shapes": ((1, 128, 2, 32),),
  "distributions": "normal",
  "repeats": 2,
}
PAPER = {
  "shapes": (
    (1, 128, 2, 64),
    (2, 512, 4, 64),
    (1, 1024, 8, 128),
    (2, 256, 256, 8, 2, 64),  # GQA
    (1, 97, 200, 4, 4, 72),  # ragged lengths, odd head dim
  ),
  "distributions": "normal,uniform,outliers",
  "seeds": 2,
  "precisions": "fp32,fp16-framework,bf16-framework",
}

# Where kernels break: every edge regime and every invariance probe, the
# latter gated, at one small shape.
EDGES = {
  "shapes": ((1, 64, 2, 32),),
  "regimes": "all",
  "invariances": "all",
  "gate": "flashattention,flexattention,invariance",
  "repeats": 2,
}

# Decode kernels (jax_decode, jax_paged): one query per sequence over
# caches of lengths that are not whole blocks, GQA and MHA, with and
# without per-sequence valid lengths; their invariance probes (a decode
# step batched, caches padded, decode rows of mixed cache lengths).
DECODE = {
  "shapes": ((4, 1, 256, 8, 2, 64), (2, 1, 1000, 4, 4, 128)),
  "features": "none;lengths",
  "invariances": "batch,padded_cache,mixed_batch,splits",
}

# Our stable presets over a grid of shapes, every regime, causal and not:
# lengths 1-300 (whole and partial tiles, q_len != kv_len), head dims
# 32-256, GQA groups 1-64 and MLA's 192/128 (regimes add groups of 8-64,
# 576/512 and their own lengths). About an hour on 2 CPU cores.
STABLE_GRID = {
  "kernel": "pallas",
  "kernel_precision": "stable",
  "precisions": "fp32,bf16-framework,fp16-framework",
  "shapes": (
    (4, 1, 37, 2, 2, 32),
    (1, 63, 63, 4, 1, 64),
    (1, 100, 100, 2, 2, 64),
    (1, 97, 200, 4, 4, 72),
    (1, 200, 200, 2, 2, 128),
    (1, 300, 300, 2, 2, 32),
    (1, 64, 64, 16, 1, 256),
    (1, 96, 96, 4, 2, 192, 128),
  ),
  "regimes": "all",
  "repeats": 2,
}

# A property-based search at BF16 (shapes and gate as drawn and set).
SEARCH = {"search_budget": 60, "precisions": "bf16-framework"}

VARIANTS = {
  "default": {},
  "smoke": SMOKE,
  "paper": PAPER,
  "edges": EDGES,
  "search": SEARCH,
  "decode": DECODE,
  "stable_grid": STABLE_GRID,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return with_variant(_default(), arg, VARIANTS)
