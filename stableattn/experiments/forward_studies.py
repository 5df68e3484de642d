"""The forward-deviation studies: which points each measures, and how.

A study lists its points (dicts of identifying parameters) and measures one
point for one seed, returning rows: one per comparison, each with every
field of `stableattn.Deviation`. Paper figures refer to Golden et al. (2024).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from stableattn.experiments.engine import Case, Engine, Kernel
from stableattn.inputs import Shape, TiedMaximaSpec, untied_mass_ratio
from stableattn.metrics import compare, safe_ratio
from stableattn.precision import MANTISSA_BITS, Precision, natural_policy
from stableattn.tiling import tiles_from_sram

# Stages that the all-format presets round and the -fa2 presets keep in FP32.
ATTRIBUTION_STAGES = ("scores", "softmax_stats", "out_accum")


@dataclasses.dataclass(frozen=True)
class Settings:
  """Typed experiment settings (built from the ConfigDict)."""

  studies: tuple[str, ...]
  seeds: int
  batch: int
  heads: int
  kv_heads: int
  head_dim: int
  seq_len: int
  block_q: int
  block_k: int
  formats: tuple[str, ...]
  distributions: tuple[str, ...]
  schemes: tuple[str, ...]
  golden_seq_lens: tuple[int, ...]  # Fig. 4 lengths beyond seq_len
  seq_lens: tuple[int, ...]
  seq_len_precisions: tuple[str, ...]
  tile_seq_len: int
  tile_sizes: tuple[tuple[int, int], ...]
  swap_tiles: tuple[int, int]
  equal_area_tiles: tuple[tuple[int, int], ...]
  sram_elements: tuple[int, ...]
  attribution_formats: tuple[str, ...]
  fa3_shape: tuple[int, int, int, int]  # batch, seq_len, heads, head_dim
  tied_precisions: tuple[str, ...]
  tied_betas: tuple[float, ...]
  tied_counts: tuple[int, ...]
  tied_placements: tuple[str, ...]
  tied_values: tuple[str, ...]
  tied_margins: tuple[float, ...]
  tied_q_len: int
  tied_kv_len: int
  tied_seeds: int
  backward_precisions: tuple[str, ...]
  backward_seq_lens: tuple[int, ...]
  scale: float

  def shape(self, seq_len: int | None = None) -> Shape:
    length = self.seq_len if seq_len is None else seq_len
    return Shape(
      self.batch, length, length, self.heads, self.kv_heads, self.head_dim
    )


def deviation_fields(expected, actual, prefix: str = "") -> dict:
  d = compare(expected, actual).as_dict()
  return {prefix + k: v for k, v in d.items()}


def _flash(policy, block_q, block_k, scheme="fa2") -> Kernel:
  return Kernel("pallas", Precision.from_name(policy), block_q, block_k, scheme)


def _baseline(policy) -> Kernel:
  return Kernel("reference", Precision.from_name(policy))


def _against_golden(
  engine: Engine, flash: Kernel, baseline: Kernel, case: Case
) -> list[dict]:
  """Rows flash_vs_golden and baseline_vs_golden, with their ratio."""
  gold = engine.golden(case)
  flash_dev = compare(gold, engine.output(flash, case))
  base_dev = compare(gold, engine.output(baseline, case))
  ratios = {
    f"ratio_{m}": safe_ratio(getattr(flash_dev, m), getattr(base_dev, m))
    for m in ("max_abs", "rmse")
  }
  return [
    {"comparison": "flash_vs_golden", **flash_dev.as_dict(), **ratios},
    {"comparison": "baseline_vs_golden", **base_dev.as_dict()},
  ]


def _pairwise(
  engine: Engine,
  flash: Kernel,
  baseline: Kernel,
  case: Case,
  with_baseline_vs_golden: bool = True,
) -> list[dict]:
  """Rows flash_vs_baseline, flash_vs_golden (and baseline_vs_golden)."""
  flash_out = engine.output(flash, case)
  base_out = engine.output(baseline, case)
  gold = engine.golden(case)
  rows = [
    {
      "comparison": "flash_vs_baseline",
      **deviation_fields(base_out, flash_out),
    },
    {"comparison": "flash_vs_golden", **deviation_fields(gold, flash_out)},
  ]
  if with_baseline_vs_golden:
    rows.append(
      {"comparison": "baseline_vs_golden", **deviation_fields(gold, base_out)}
    )
  return rows


class Study:
  name = ""
  title = ""

  def points(self, s: Settings) -> list[dict]:
    raise NotImplementedError

  def seeds(self, s: Settings) -> int:
    return s.seeds

  def measure(
    self, engine: Engine, s: Settings, point: dict, seed: int
  ) -> list[dict]:
    raise NotImplementedError


class FormatSweep(Study):
  name = "format_sweep"
  title = "Flash vs Baseline at the same format (paper Fig. 3)"

  def points(self, s):
    points = []
    for fmt in s.formats:
      families = (
        ["all-stage"] if fmt in ("fp64", "fp32") else ["all-stage", "fa2"]
      )
      for family in families:
        policy = fmt if family == "all-stage" else natural_policy(fmt, "flash")
        points.append(
          {
            "format": fmt,
            "family": family,
            "policy": policy,
            "distribution": s.distributions[0],
          }
        )
    return points

  def measure(self, engine, s, p, seed):
    case = Case(p["distribution"], s.shape(), p["format"], seed)
    return _pairwise(
      engine,
      _flash(p["policy"], s.block_q, s.block_k),
      _baseline(p["policy"]),
      case,
    )


class AgainstGolden(Study):
  name = "against_golden"
  title = "Flash and Baseline vs the FP64 golden value (paper Fig. 4)"

  def points(self, s):
    points = []
    for fmt in s.formats:
      if fmt in ("fp64", "fp32"):
        pairs = [(fmt, fmt)]
      else:
        pairs = [
          (flash, base)
          for flash in (fmt, f"{fmt}-fa2")
          for base in (flash, f"{fmt}-framework")
        ]
      # Fig. 4's ratio grows with the number of key blocks: the half
      # formats are mapped over length too.
      lengths = (
        sorted({s.seq_len, *s.golden_seq_lens})
        if fmt in ("bf16", "fp16")
        else [s.seq_len]
      )
      for flash_policy, baseline_policy in pairs:
        for scheme in s.schemes:
          for dist in s.distributions:
            for length in lengths:
              points.append(
                {
                  "format": fmt,
                  "flash_policy": flash_policy,
                  "baseline_policy": baseline_policy,
                  "scheme": scheme,
                  "distribution": dist,
                  "seq_len": length,
                }
              )
    return points

  def measure(self, engine, s, p, seed):
    case = Case(p["distribution"], s.shape(p["seq_len"]), p["format"], seed)
    flash = _flash(p["flash_policy"], s.block_q, s.block_k, p["scheme"])
    return _against_golden(engine, flash, _baseline(p["baseline_policy"]), case)


class SequenceLength(Study):
  name = "seq_len"
  title = "Deviation vs sequence length at fixed tiles (paper Fig. 5)"

  def points(self, s):
    return [
      {
        "policy": policy,
        "seq_len": n,
        "block_q": s.block_q,
        "block_k": s.block_k,
        "n_rescales": -(-n // s.block_k) - 1,
        "distribution": dist,
      }
      for policy in s.seq_len_precisions
      for dist in s.distributions
      for n in s.seq_lens
    ]

  def measure(self, engine, s, p, seed):
    fmt = Precision.from_name(p["policy"]).inputs
    case = Case(p["distribution"], s.shape(p["seq_len"]), fmt, seed)
    return _pairwise(
      engine,
      _flash(p["policy"], s.block_q, s.block_k),
      _baseline(p["policy"]),
      case,
    )


class Tiles(Study):
  name = "tiles"
  title = "Deviation vs tile sizes (paper Fig. 6)"

  def points(self, s):
    points = []

    def add(variant, block_q, block_k, fmt, **extra):
      points.append(
        {
          "variant": variant,
          "block_q": block_q,
          "block_k": block_k,
          "block_area": block_q * block_k,
          "format": fmt,
          "seq_len": s.tile_seq_len,
          "distribution": s.distributions[0],
          **extra,
        }
      )

    for fmt in s.formats:
      for block_q, block_k in s.tile_sizes:
        add("area", block_q, block_k, fmt)
    # The detailed tile variants run at the coarsest format in the sweep.
    low = min(s.formats, key=MANTISSA_BITS.get)
    swap_q, swap_k = s.swap_tiles
    add("swap", swap_q, swap_k, low)
    add("swap", swap_k, swap_q, low)
    for block_q, block_k in s.equal_area_tiles:
      add("equal_area", block_q, block_k, low)
    for sram in s.sram_elements:
      tiles = tiles_from_sram(sram, s.head_dim)
      add("sram", tiles.block_q, tiles.block_k, low, sram_elements=sram)
    return points

  def measure(self, engine, s, p, seed):
    case = Case(p["distribution"], s.shape(p["seq_len"]), p["format"], seed)
    flash = _flash(p["format"], p["block_q"], p["block_k"])
    return _pairwise(
      engine, flash, _baseline(p["format"]), case, with_baseline_vs_golden=False
    )


def attribution_variants(fmt: str) -> dict[str, Precision]:
  """Policies between `{fmt}-fa2` and the all-`fmt` preset, one stage apart."""
  base = Precision.from_name(f"{fmt}-fa2")
  every = Precision.from_name(fmt)
  variants = {"fa2 preset": base, f"all {fmt}": every}
  for stage in ATTRIBUTION_STAGES:
    variants[f"only {stage}"] = base.with_stage(**{stage: fmt})
    variants[f"all but {stage}"] = every.with_stage(**{stage: "fp32"})
  return variants


class StageAttribution(Study):
  name = "stage_attribution"
  title = "Which rounding stage causes the deviation (beyond the paper)"

  def points(self, s):
    return [
      {
        "format": fmt,
        "variant": variant,
        "scheme": scheme,
        "distribution": dist,
      }
      for fmt in s.attribution_formats
      for variant in attribution_variants(fmt)
      for scheme in s.schemes
      for dist in s.distributions
    ]

  def measure(self, engine, s, p, seed):
    policy = attribution_variants(p["format"])[p["variant"]]
    case = Case(p["distribution"], s.shape(), p["format"], seed)
    flash = Kernel("pallas", policy, s.block_q, s.block_k, p["scheme"])
    return _against_golden(engine, flash, Kernel("reference", policy), case)


class FA3Table3(Study):
  name = "fa3_table3"
  title = "FlashAttention-3 Table 3, FP16 column (outlier inputs, RMSE)"

  def points(self, s):
    batch, seq_len, heads, head_dim = s.fa3_shape
    return [
      {
        "batch": batch,
        "seq_len": seq_len,
        "heads": heads,
        "head_dim": head_dim,
        "flash_policy": "fp16-fa2",
        "baseline_policy": "fp16-framework",
        "distribution": "outliers",
      }
    ]

  def measure(self, engine, s, p, seed):
    shape = Shape(
      p["batch"],
      p["seq_len"],
      p["seq_len"],
      p["heads"],
      p["heads"],
      p["head_dim"],
    )
    case = Case(p["distribution"], shape, "fp16", seed)
    flash = _flash(p["flash_policy"], s.block_q, s.block_k)
    return _against_golden(engine, flash, _baseline(p["baseline_policy"]), case)


# V for Qiu & Yao's conditions: one sign in one binade, or zero-mean.
TIED_VALUES = {"one_sign": (-1.5, 0.2), "zero_mean": (0.0, 1.0)}
TIED_PLACEMENTS = ("same_tile", "different_tiles")
# The condition their mechanism needs (Qiu & Yao, arXiv 2510.04212): two
# exact ties in one tile, one-sign V, an untied mass within the window.
HEADLINE_TIES, HEADLINE_MARGIN = 2, 1e-4


def tied_headline(s: Settings) -> dict:
  """The condition the study's first table reports (nearest in the grid)."""
  ties = min(s.tied_counts, key=lambda n: (abs(n - HEADLINE_TIES), -n))
  margin = min(
    s.tied_margins,
    key=lambda m: abs(np.log10(m) - np.log10(HEADLINE_MARGIN)),
  )
  return {
    "ties": ties,
    "placement": TIED_PLACEMENTS[0],
    "values": "one_sign" if "one_sign" in s.tied_values else s.tied_values[0],
    "margin": margin,
  }


class TiedMaxima(Study):
  name = "tied_maxima"
  title = "Biased rounding with tied row maxima (Qiu & Yao)"

  def seeds(self, s):
    # Each condition averages every element of every row already.
    return s.tied_seeds

  def points(self, s):
    headline = tied_headline(s)
    points = []
    for ties in s.tied_counts:
      for placement in s.tied_placements:
        if ties == 1 and placement != "same_tile":
          continue  # one key is in one tile either way
        for values in s.tied_values:
          for margin in s.tied_margins:
            condition = {
              "ties": ties,
              "placement": placement,
              "values": values,
              "margin": margin,
            }
            points.append(
              {
                **condition,
                "q_len": s.tied_q_len,
                "kv_len": s.tied_kv_len,
                "headline": condition == headline,
              }
            )
    return points

  def measure(self, engine, s, p, seed):
    v_mean, v_spread = TIED_VALUES[p["values"]]
    spec = TiedMaximaSpec(
      ties=p["ties"],
      same_tile=p["placement"] == "same_tile",
      block_k=s.block_k,
      margin=p["margin"],
      v_mean=v_mean,
      v_spread=v_spread,
    )
    shape = Shape(
      s.batch, p["q_len"], p["kv_len"], s.heads, s.kv_heads, s.head_dim
    )
    rows = []
    for name in s.tied_precisions:
      policy = Precision.from_name(name)
      case = Case("tied_maxima", shape, policy.inputs, seed, tied=spec)
      q, k, _ = engine.inputs(case)
      gold = engine.golden(case)
      extra = {"realized_margin": untied_mass_ratio(q, k)}
      for beta in (None, *s.tied_betas):
        kernels = {
          "flash": Kernel(
            "pallas", policy, s.block_q, s.block_k, "fa2", tie_beta=beta
          ),
          "baseline": Kernel("reference", policy, tie_beta=beta),
        }
        for implementation, kernel in kernels.items():
          ident = {
            "comparison": f"{implementation}_vs_golden",
            "implementation": implementation,
            "policy": name,
            "tie_beta": beta,
            **extra,
          }
          out = engine.output(kernel, case)
          rows.append({"quantity": "O", **ident, **deviation_fields(gold, out)})
          # delta = rowsum(dO * O) carries a biased O into every gradient
          # when dO has one sign; with a random-sign dO it averages out.
          for sign in ("positive", "random"):
            d_out = engine.d_out(case, sign)
            rows.append(
              {
                "quantity": f"delta(dO {sign})",
                **ident,
                **deviation_fields(
                  np.sum(d_out * gold, -1), np.sum(d_out * out, -1)
                ),
              }
            )
          if p["headline"] and implementation == "flash":
            golden_grads = engine.golden_grads(case, "positive")
            grads = engine.grads(kernel, case, "positive")
            for grad, g, gg in zip(("dq", "dk", "dv"), grads, golden_grads):
              rows.append(
                {"quantity": grad, **ident, **deviation_fields(gg, g)}
              )
    return rows


class BackwardDeviation(Study):
  name = "backward"
  title = "Gradient deviation: dQ, dK, dV vs golden gradients"

  def points(self, s):
    return [
      {"policy": policy, "seq_len": n, "distribution": s.distributions[0]}
      for policy in s.backward_precisions
      for n in s.backward_seq_lens
    ]

  def measure(self, engine, s, p, seed):
    fmt = Precision.from_name(p["policy"]).inputs
    case = Case(p["distribution"], s.shape(p["seq_len"]), fmt, seed)
    golden = engine.golden_grads(case)
    flash = engine.grads(_flash(p["policy"], s.block_q, s.block_k), case)
    base = engine.grads(_baseline(p["policy"]), case)
    rows = []
    for i, grad in enumerate(("dq", "dk", "dv")):
      flash_dev = compare(golden[i], flash[i])
      base_dev = compare(golden[i], base[i])
      rows.append(
        {
          "comparison": "flash_vs_golden",
          "grad": grad,
          **flash_dev.as_dict(),
          "ratio_max_abs": safe_ratio(flash_dev.max_abs, base_dev.max_abs),
          "ratio_rmse": safe_ratio(flash_dev.rmse, base_dev.rmse),
        }
      )
      rows.append(
        {"comparison": "baseline_vs_golden", "grad": grad, **base_dev.as_dict()}
      )
    return rows


STUDIES = {
  study.name: study
  for study in (
    FormatSweep(),
    AgainstGolden(),
    SequenceLength(),
    Tiles(),
    StageAttribution(),
    FA3Table3(),
    TiedMaxima(),
    BackwardDeviation(),
  )
}
