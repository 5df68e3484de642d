"""Forward-deviation experiment (paper Figs. 3-6, FA3 Table 3, and beyond).

Run:
  python launch/forward_deviation.py --workdir=runs/forward
  python launch/forward_deviation.py --workdir=runs/paper \
      --config=configs/forward_deviation.py:paper
  python launch/forward_deviation.py --workdir=runs/x \
      --config.studies=seq_len --config.seq_lens=256,1024

Variants: default (about 80 seconds on 2 CPU cores), `paper` (lengths to
8192, more tiles; under 10 minutes on 2 CPU cores), `smoke` (seconds; tests).

Expected outcome: deviation falls with mantissa bits; Flash vs golden is
within ~1-2x of Baseline vs golden under a shared policy at length 512 (the
paper's ~10x is not reproduced at these sizes; the report says which stage
drives the ratio); with outlier inputs at FP16, fp16-fa2 Flash is more
accurate than fp16-framework attention, as in FlashAttention-3. Tied
maxima: with two bit-identical winning keys in one tile and one-sign V,
Flash's O is biased away from zero (signed share about +0.98) under `bf16`
and `bf16-fa2+out_accum=bf16`; Qiu & Yao's fix (beta 2 or 7) brings the
latter to about 0; `bf16-fa2` (FP32 accumulator) shows no such bias.
"""

import ml_collections

ALL_STUDIES = (
  "format_sweep,against_golden,seq_len,tiles,stage_attribution,fa3_table3,"
  "tied_maxima,backward"
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.studies = ALL_STUDIES  # comma-separated subset of the studies
  c.seeds = 3  # every point is repeated over this many input seeds
  # Attention shape of most studies: [batch, seq_len, heads, head_dim].
  c.batch = 1
  c.heads = 2
  c.kv_heads = 2
  c.head_dim = 64
  c.seq_len = 512
  c.block_q = 64  # B_r; fixed tiles for every study but `tiles`
  c.block_k = 64  # B_c
  c.formats = "fp64,fp32,fp16,bf16"  # Fig. 3 / Fig. 4 / Fig. 6 formats
  c.distributions = "normal,uniform"  # first one is used by single-dist studies
  c.schemes = "fa2,fa1"  # rescaling schemes (Fig. 4 and attribution)
  c.seq_lens = (128, 256, 512, 1024, 2048)  # Fig. 5
  c.golden_seq_lens = (512, 2048)  # Fig. 4 at BF16/FP16 (with seq_len)
  c.seq_len_precisions = "bf16,bf16-fa2"
  c.tile_seq_len = 1024  # Fig. 6 length
  c.tile_sizes = ((16, 16), (32, 32), (64, 64), (128, 128))  # area sweep
  c.swap_tiles = (32, 128)  # B_r x B_c, and swapped
  c.equal_area_tiles = ((64, 64), (32, 128), (128, 32), (16, 256))
  c.sram_elements = (16384, 49152)  # 64 KiB and 192 KiB (A100) of fp32
  c.attribution_formats = "bf16"  # :paper adds fp16
  c.fa3_shape = (1, 512, 4, 128)  # batch, seq_len, heads, head_dim
  # Qiu & Yao's biased rounding: the policies it is measured under (every
  # stage BF16; their regime, FP32 statistics with a BF16 O accumulator;
  # real kernels), their fix's beta values (no fix is always measured), and
  # the conditions: bit-identical keys tied at each row's maximum, in one
  # tile or spread one per tile, V of one sign or zero-mean, and the untied
  # probability mass relative to the tied mass.
  c.tied_precisions = "bf16,bf16-fa2+out_accum=bf16,bf16-fa2"
  c.tied_betas = "2,7"
  c.tied_counts = "1,2,3,4"
  c.tied_placements = "same_tile,different_tiles"
  c.tied_values = "one_sign,zero_mean"
  c.tied_margins = "1e-1,1e-4,1e-7"
  c.tied_q_len = 64
  c.tied_kv_len = 256  # room for 4 ties in 4 tiles of 64
  c.tied_seeds = 1  # each condition already averages 64 x 256 x 2 heads
  c.backward_precisions = "fp32,bf16-fa2,bf16"  # :paper adds fp16-fa2
  c.backward_seq_lens = (256,)
  c.scale = 8.0  # multiplier of the `scaled` input distribution

  if arg == "paper":
    c.attribution_formats = "bf16,fp16"
    c.seq_lens = (128, 256, 512, 1024, 2048, 4096, 8192)
    c.golden_seq_lens = (512, 1024, 2048, 4096, 8192)
    c.tile_sizes = ((16, 16), (32, 32), (64, 64), (128, 128), (256, 256))
    c.tile_seq_len = 2048
    c.fa3_shape = (2, 1024, 8, 128)
    c.backward_precisions = "fp32,fp16-fa2,bf16-fa2,bf16"
    c.backward_seq_lens = (128, 512, 1024)
    c.tied_counts = "1,2,3,4,8"
    c.tied_margins = "1e-1,1e-2,1e-3,1e-4,1e-5,1e-6,1e-7,1e-8,1e-9"
    c.tied_kv_len = 512
  elif arg == "smoke":
    c.seeds = 2
    c.heads = 1
    c.kv_heads = 1
    c.head_dim = 16
    c.seq_len = 64
    c.block_q = 16
    c.block_k = 16
    c.formats = "fp64,fp32,bf16"
    c.distributions = "normal"
    c.schemes = "fa2"
    c.seq_lens = (32, 64)
    c.golden_seq_lens = (32, 64)
    c.seq_len_precisions = "bf16"
    c.tile_seq_len = 64
    c.tile_sizes = ((16, 16), (32, 32))
    c.swap_tiles = (16, 32)
    c.equal_area_tiles = ((16, 32), (32, 16))
    c.sram_elements = (1024,)
    c.attribution_formats = "bf16"
    c.fa3_shape = (1, 64, 1, 32)
    c.tied_precisions = "bf16-fa2+out_accum=bf16"
    c.tied_betas = "2"
    c.tied_counts = "2"
    c.tied_margins = "1e-4"
    c.tied_q_len = 32
    c.tied_kv_len = 32
    c.backward_precisions = "bf16-fa2"
    c.backward_seq_lens = (48,)
  elif arg not in (None, "", "default"):
    raise ValueError(
      f"Unknown config variant {arg!r}; valid: default, paper, smoke."
    )
  return c
