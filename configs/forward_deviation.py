"""Forward-deviation experiment (paper Figs. 3-6, FA3 Table 3, and beyond).

Run:
  python launch/forward_deviation.py --workdir=runs/forward
  python launch/forward_deviation.py --workdir=runs/paper \
      --config=paper
  python launch/forward_deviation.py --workdir=runs/x \
      --config.studies=seq_len --config.seq_len.lengths=256,1024

Layout: `common` (shape, tiles, seeds, formats, inputs, schemes) is read by
every study; each study reads its own section, named after it, into the
dataclass its module declares (`study.Common`, each study's `Config`: the
fields' types and valid values). Every value, default and per variant,
lives here.

Variants: default (about 70-90 seconds on 2 CPU cores; every study but
those in `OPT_IN`, attention features and below 16 bits, which add 20-45
seconds each: select them with `--config.studies=`), `paper` (every
study, lengths to 8192, more tiles and tie conditions; 8 minutes on 2 CPU
cores without the opt-in studies, whose paper sizes are not timed yet),
`smoke` (every study but the three FP8 policy maps and the ring; seconds;
tests).

Expected outcome (default): deviation falls with mantissa bits (Fig. 3).
The paper's ~10x (Fig. 4) is reproduced in part: with every stage in BF16
and uniform [0, 1) inputs Flash deviates about 12x as much as the framework
Baseline from FP64 at length 2048, and less at shorter lengths; never with
standard-normal inputs; under each kernel's natural policy (Flash
`bf16-fa2`, Baseline `bf16-framework`) Flash is about 2x *more* accurate.
Deviation grows with length only for uniform inputs with every stage in
BF16 (Fig. 5). With outlier inputs at FP16, fp16-fa2 Flash is more accurate
than fp16-framework attention, as in FlashAttention-3. Tied maxima: with
two bit-identical winning keys in one tile and one-sign V, Flash's O is
biased away from zero (signed share about +0.98) under `bf16` and
`bf16-fa2+out_accum=bf16`; Qiu & Yao's fix (beta 2; the paper variant adds
7) brings the latter to about 0; `bf16-fa2` (FP32 accumulator) shows no
such bias. With `features` selected: attention features (causal, a KV
cache, windows, softcap, packed segments, a sink, ALiBi) keep Flash's error
relative to Baseline within 1.5x of plain or causal attention's; with
`fa3_fp8`: the FP8 baseline / fp8-fa3 RMSE ratio is 1.4-3.6
(FlashAttention-3: 2.6), and switching the rotation off gives back most of
the gain only if the baseline keeps P in FP16 (length 2048, head dims
128-256); with `fp8_stages`: Q, K and V in e4m3 set fp8-fa3's error, not P;
with `fp8_underflow`: key order and P's scale matter only with P alone in
e4m3 and peaked (outlier) rows; with `sage_fp8`: smoothing K helps where K
has a channel bias; with `long_context` (4.6 minutes, to 131,072 keys):
Hopper's one-level truncating FP8 accumulator doubles the error at 128K
keys with normal inputs, two-level accumulation restores it. The report
computes each of these verdicts from its rows.
"""

import ml_collections

from stableattn.experiments.forward import STUDIES
from stableattn.harness.config_values import with_variant

# Studies a default run leaves out (attention features, below 16 bits,
# inference, context parallelism; 20 seconds to 5 minutes each cold); the
# paper variant runs them, the smoke variant all but the three whose rows
# are each a policy of their own (their smoke sizes run in
# tests/test_quantization.py, once) and the ring, whose devices must be
# simulated before JAX starts (tests/test_ring_attention.py).
OPT_IN = (
  "features",
  "fa3_fp8",
  "fp8_underflow",
  "sage_fp8",
  "fp8_stages",
  "inference",
  "context_parallel",
  "long_context",
)
SMOKE_SKIPS = ("fp8_underflow", "sage_fp8", "fp8_stages", "context_parallel")


def _common(c: ml_collections.ConfigDict) -> None:
  # Read by every study: shape, tiles, seeds, formats, inputs, schemes.
  c.common = ml_collections.ConfigDict()
  # Every point is repeated over this many input seeds.
  c.common.seeds = 3
  # Attention shape of most studies: [batch, seq_len, heads, head_dim].
  c.common.batch = 1
  c.common.heads = 2
  c.common.kv_heads = 2
  c.common.head_dim = 64
  c.common.seq_len = 512
  # Tiles B_r x B_c of every study but `tiles`.
  c.common.block_q = 64
  c.common.block_k = 64
  c.common.formats = "fp64,fp32,fp16,bf16"
  # The first distribution is used by single-distribution studies.
  c.common.distributions = "normal,uniform"
  c.common.schemes = "fa2,fa1"
  # Multiplier of the `scaled` input distribution.
  c.common.scale = 8.0


def _paper_studies(c: ml_collections.ConfigDict) -> None:
  """The sections of the studies that measure the paper's figures and
  FlashAttention-3's Table 3."""
  # Flash vs Baseline at the same format (paper Fig. 3) (no settings of its own)
  c.format_sweep = ml_collections.ConfigDict()
  # Flash and Baseline vs the FP64 golden value (paper Fig. 4)
  c.against_golden = ml_collections.ConfigDict()
  # These half formats are also measured at these lengths (with
  # common.seq_len). Fig. 4's claim is BF16's; FP16 at length (13 s of the
  # default run's 100 on 2 cores) is the paper variant's.
  c.against_golden.seq_lens = (512, 2048)
  c.against_golden.length_formats = "bf16"
  # Deviation vs sequence length at fixed tiles (paper Fig. 5)
  c.seq_len = ml_collections.ConfigDict()
  c.seq_len.lengths = (128, 256, 512, 1024, 2048)
  c.seq_len.precisions = "bf16,bf16-fa2"
  # Deviation vs tile sizes (paper Fig. 6)
  c.tiles = ml_collections.ConfigDict()
  c.tiles.seq_len = 1024
  # FP64 adds a floor and no verdict (Fig. 6c judges the formats below
  # it); the paper variant shows it.
  c.tiles.formats = "fp32,fp16,bf16"
  c.tiles.sizes = ((16, 16), (32, 32), (64, 64), (128, 128))
  # B_r x B_c, and swapped.
  c.tiles.swap = (32, 128)
  c.tiles.equal_area = ((64, 64), (32, 128), (128, 32), (16, 256))
  # 64 KiB and 192 KiB (A100) of FP32, for FlashAttention-1's tile formula.
  c.tiles.sram_elements = (16384, 49152)
  # Which rounding stage causes the deviation (beyond the paper)
  c.stage_attribution = ml_collections.ConfigDict()
  c.stage_attribution.formats = "bf16"
  # FlashAttention-3 Table 3, FP16 column (outlier inputs, RMSE)
  c.fa3_table3 = ml_collections.ConfigDict()
  # batch, seq_len, heads, head_dim
  c.fa3_table3.shape = (1, 512, 4, 128)
  # FlashAttention-3 Table 3, FP16 and FP8 (outlier inputs, RMSE)
  c.fa3_fp8 = ml_collections.ConfigDict()
  c.fa3_fp8.seq_lens = (512, 2048)
  c.fa3_fp8.heads = 2
  c.fa3_fp8.head_dims = (64, 128, 256)
  # Standard deviation of the outlier spikes: 10 is FlashAttention-3's
  # N(0, 100) read as a variance, 100 as a standard deviation.
  c.fa3_fp8.outlier_stds = (10.0,)
  c.fa3_fp8.seeds = 2
  # Biased rounding with tied row maxima (Qiu & Yao)
  c.tied_maxima = ml_collections.ConfigDict()
  c.tied_maxima.precisions = "bf16,bf16-fa2+out_accum=bf16,bf16-fa2"
  # Qiu & Yao's beta 2; the paper variant adds 7 (a third of the study's
  # compiled programs).
  c.tied_maxima.betas = "2"
  c.tied_maxima.counts = "1,2,3,4"
  c.tied_maxima.placements = "same_tile,different_tiles"
  c.tied_maxima.values = "one_sign,zero_mean"
  c.tied_maxima.margins = "1e-1,1e-4,1e-7"
  c.tied_maxima.q_len = 64
  c.tied_maxima.kv_len = 256
  # Each condition already averages 64 x 256 x 2 heads.
  c.tied_maxima.seeds = 1
  # Gradient deviation: dQ, dK, dV vs golden gradients
  c.backward = ml_collections.ConfigDict()
  c.backward.precisions = "fp32,bf16-fa2,bf16"
  c.backward.seq_lens = (256,)


def _further_studies(c: ml_collections.ConfigDict) -> None:
  """The sections of the studies beyond the paper: features, below 16 bits,
  inference and context parallelism."""
  # Attention features: how each changes Flash's deviation
  c.features = ml_collections.ConfigDict()
  c.features.settings = (
    "plain,causal,kv_cache,window_64,softcap_30,segments_4,sink,alibi"
  )
  c.features.pairings = "natural,all_stage"
  # Seeds of this study (fewer than the common section's: eight settings).
  c.features.seeds = 1
  # FP8 P underflow: key-block order and a static P scale
  c.fp8_underflow = ml_collections.ConfigDict()
  c.fp8_underflow.seq_len = 512
  c.fp8_underflow.head_dim = 64
  c.fp8_underflow.distributions = "normal,outliers,key_bias"
  c.fp8_underflow.causal = "false,true"
  # Static scales of P measured (1 and 256 are the claim's rows).
  c.fp8_underflow.p_scales = (1, 256, 448)
  c.fp8_underflow.seeds = 2
  # SageAttention 2's directions in FP8
  c.sage_fp8 = ml_collections.ConfigDict()
  c.sage_fp8.seq_len = 512
  c.sage_fp8.head_dims = (64, 128)
  c.sage_fp8.distributions = "key_bias,normal,outliers"
  c.sage_fp8.seeds = 2
  # Stage attribution at FP8: which quantization costs what
  c.fp8_stages = ml_collections.ConfigDict()
  c.fp8_stages.seq_len = 512
  c.fp8_stages.head_dims = (64, 128)
  c.fp8_stages.distributions = "normal,outliers"
  c.fp8_stages.seeds = 2
  # Inference: split-KV, batch, chunked prefill, pages, decode position
  c.inference = ml_collections.ConfigDict()
  c.inference.policies = "bf16-fa2,fp16-fa2,fp8-fa3"
  # The partial outputs of split-KV in FP32 or in the input format.
  c.inference.partials = "fp32,input"
  c.inference.cache_len = 512
  c.inference.batch = 8  # sequences in the decode step
  c.inference.split_counts = (1, 2, 4, 8, 16, 64)
  # Multiples of common.block_k; the first is the batch-invariant schedule.
  c.inference.split_sizes = (64, 128, 256)
  c.inference.batch_sizes = (16, 64)  # the step among N sequences
  c.inference.chunk_sizes = (64, 128)
  c.inference.page_sizes = (64, 128)
  c.inference.positions = 8
  c.inference.seeds = 2
  # Context parallelism: ring attention over simulated devices
  c.context_parallel = ml_collections.ConfigDict()
  c.context_parallel.policies = "bf16-fa2,fp16-fa2"
  c.context_parallel.layouts = "causal_balanced,causal,full"
  c.context_parallel.device_counts = (1, 2, 4, 8)
  # Merge, ring direction and partials vary at this count (0: not at all).
  c.context_parallel.vary_at = 4
  c.context_parallel.seq_len = 512
  c.context_parallel.seeds = 2
  # Long context and the tensor core's accumulator: decode rows over up to
  # 128K keys, FP64 for those rows only
  c.long_context = ml_collections.ConfigDict()
  c.long_context.lengths = (1024, 4096, 16384, 65536, 131072)
  c.long_context.policies = (
    "bf16-fa2,fp16-fa2,fp8 (FP32 accumulator),"
    "fp8-fa3 (block scales + rotation),fp8 KV cache (BF16 Q),"
    "fp8 one-level (Hopper),"
    "fp8 one-level (nearest),two-level n=1,two-level n=4,two-level n=64"
  )
  c.long_context.distributions = "normal,outliers,sink,needle"
  c.long_context.query_rows = 16  # decode rows per sequence
  c.long_context.batch = 4  # sequences per point: 64 needles a seed
  c.long_context.head_dim = 128
  c.long_context.block_k = 128
  c.long_context.seeds = 3


def _default() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Comma-separated subset of the studies. The default leaves out the
  # opt-in studies (`OPT_IN`) to stay under two minutes; the paper variant
  # runs every study, the smoke variant all but `SMOKE_SKIPS`.
  c.studies = ",".join(s for s in STUDIES if s not in OPT_IN)
  _common(c)
  _paper_studies(c)
  _further_studies(c)
  return c


PAPER = {
  "studies": ",".join(STUDIES),
  "against_golden.seq_lens": (512, 1024, 2048, 4096, 8192),
  "against_golden.length_formats": "bf16,fp16",
  "seq_len.lengths": (128, 256, 512, 1024, 2048, 4096, 8192),
  "tiles.sizes": ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256)),
  "tiles.seq_len": 2048,
  "tiles.formats": "fp64,fp32,fp16,bf16",
  "stage_attribution.formats": "bf16,fp16",
  "fa3_table3.shape": (2, 1024, 8, 128),
  "fa3_fp8.seq_lens": (512, 1024, 2048, 4096),
  "fa3_fp8.head_dims": (64, 128, 256),
  "fa3_fp8.outlier_stds": (10.0, 100.0),
  "fa3_fp8.seeds": 3,
  "tied_maxima.betas": "2,7",
  "tied_maxima.counts": "1,2,3,4,8",
  "tied_maxima.margins": "1e-1,1e-2,1e-3,1e-4,1e-5,1e-6,1e-7,1e-8,1e-9",
  "tied_maxima.kv_len": 512,
  "backward.precisions": "fp32,fp16-fa2,bf16-fa2,bf16",
  "backward.seq_lens": (128, 512, 1024),
  "features.settings": (
    "plain,causal,kv_cache,window_64,window_256,softcap_30,softcap_50,"
    "segments_4,sink,alibi"
  ),
  "features.seeds": 2,
  "fp8_underflow.seq_len": 2048,
  "fp8_underflow.seeds": 3,
  "sage_fp8.seq_len": 2048,
  "sage_fp8.seeds": 3,
  "fp8_stages.seq_len": 2048,
  "fp8_stages.seeds": 3,
  "inference.cache_len": 2048,
  "inference.split_sizes": (64, 256, 1024),
  "inference.chunk_sizes": (64, 256, 512),
  "inference.page_sizes": (64, 256),
  "inference.seeds": 3,
}
SMOKE = {
  "studies": ",".join(s for s in STUDIES if s not in SMOKE_SKIPS),
  "common.seeds": 2,
  "common.heads": 1,
  "common.kv_heads": 1,
  "common.head_dim": 16,
  "common.seq_len": 64,
  "common.block_q": 16,
  "common.block_k": 16,
  "common.formats": "fp64,fp32,bf16",
  "common.distributions": "normal",
  "common.schemes": "fa2",
  "against_golden.seq_lens": (32, 64),
  "seq_len.lengths": (32, 64),
  "seq_len.precisions": "bf16",
  "tiles.seq_len": 64,
  "tiles.formats": "fp64,fp32,bf16",
  "tiles.sizes": ((16, 16), (32, 32)),
  "tiles.swap": (16, 32),
  "tiles.equal_area": ((16, 32), (32, 16)),
  "tiles.sram_elements": (1024,),
  "stage_attribution.formats": "bf16",
  "fa3_table3.shape": (1, 64, 1, 32),
  "fa3_fp8.seq_lens": (64,),
  "fa3_fp8.heads": 1,
  "fa3_fp8.head_dims": (32,),
  "fa3_fp8.outlier_stds": (10.0,),
  "fa3_fp8.seeds": 1,
  "tied_maxima.precisions": "bf16-fa2+out_accum=bf16",
  "tied_maxima.betas": "2",
  "tied_maxima.counts": "2",
  "tied_maxima.margins": "1e-4",
  "tied_maxima.q_len": 32,
  "tied_maxima.kv_len": 32,
  "backward.precisions": "bf16-fa2",
  "backward.seq_lens": (48,),
  "features.settings": "plain,causal,kv_cache,softcap_30",
  "features.pairings": "natural",
  "features.seeds": 1,
  "fp8_underflow.seq_len": 64,
  "fp8_underflow.head_dim": 32,
  "fp8_underflow.distributions": "normal",
  "fp8_underflow.causal": "false",
  "fp8_underflow.p_scales": (1, 256),
  "fp8_underflow.seeds": 1,
  "sage_fp8.seq_len": 64,
  "sage_fp8.head_dims": (32,),
  "sage_fp8.distributions": "key_bias",
  "sage_fp8.seeds": 1,
  "fp8_stages.seq_len": 64,
  "fp8_stages.head_dims": (32,),
  "fp8_stages.distributions": "normal",
  "fp8_stages.seeds": 1,
  "inference.policies": "bf16-fa2",
  "inference.cache_len": 64,
  "inference.batch": 4,
  "inference.split_counts": (1, 4),
  "inference.split_sizes": (32,),
  "inference.batch_sizes": (64,),
  "inference.chunk_sizes": (32,),
  "inference.page_sizes": (16,),
  "inference.positions": 3,
  "inference.seeds": 1,
  "context_parallel.policies": "bf16-fa2",
  "context_parallel.layouts": "causal_balanced",
  "context_parallel.device_counts": (2,),
  "context_parallel.vary_at": 0,
  "context_parallel.seq_len": 64,
  "context_parallel.seeds": 1,
  "long_context.lengths": (128, 256, 512),
  "long_context.policies": (
    "fp8 (FP32 accumulator),fp8 one-level (Hopper),two-level n=1,"
    "two-level n=4,two-level n=64"
  ),
  "long_context.query_rows": 4,
  "long_context.batch": 1,
  "long_context.head_dim": 32,
  "long_context.block_k": 32,
  "long_context.seeds": 1,
}

VARIANTS = {"default": {}, "paper": PAPER, "smoke": SMOKE}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return with_variant(_default(), arg, VARIANTS)
